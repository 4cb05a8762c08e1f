"""Peer memory: collectives among the GPUs of one node by loads and stores into each other's memory.

Design note.

* **Buffers.** Each rank allocates one slot buffer and one flag area with ``cudaMalloc`` and
  shares them with CUDA IPC (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle`` through CuPy's
  runtime bindings); the 64-byte handles travel over the CPU side of the group. This is the
  mechanism NCCL's P2P transport and vLLM's custom all-reduce rest on, and it is public and
  stable on every torch we support. torch's symmetric memory gives the same peer-mapped memory,
  but from a private module (``torch.distributed._symmetric_memory``) whose backends and
  rendezvous have changed from release to release and which sets up NVLink multicast unless
  told not to, which these machines must never use. The handle mechanism does not touch the data
  path: both end in plain peer pointers, so there is no speed to choose between.
* **Push, not pull.** A kernel stores its input straight into the peers' slots (remote writes
  over NVLink are posted: no round trip per access) and reduces what landed in its own slots. A
  pull design reads peers' buffers, so every input must first be copied into the shared buffer:
  one more pass over the data (about 0.5 ms per GB on an H200, whose local copies move about
  4 TB/s counting reads and writes).
* **Ordering.** Flags per (block, stage, source rank) in the flag area, holding the call's
  number from a counter in device memory (so CUDA graphs replay correctly). Calls alternate
  between two halves of the slots, which makes a "done" barrier unnecessary: a rank starting
  call e knows every peer has finished call e - 2. Stores, then ``fence.sys``, then the flag;
  waits are acquire loads bounded by ``%globaltimer``. See ``peer.cuh`` (the header every kernel
  module is compiled after) for the timeline and the argument.
* **Host cost.** A small call's budget is a few microseconds of host time: launches go through
  ``cuLaunchKernel`` with prebuilt parameter blocks (``_launch.py``), the pieces of each
  (algorithm, dtype, size) are planned once, and the dispatch point keeps a fast path for
  repeated call signatures (``collectives/dispatch.py:dispatch_tensors``).
* **Algorithms.** ``one_shot`` (all-reduce: every rank pushes everything and reduces everything;
  reduce-scatter and all-gather: every rank pushes each peer its part), ``two_shot``
  (all-reduce as reduce-scatter then all-gather by pushes: each byte crosses the link once each
  way, the least there is) and ``copy_engine`` (the same bytes moved by cudaMemcpyAsync on two
  streams, SMs only reducing, chunks through a ring of slots). Messages larger than the slot
  buffer run in pieces. Their host logic lives in their modules in ``collectives/algos``; the
  kernels here, in ``kernels.cu``.
* **Never multicast.** Nothing here creates multicast objects or uses ``multimem`` instructions.

The public objects are :class:`PeerMemory` (the buffers, the flags, the error record and the
launch API: ``kernel``, ``stream``, ``device_index``, ``blocks``, ``validate``) and its
:class:`CopyEngines` (``pm.copy_engines``: copies and flags by copy engines). The registered
algorithms (``collectives/algos``) and the overlapped operators (``overlap/``) use them through
:func:`peer_memory`; this package imports neither.
"""

from __future__ import annotations

from .copy_engines import CE_PULLED, CE_PUSHED, CE_REDUCED, CE_RING, CopyEngines
from .memory import DTYPES, PeerMemory, close_peer_memory, has_peer_memory, peer_memory, peer_unavailable

__all__ = ["PeerMemory", "CopyEngines", "peer_memory", "has_peer_memory", "close_peer_memory", "peer_unavailable",
           "DTYPES", "CE_RING", "CE_PUSHED", "CE_REDUCED", "CE_PULLED"]
