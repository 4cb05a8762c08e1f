"""``PeerMemory``: one communicator's slot buffers and flags, and the launch API of the code built on them.

Each rank allocates two IPC buffers that every peer maps: the slots (``slot_bytes``, two sets,
where peers push data) and the flag allocation (block flags, copy-engine flags, then the
low-latency words' own area; ``_layout.py``). ``PeerMemory`` owns them: the IPC set-up and the
collective close, the error record the kernels write (``check()`` raises from it), views of this
rank's own slots and a bounded barrier. Code that runs on the buffers goes through a small launch
API: ``kernel()`` (an entry point bound to this memory's context, from ``kernels.cu`` or from a
source of the caller's own, compiled after ``peer.cuh``), ``stream()`` (torch's current raw
stream of the device), ``device_index``, ``blocks()`` (the grid of the SM kernels), ``validate()``
(a tensor the kernels can take) and ``copy_engines`` (``copy_engines.py``: copies and flags by
copy engines). ``state()`` keeps what such code derives from the grid or the buffers, cleared
when either changes. CuPy is imported only when peer memory is first built.

Design note. This class once also held the peer algorithms' host logic (planning, the copy-engine
collectives, the prepared runners) and the copy-engine primitives, and ``overlap/`` called its
private members. The algorithms now live in their modules (``collectives/algos/one_shot.py``,
``two_shot.py``, ``copy_engine.py``, sharing ``_peer.py``), which import this package; this
package imports neither them nor ``overlap/``, so the boundary is the public names listed above.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from .. import _env
from .._agree import agree
from .._watch import ABORTED
from ..errors import CollectiveTimeout, GroupAborted, UnsupportedError
from . import _launch
from ._layout import (FENCE_CLEAR, FLAG_BYTES, LL_OFF, MAX_BLOCKS,
                      MAX_RANKS, N_STAGES, ONE_SHOT_LL_MAX_BYTES, PACK_BYTES, STREAM_WAIT, ll_set_bytes)
from .copy_engines import CopyEngines

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["PeerMemory", "peer_memory", "has_peer_memory", "close_peer_memory", "peer_unavailable", "MAX_RANKS",
           "MAX_BLOCKS", "N_STAGES", "PACK_BYTES", "ONE_SHOT_LL_MAX_BYTES", "FLAG_BYTES", "DTYPES", "CE_CHUNK_BYTES",
           "CE_MAX_CHUNKS", "CE_ALL_REDUCE_CHUNK_BYTES"]

_CTX = np.dtype([("slots", "<u8", (MAX_RANKS,)), ("flags", "<u8", (MAX_RANKS,)), ("calls", "<u8"),
                 ("err", "<u8"), ("err_dev", "<u8"), ("rank", "<i4"), ("world", "<i4"), ("timeout_ns", "<u8"),
                 ("set_bytes", "<u8"), ("ll_off", "<u8"), ("ll_set_bytes", "<u8")])  # struct Ctx (peer.cuh)
_STAGES = {0: "data pushed", 1: "reduced shard pushed", 2: "low-latency words pushed",
           10: "chunk pushed (copy engine)", 11: "chunk reduced (copy engine)", 12: "chunk pulled (copy engine)",
           STREAM_WAIT: "copy-engine section, stream waits"}
_TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
DTYPES = frozenset(_TAGS)


class _Clears(Protocol):
    def clear(self) -> None: ...


_S = TypeVar("_S", bound=_Clears)

# The defaults of the peer algorithms' settings, which are attributes of each PeerMemory
# (collectives/algos reads them; tests and launch/tune_peer.py change them).
# Copy-engine chunks: at least ce_chunk_bytes, and large enough that a call has at most
# ce_max_chunks of them while two ring slots still fit. Each chunk costs the host about ten
# driver calls; on the 2xH200 machine's CPUs that may exceed the ~42 us the links need for a
# 16 MiB chunk (a hypothesis from the eager figures, not yet measured).
CE_CHUNK_BYTES = 16 << 20
CE_MAX_CHUNKS = 16
# The two-rank one-shot all-reduce's chunks (ramped: algos/copy_engine.py's ce_pieces). Measured
# on 2xH200 with 1 GiB buffers (bench/results/gpu_2xh200_peer_ce_ar_chunks.json, eager, GB/s at
# 512 MB / 1 GB): 128 MiB 348 / 357; 64 MiB 344 / 350; 256 MiB 308 / 344; 32 MiB 333 / 329;
# 16 MiB 284 / 284 (each chunk costs host calls).
CE_ALL_REDUCE_CHUNK_BYTES = 128 << 20
# ll_max_bytes (default ONE_SHOT_LL_MAX_BYTES, which sizes their area): one_shot all-reduces,
# reduce-scatters and all-gathers up to this size (16-byte aligned) send low-latency words (4 data
# bytes and the call's number per 8-byte store: kernels.cu, "low-latency words").


def peer_unavailable(comm: Communicator) -> str:
    """Why this group cannot use peer memory, or ``""`` if it can (collective on first call, then cached)."""
    reason = comm._peer_reason
    if reason is None:
        reason = comm._peer_reason = _reason(comm)
    return reason


def _reason(comm: Communicator) -> str:
    if comm.backend_for("cuda") != "nccl":
        return f"the group has no NCCL backend for CUDA tensors (backend {comm.backend!r})"
    if not 2 <= comm.size <= MAX_RANKS:
        return f"peer memory serves 2 to {MAX_RANKS} ranks; this group has {comm.size}"
    nodes = comm.topology.nodes()
    # Every rank computes the same answers from here on, so every rank takes part in the same
    # exchanges below.
    if len(nodes) > 1:
        return f"the ranks span {len(nodes)} nodes; peer memory needs one node"
    devices = _all_gather_ints(comm, [torch.cuda.current_device()])
    mine = torch.cuda.current_device()
    ok = all(d[0] == mine or torch.cuda.can_device_access_peer(mine, d[0]) for d in devices)
    ok_all = min(_all_gather_ints(comm, [int(ok)]))[0]
    if not ok_all:
        return "some GPUs of this node cannot access each other's memory (no P2P over NVLink or PCIe)"
    try:
        import cupy  # noqa: F401  # deferred: whether CuPy is installed, asked only here
    except ImportError:
        return "CuPy is not installed (pip install cupy-cuda13x, or cupy-cuda12x for CUDA 12)"
    return ""


def peer_memory(comm: Communicator) -> PeerMemory:
    """The communicator's :class:`PeerMemory`, created on first use (collective then)."""
    pm = comm._peer_memory
    if pm is None or pm.closed:
        pm = comm._peer_memory = PeerMemory(comm)
    return pm


def has_peer_memory(comm: Communicator) -> bool:
    """Whether the communicator's peer memory is built and open (nothing is exchanged)."""
    pm = comm._peer_memory
    return pm is not None and not pm.closed


def close_peer_memory(comm: Communicator) -> None:
    """Close the communicator's peer memory if it has one (collective)."""
    pm, comm._peer_memory = comm._peer_memory, None
    comm._fast.clear()  # runners hold the PeerMemory
    if pm is not None:
        pm.close()


def _all_gather_bytes(comm: Communicator, payload: bytes) -> list[bytes]:
    """Every rank's ``payload`` (equal lengths), over the CPU side of the group where it has one.
    Raises ``GroupAborted`` on a group that a failure aborted (its connections are closed)."""
    trouble = comm._trouble
    if trouble is not None and trouble[0] == ABORTED:
        raise GroupAborted("peer memory", comm._group_name, str(trouble[1]))
    device = torch.device("cpu") if comm.backend_for("cpu") else torch.device("cuda", torch.cuda.current_device())
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    out = [torch.empty_like(mine) for _ in range(comm.size)]
    dist.all_gather(out, mine, group=comm.group)
    return [bytes(t.cpu().numpy().tobytes()) for t in out]


def _all_gather_ints(comm: Communicator, values: list[int]) -> list[list[int]]:
    raw = _all_gather_bytes(comm, np.asarray(values, dtype=np.int64).tobytes())
    return [np.frombuffer(b, dtype=np.int64).tolist() for b in raw]


def _map_buffers(comm: Communicator, device: int, slot_bytes: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """Allocate this rank's slot buffer and zeroed flag allocation on ``device``, exchange their IPC
    handles (collective) and map every peer's: ``(own, opened, slots, flags)``, ``own`` this rank's
    two allocations, ``opened`` the peers' mappings (both released by ``PeerMemory.close``),
    ``slots`` and ``flags`` every rank's, ``MAX_RANKS`` long."""
    import cupy  # deferred: CuPy loads when peer memory is first built, never at import

    rt = cupy.cuda.runtime
    with cupy.cuda.Device(device):
        flag_bytes = LL_OFF + 2 * ll_set_bytes(comm.size)
        own = [rt.malloc(slot_bytes), rt.malloc(flag_bytes)]
        rt.memset(own[1], 0, flag_bytes)
        rt.deviceSynchronize()
        handles = b"".join(bytes(rt.ipcGetMemHandle(p)) for p in own)
    every = _all_gather_bytes(comm, handles)
    half = len(handles) // 2
    opened: list[int] = []
    slots, flags = [0] * MAX_RANKS, [0] * MAX_RANKS
    with cupy.cuda.Device(device):
        for q, h in enumerate(every):
            if q == comm.rank:
                slots[q], flags[q] = own
                continue
            slots[q] = rt.ipcOpenMemHandle(h[:half], rt.cudaIpcMemLazyEnablePeerAccess)
            flags[q] = rt.ipcOpenMemHandle(h[half:], rt.cudaIpcMemLazyEnablePeerAccess)
            opened += [slots[q], flags[q]]
    return own, opened, slots, flags


class PeerMemory:
    """Slot buffers and flags shared by the GPUs of one node; built once, called many times.

    Construction is collective over ``comm``'s group: each rank allocates ``slot_bytes`` of slots
    and a flag area on its current CUDA device, and maps every peer's through CUDA IPC.
    :meth:`close` is collective too. Launches go to torch's current stream; one communicator's
    calls must not run on two streams at once (like NCCL's), nor from two threads at once. The
    collectives on these buffers are the peer algorithms' (``collectives.algos.peer("one_shot")``
    and so on, whose calls take this object).

    Args:
        comm: a communicator whose ranks share one node and can access each other's memory
            (:func:`peer_unavailable` says why not).
        slot_bytes: bytes of this rank's slot buffer (default: ``COMMOPS_PEER_BYTES`` as the ranks agreed
            on it, ``collectives._agree``; a value given here must be the same on every rank), used in two halves
            on alternate calls; the largest piece a call moves at once is a fraction of a half,
            larger messages run in pieces.
        timeout_s: how long a kernel waits for a peer before it gives up (``COMMOPS_PEER_TIMEOUT_S``
            if set, else the timeout given to ``collectives.init``, else 60 s).
        block_bytes: about how many bytes one thread block moves; sets the grid.
        max_blocks: the most thread blocks a call uses (at most 128).
    """

    def __init__(self, comm: Communicator, slot_bytes: int | None = None, timeout_s: float | None = None,
                 block_bytes: int = 8 << 10, max_blocks: int = MAX_BLOCKS) -> None:
        # First, as a communicator's first collective would: this may be built before any call, and
        # the checks below already exchange (topology discovery, which COMMOPS_TOPOLOGY replaces).
        agreed = agree(comm, "peer_memory")
        reason = peer_unavailable(comm)
        if reason:
            raise UnsupportedError("group", comm, f"cannot use peer memory: {reason}",
                                   "use algorithm='native' (NCCL) or 'auto', which does when peer memory cannot run")
        self.comm = comm
        self.rank, self.world = comm.rank, comm.size
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_index: int = self.device.index  # the CUDA device of this rank's buffers (an int, for launches)
        # the agreed COMMOPS_PEER_BYTES: a rank with a larger value than its peers' would write past their buffers
        size = int(slot_bytes if slot_bytes is not None else agreed.peer_bytes)
        if size < (1 << 20) or size % 4096:
            raise UnsupportedError("slot_bytes", size, "must be a multiple of 4096 and at least 1 MiB",
                                   f"pass a size such as {64 << 20}")
        self.slot_bytes = size
        if timeout_s is None:
            # COMMOPS_PEER_TIMEOUT_S if set, else the group's timeout from init(timeout=...), else its default
            given = _env.PEER_TIMEOUT_S.is_set() or comm.timeout_s is None
            timeout_s = _env.PEER_TIMEOUT_S.get() if given else comm.timeout_s
        self.timeout_s = float(timeout_s)  # type: ignore[arg-type]
        self._states: dict[type, Any] = {}  # state() of code built on this memory
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self.closed = False
        self._own, self._opened, slots, flags = _map_buffers(comm, self.device_index, size)
        self.slot_pointers = tuple(slots[:self.world])  # every rank's slot buffer, mapped here
        self.flag_pointers = tuple(flags[:self.world])  # every rank's flag allocation, mapped here
        self._calls = torch.zeros(5, dtype=torch.int32, device=self.device)
        self.copy_engines = CopyEngines(self)  # with its two side streams (push, pull)
        # the peer algorithms' settings on this memory (collectives/algos; their defaults' notes above)
        self.ce_chunk_bytes, self.ce_max_chunks = CE_CHUNK_BYTES, CE_MAX_CHUNKS
        self.ce_all_reduce_chunk_bytes = CE_ALL_REDUCE_CHUNK_BYTES
        self.ll_max_bytes = ONE_SHOT_LL_MAX_BYTES
        self._err_dev = torch.zeros(4, dtype=torch.int32, device=self.device)
        self._err = torch.zeros(8, dtype=torch.int32).pin_memory()  # mapped: the kernels write it (struct Ctx)
        self._err_np = self._err.numpy()
        ctx = np.zeros((), dtype=_CTX)
        ctx["slots"], ctx["flags"] = slots, flags
        ctx["calls"], ctx["err"], ctx["err_dev"] = (self._calls.data_ptr(), self._err.data_ptr(),
                                                    self._err_dev.data_ptr())
        ctx["rank"], ctx["world"], ctx["timeout_ns"] = self.rank, self.world, int(self.timeout_s * 1e9)
        ctx["set_bytes"] = self.set_bytes = size // 2  # one of the two sets of slots, used on alternate calls
        ctx["ll_off"], ctx["ll_set_bytes"] = LL_OFF, ll_set_bytes(self.world)
        self._ctx = ctx.tobytes()
        self._kernels: dict[tuple[Any, ...], _launch.Kernel] = {}
        self._slot_tensor: torch.Tensor | None = None  # slot_view's tensor over my slot buffer
        self._views: dict[tuple[int, tuple[int, ...], torch.dtype], torch.Tensor] = {}  # slot_view's, kept
        # The collectives' module compiled now, not in a first call: on a machine whose kernel
        # cache is empty that takes seconds, which here the all-gather below waits out on the
        # host, where a first call's peers would wait inside a bounded barrier on the GPU.
        _launch.compile_module(self.device_index, "ce_fence")
        torch.cuda.synchronize(self.device)
        _all_gather_ints(comm, [0])  # every rank mapped every peer before anyone pushes

    # -- the grid of the SM kernels --------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """About how many bytes one thread block moves (sets the grid of the SM kernels)."""
        return self._block_bytes

    @block_bytes.setter
    def block_bytes(self, value: int) -> None:
        self._block_bytes = int(value)
        self._clear_states()

    @property
    def max_blocks(self) -> int:
        """The most thread blocks one call uses."""
        return self._max_blocks

    @max_blocks.setter
    def max_blocks(self, value: int) -> None:
        if not 1 <= value <= MAX_BLOCKS:
            raise UnsupportedError("max_blocks", value, f"must be in 1..{MAX_BLOCKS}", f"pass {MAX_BLOCKS}")
        self._max_blocks = int(value)
        self._clear_states()

    def blocks(self, nbytes: int) -> int:
        """The grid of an SM kernel that moves ``nbytes``: a block per ``block_bytes``, 1 to ``max_blocks``."""
        return max(1, min(self._max_blocks, -(-nbytes // self._block_bytes)))

    # -- the launch API ----------------------------------------------------------------------------
    def kernel(self, kind: str, dtype: torch.dtype | None, vec: bool, nargs: int = 4,
               bases: tuple[int, ...] | None = None, source: Path | None = None) -> _launch.Kernel:
        """The entry point ``kind`` bound to this memory's context (``struct Ctx``, ``peer.cuh``),
        made once and kept: ``k(blocks, stream, *args)`` launches it on ``blocks`` x 512 threads
        (``args``: ``nargs`` integers, pointers or sizes, after the context); ``k.prepare(*args)``
        keeps a parameter block for repeats.

        Args:
            kind: the entry point's name; with ``dtype``, the name of a family whose members are
                ``{kind}_{f32|f16|bf16}_{vec|scalar}``.
            dtype: the element type, or None for an entry point of that exact name.
            vec: the 16-byte vector member (every address 16-byte aligned), else the scalar one.
            nargs: how many 8-byte arguments follow the context.
            bases: a context whose rank q's slot buffer is this rank's own moved by ``bases[q]``
                bytes: a kernel written to read the peers' buffers then reads copies of them that
                the copy engines put in this one.
            source: the ``.cu`` file that defines it, compiled after ``peer.cuh`` into a module of
                its own (default ``kernels.cu``, the collectives): code outside ``collectives/peer``
                ships its kernels so, against the same context.

        Raises ``CollectiveTimeout`` if a kernel of this memory has reported a timeout (``check()``).
        """
        if self._err_np[0]:
            self.check()
        key = (kind, dtype, vec, bases, source)
        k = self._kernels.get(key)
        if k is None:
            name = kind if dtype is None else f"{kind}_{_TAGS[dtype]}_{'vec' if vec else 'scalar'}"
            k = self._kernels[key] = _launch.Kernel(name, self.device_index, self._ctx if bases is None else
                                                    self._local_ctx(bases), nargs, _launch.sources_of(source))
        return k

    def stream(self) -> int:
        """Torch's current stream of this memory's device, as the raw ``cudaStream_t`` launches take."""
        return _launch.current_stream(self.device_index)  # type: ignore[no-any-return]

    def validate(self, t: torch.Tensor) -> None:
        """Raise ``UnsupportedError`` unless the kernels can take ``t``: this memory open, ``t`` on
        its device, in one of ``DTYPES``."""
        if self.closed:
            raise UnsupportedError("peer memory", self, "is closed", "build a new PeerMemory (peer_memory(comm) does)")
        if t.get_device() != self.device_index:
            raise UnsupportedError("tensor", t, f"is not on {self.device}, where this rank's peer memory lives",
                                   f"move it with .to('{self.device}') or call torch.cuda.set_device first")
        if t.dtype not in DTYPES:
            raise UnsupportedError("tensor", t, f"has dtype {t.dtype}; peer memory reduces {sorted(map(str, DTYPES))}",
                                   "use algorithm='native' for other dtypes")

    def state(self, kind: type[_S]) -> _S:
        """The one ``kind()`` kept with this memory, made on first use, for code built on it that
        derives things from the grid or the buffers: its ``clear()`` runs whenever ``block_bytes``
        or ``max_blocks`` changes and when the buffers close. (The peer algorithms keep their plans
        and prepared launches so: ``collectives/algos/_peer.py``.)"""
        got = self._states.get(kind)
        if got is None:
            got = self._states[kind] = kind()
        return got  # type: ignore[no-any-return]

    def _clear_states(self) -> None:
        for kept in self._states.values():
            kept.clear()

    def _local_ctx(self, bases: tuple[int, ...]) -> bytes:
        if len(bases) != self.world:
            raise AssertionError(f"{len(bases)} bases for {self.world} ranks")
        ctx = np.frombuffer(bytearray(self._ctx), dtype=_CTX)[0]
        own = self.slot_pointers[self.rank]
        for q, b in enumerate(bases):
            ctx["slots"][q] = (own + b) % (1 << 64)  # a base may lie below the buffer: only base + offset is read
        return ctx.tobytes()

    # -- errors ----------------------------------------------------------------------------------
    @property
    def error_record(self) -> np.ndarray:
        """The host-mapped error record the kernels write (``struct Ctx``'s ``err``), int32
        ``[failed, stage, block, peer, sections opened, sections closed, -, -]``: ``[0]`` is
        nonzero once a wait gave up (``check()`` raises then). Read without synchronising."""
        return self._err_np

    @property
    def error_address(self) -> int:
        """The host address of ``error_record`` (for compiled callers that read its ``[0]``)."""
        return self._err.data_ptr()

    @property
    def device_error_address(self) -> int:
        """The device address of the error word that later launches check (set: they return at once)."""
        return self._err_dev.data_ptr()

    def check(self) -> None:
        """Raise :class:`CollectiveTimeout` if a kernel of this communicator gave up waiting for a peer."""
        if self._err_np[0]:
            stage, block, peer = (int(x) for x in self._err_np[1:4])
            what = _STAGES.get(stage, f"stage {stage}")
            where = f"in block {block} for the flag '{what}'" if stage != STREAM_WAIT else \
                "in a copy-engine section that made no progress (its stream waits were released; the named " \
                "peer's copy-engine signals were the furthest behind)"
            raise CollectiveTimeout(
                "peer-memory collective", [self.comm.global_ranks[peer]] if 0 <= peer < self.world else [],
                f"rank {self.comm.global_ranks[self.rank]} waited {self.timeout_s:g} s {where}; the "
                "communicator's peer memory is unusable now: close it and build it again")

    # -- slots and barriers ----------------------------------------------------------------------
    def barrier(self, clear: bool = False) -> None:
        """A barrier of every rank on the current stream (bounded), which is no section boundary:
        for callers that wait only with kernels (``copy_engines.wait(..., kernel=True)``), whose
        bound is their own. With ``clear``, this rank's copy-engine flags are zeroed afterwards."""
        self.kernel("ce_fence", None, False, 1)(1, self.stream(), FENCE_CLEAR if clear else 0)

    def slot_view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over this rank's own slot buffer, ``offset`` bytes in (what peers pushed there)."""
        key = (offset, shape, dtype)
        view = self._views.get(key)
        if view is not None:
            return view
        es = torch.empty((), dtype=dtype).element_size()
        n = math.prod(shape)
        if offset % es or offset < 0 or offset + n * es > self.slot_bytes:
            raise UnsupportedError("offset", offset, f"does not place {shape} {dtype} inside the slot buffer",
                                   "plan pieces that fit COMMOPS_PEER_BYTES")
        if self._slot_tensor is None:
            import cupy  # deferred: as in _map_buffers

            mem = cupy.cuda.UnownedMemory(self.slot_pointers[self.rank], self.slot_bytes, self, self.device.index)
            arr = cupy.ndarray((self.slot_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
            self._slot_tensor = torch.from_dlpack(arr)
        if len(self._views) > 4096:  # a view per (offset, shape, dtype) asked for: a few per operator shape
            self._views.clear()
        view = self._views[key] = self._slot_tensor[offset:offset + n * es].view(dtype).view(shape)
        return view

    def close(self) -> None:
        """Release the buffers (collective: waits until no rank can still touch them).

        On a group that a failure aborted nobody can be waited for: this rank unmaps the peers'
        buffers and leaves its own allocated (a peer may still write into them; they go with the
        process), and the close completes without raising; likewise, with a warning, where a peer
        does not answer."""
        if self.closed:
            return
        import cupy  # deferred: as in _map_buffers

        rt = cupy.cuda.runtime
        torch.cuda.synchronize(self.device)
        self.copy_engines.stop()  # its watchdog: before the flags it may write are freed
        met = self._all_met()  # nobody pushes into my slots any more
        with cupy.cuda.Device(self.device.index):
            for p in self._opened:
                rt.ipcCloseMemHandle(p)
        if met and self._all_met():  # nobody maps my memory any more
            with cupy.cuda.Device(self.device.index):
                for p in self._own:
                    rt.free(p)
        self._opened, self._own = [], []
        self._slot_tensor = None
        self._views.clear()
        self._clear_states()  # the next call re-plans, and validate() refuses a closed PeerMemory
        self.closed = True

    def _all_met(self) -> bool:
        """Whether every rank reached this point (an all-gather of the group's CPU side): False on
        a group that a failure aborted, or (with a warning naming it) where the all-gather failed."""
        try:
            _all_gather_ints(self.comm, [0])
        except GroupAborted:
            return False
        except RuntimeError as exc:  # torch.distributed's errors: a peer gone, a timeout
            warnings.warn(f"peer memory of group {self.comm._group_name}: not every rank reached its close "
                          f"({exc}); this rank released what it could alone", RuntimeWarning, stacklevel=3)
            return False
        return True

    def __repr__(self) -> str:
        return (f"PeerMemory(rank={self.rank}/{self.world}, {self.device}, slots={self.slot_bytes} B, "
                f"{'closed' if self.closed else 'open'})")
