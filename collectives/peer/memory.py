"""``PeerMemory``: one communicator's slot buffers and flags, and the calls that use them.

This module is the boundary between tensors and the kernels in ``kernels.cu``: it validates,
splits messages into pieces that fit the slots, picks the vectorised or the scalar entry point
(16-byte packs need 16-byte aligned addresses) and launches on torch's current stream through
``_launch``. CuPy is imported only when peer memory is first used.

Each rank allocates two IPC buffers that every peer maps: the slots (``slot_bytes``, two sets,
where peers push data) and the flag allocation (block flags, copy-engine flags, then the
low-latency words' own area; ``_layout.py``). Code outside this module runs on them through a
small launch API: ``kernel()`` (an entry point bound to this memory's context, from
``kernels.cu`` or from a source of the caller's own, compiled after ``peer.cuh``), ``stream()``
(torch's current raw stream of the device), ``device_index``, ``blocks()`` (the grid of the SM
kernels), ``validate()`` and ``copy_engines`` (``copy_engines.py``: copies and flags by copy
engines).
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from .. import _env, _native
from .._agree import agree
from ..errors import CollectiveTimeout, UnsupportedError
from . import _launch
from ._layout import (CE_PULLED, CE_PUSHED, CE_REDUCED, CE_RING, CE_STAGES, FENCE_CLEAR, FLAG_BYTES, LL_OFF, MAX_BLOCKS,
                      MAX_RANKS, N_STAGES, ONE_SHOT_LL_MAX_BYTES, PACK_BYTES, STREAM_WAIT, ll_set_bytes)
from .copy_engines import CopyEngines

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["PeerMemory", "peer_memory", "has_peer_memory", "close_peer_memory", "peer_unavailable", "two_shot_piece",
           "ce_pieces", "MAX_RANKS",
           "MAX_BLOCKS", "N_STAGES", "PACK_BYTES", "ONE_SHOT_LL_MAX_BYTES", "FLAG_BYTES", "DTYPES", "CE_CHUNK_BYTES",
           "CE_MAX_CHUNKS", "CE_ALL_REDUCE_CHUNK_BYTES",
           # transitional: overlap/_moe_peer.py still imports these from here (collectives.peer.copy_engines has them)
           "CE_RING", "CE_STAGES", "CE_PUSHED", "CE_REDUCED", "CE_PULLED"]

_CTX = np.dtype([("slots", "<u8", (MAX_RANKS,)), ("flags", "<u8", (MAX_RANKS,)), ("calls", "<u8"),
                 ("err", "<u8"), ("err_dev", "<u8"), ("rank", "<i4"), ("world", "<i4"), ("timeout_ns", "<u8"),
                 ("set_bytes", "<u8"), ("ll_off", "<u8"), ("ll_set_bytes", "<u8")])  # struct Ctx (peer.cuh)
_STAGES = {0: "data pushed", 1: "reduced shard pushed", 2: "low-latency words pushed",
           10: "chunk pushed (copy engine)", 11: "chunk reduced (copy engine)", 12: "chunk pulled (copy engine)",
           STREAM_WAIT: "copy-engine section, stream waits"}
_TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
DTYPES = frozenset(_TAGS)
# transitional: the MoE row kernels' source, for overlap/_moe_peer.py's launches that do not pass it
_ROWS_SOURCE = Path(__file__).resolve().parents[2] / "overlap" / "_moe_rows.cu"

_COPY_ENGINE = object()  # plan marker: the copy-engine path works out its chunks per call


class _Ready(dict):  # type: ignore[type-arg]
    """One runner's prepared launches: tensor address(es) -> (function, blocks, Prepared, name),
    followed, for the compiled runner, by (graph handle, OneKernelGraph) where one could be made.
    Compared and hashed by identity (so that a WeakSet can hold it)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__  # type: ignore[assignment]
    graphs = False  # make a one-kernel graph of each launch (the compiled runner launches those)


_GRAPHS_FAILED: list[str] = []  # why a one-kernel graph could not be made (then none is tried again)


def _by_copy_engine(algorithm: str) -> bool:
    """Whether a reduce-scatter or all-gather named ``algorithm`` runs on the copy engines."""
    if algorithm not in ("one_shot", "copy_engine"):
        raise UnsupportedError("algorithm", algorithm, "is not a peer-memory reduce-scatter or all-gather",
                               "use 'one_shot' or 'copy_engine'")
    return algorithm == "copy_engine"


def two_shot_piece(set_bytes: int, world: int, element_size: int) -> int:
    """Elements of the largest two-shot all-reduce piece one set of ``set_bytes`` holds (a reduce
    slot and a gather slot per rank, shards in whole 16-byte packs)."""
    pack = PACK_BYTES // element_size
    return set_bytes // element_size // (2 * world) // pack * pack * world

# the ramped pieces' sizes, as divisors of a chunk (ce_pieces). Only the last piece's sum follows
# the link's last byte, so the tail shrinks; every piece boundary costs the copy engines a few
# microseconds, so the head has one half chunk. Measured on 2xH200 (2026-12-01), 1 GiB / 512 MiB
# all-reduce, busbw over NCCL's in the same rounds (11 rounds, graph / eager): head 1/8, 1/4, 1/2
# and the mirrored tail 1.0975 / 1.0985 at 1 GiB, 1.107 / 1.104 at 512 MiB; head 1/2, tail 1/2,
# 1/4, 1/8 1.1076 / 1.1047 and 1.123 / 1.115; no head 1.105 / 1.103 and 1.118 / 1.107; 256 MiB
# chunks (two ring slots) 1.02-1.03 and 0.95-0.96.
RAMP_HEAD = (2,)
RAMP_TAIL = (2, 4, 8)


def ce_pieces(m: int, chunk: int, pack: int, ramp: bool = False) -> list[tuple[int, int]]:
    """(first element, elements) of each copy-engine chunk of ``m`` elements, at most ``chunk``
    (a multiple of ``pack``) each. With ``ramp``, where at least one full chunk lies between,
    the first pieces are ``chunk / RAMP_HEAD`` and the last shrink to ``chunk / RAMP_TAIL[-1]``:
    the last sum then waits only for a small last copy."""
    def sizes(divisors: tuple[int, ...]) -> list[int]:
        return [max(pack, chunk // d // pack * pack) for d in divisors]

    head, tail = sizes(RAMP_HEAD), sizes(RAMP_TAIL)
    if not ramp or m < sum(head) + sum(tail) + chunk:
        head = tail = []
    out, lo, end = [], 0, m - sum(tail)
    for n in head:
        out.append((lo, n))
        lo += n
    while lo < end:
        n = min(chunk, end - lo)
        out.append((lo, n))
        lo += n
    for n in tail:
        out.append((lo, n))
        lo += n
    return out


# The defaults of the calls' settings, which are attributes of each PeerMemory (tests and
# launch/tune_peer.py change them).
# Copy-engine chunks: at least ce_chunk_bytes, and large enough that a call has at most
# ce_max_chunks of them while two ring slots still fit. Each chunk costs the host about ten
# driver calls; on the 2xH200 machine's CPUs that may exceed the ~42 us the links need for a
# 16 MiB chunk (a hypothesis from the eager figures, not yet measured).
CE_CHUNK_BYTES = 16 << 20
CE_MAX_CHUNKS = 16
# The two-rank one-shot all-reduce's chunks (ramped: ce_pieces). Measured
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
    """Every rank's ``payload`` (equal lengths), over the CPU side of the group where it has one."""
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
    :meth:`close` is collective too. Calls run on torch's current stream; one communicator's calls
    must not run on two streams at once (like NCCL's).

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
        self._plans: dict[tuple[str, torch.dtype, int], Any] = {}
        self._ready: weakref.WeakSet[_Ready] = weakref.WeakSet()  # the live runners' prepared launches (runner())
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        self.closed = False
        self._own, self._opened, slots, flags = _map_buffers(comm, self.device_index, size)
        self.slot_pointers = tuple(slots[:self.world])  # every rank's slot buffer, mapped here
        self.flag_pointers = tuple(flags[:self.world])  # every rank's flag allocation, mapped here
        self._calls = torch.zeros(5, dtype=torch.int32, device=self.device)
        self.copy_engines = CopyEngines(self)  # with its two side streams (push, pull)
        # the calls' settings on this memory (their defaults' notes above)
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
        torch.cuda.synchronize(self.device)
        _all_gather_ints(comm, [0])  # every rank mapped every peer before anyone pushes

    # -- calls ---------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, algorithm: str = "two_shot", average: bool = False) -> None:
        """In-place sum (or average) of ``tensor`` over the group.

        ``algorithm``: 'one_shot', 'two_shot' or 'copy_engine'. The pieces and kernels of each
        (algorithm, dtype, size) are worked out once and kept: this is on the path of every small
        all-reduce, whose budget is a few microseconds of host time.
        """
        plan = self._plans.get((algorithm, tensor.dtype, tensor.numel()))
        if plan is None:
            plan = self._plan(algorithm, tensor)
        if self._err_np[0]:
            self.check()
        if tensor.get_device() != self.device_index:
            self.validate(tensor)
        base = tensor.data_ptr()
        if plan is _COPY_ENGINE:
            self._ce_all_reduce(tensor, base % PACK_BYTES == 0)
        else:
            aligned = base % PACK_BYTES == 0
            k = plan[0] if aligned else plan[1]
            stream = self.stream()
            for blocks, off, a, b in (plan[2] if aligned else plan[3]):
                k(blocks, stream, base + off, base + off, a, b)
        if average:
            tensor.detach().div_(self.world)  # as the verbs do: in place, unseen by autograd

    def _plan(self, algorithm: str, tensor: torch.Tensor) -> Any:
        self.validate(tensor)
        n, es, dtype = tensor.numel(), tensor.element_size(), tensor.dtype
        pack = PACK_BYTES // es
        cap = self.set_bytes // es
        pieces = []
        if algorithm == "one_shot":
            slot = cap // self.world // pack * pack
            for off in range(0, n, slot):
                m = min(slot, n - off)
                pieces.append((self.blocks(m * es), off * es, m, slot))
        elif algorithm == "two_shot":
            piece = two_shot_piece(self.set_bytes, self.world, es)
            for off in range(0, n, piece):
                m = min(piece, n - off)
                shard = math.ceil(math.ceil(m / self.world) / pack) * pack
                pieces.append((self.blocks(m * es), off * es, m, shard))
        elif algorithm == "copy_engine":
            self._plans[(algorithm, dtype, n)] = _COPY_ENGINE
            return _COPY_ENGINE
        else:
            raise UnsupportedError("algorithm", algorithm, "is not a peer-memory all-reduce",
                                   "use 'one_shot', 'two_shot' or 'copy_engine'")
        plan = (self.kernel(algorithm, dtype, True), self.kernel(algorithm, dtype, False), tuple(pieces),
                tuple(pieces))
        if algorithm == "one_shot" and n * es <= self._ll_limit():
            # aligned calls: low-latency words, the whole message at once (each rank's region
            # holds the words of ONE_SHOT_LL_MAX_BYTES)
            ll = self.kernel("one_shot_ll", dtype, True, 4)
            plan = (ll, plan[1], ((self.blocks(n * es), 0, n, ONE_SHOT_LL_MAX_BYTES // 4),), plan[3])
        self._plans[(algorithm, dtype, n)] = plan
        return plan

    def _ll_limit(self) -> int:
        """The largest message sent in low-latency words: ``ll_max_bytes``, within their area."""
        return min(self.ll_max_bytes, ONE_SHOT_LL_MAX_BYTES)

    def _ce_all_reduce(self, t: torch.Tensor, vec: bool) -> None:
        """Copy engines move the shards, SMs only reduce; chunks cycle through a ring of slots.

        See kernels.cu ("copy-engine path") for the protocol. ``vec`` also needs whole packs per
        chunk and shard, which the chunk size below keeps.

        With two ranks, one shot instead (``_ce_by_shard``): each rank's whole tensor crosses the
        link once, as in the two-shot schedule, but nothing waits for the peer's reduction, so
        the only fill and drain is one chunk's copy and one chunk's sum.
        """
        if self.world == 2:
            self._ce_by_shard("all_reduce", t, t, t.numel())
            return
        w, r, es = self.world, self.rank, t.element_size()
        pack = PACK_BYTES // es
        n = t.numel()
        want = max(self.ce_chunk_bytes, -(-n * es // self.ce_max_chunks))
        fits = self.slot_bytes * w // (2 * (w + 1))  # the largest chunk with two ring slots
        chunk_bytes = max(self.ce_chunk_bytes, min(want, fits))
        chunk = max(w * pack, chunk_bytes // es // (w * pack) * (w * pack))
        s_max = chunk // w
        ring = min(CE_RING, self.slot_bytes // es // ((w + 1) * s_max))
        if ring < 2:
            raise UnsupportedError("ce_chunk_bytes", self.ce_chunk_bytes,
                                   f"leaves fewer than 2 ring slots in {self.slot_bytes} B of slots",
                                   "use a smaller chunk or a larger COMMOPS_PEER_BYTES")
        ce = self.copy_engines
        main = self.stream()
        push_s, pull_s = ce.streams
        ps, ls = push_s.cuda_stream, pull_s.cuda_stream
        base = t.data_ptr()
        reduce = self.kernel("ce_reduce", t.dtype, vec, 8)
        peers = [(r + d) % w for d in range(1, w)]
        k = -(-n // chunk)

        def geometry(j: int) -> tuple[int, int, int]:
            nj = min(chunk, n - j * chunk)
            shard = -(-(-(-nj // w)) // pack) * pack
            return nj, shard, (j % ring) * (w + 1) * s_max

        def length(nj: int, shard: int, q: int) -> int:
            return max(0, min(shard, nj - q * shard))

        # Pull stream: wait until the peers reduced chunk i, pull their shards, tell them. Push
        # stream: push chunk j once the peers reduced chunk j - ring (their slot is free again),
        # which the pull stream's wait for chunk j - ring has established (an event, no kernel).
        # The copy streams' waits are stream memory waits (inside the section: CopyEngines.wait).
        reduced = [torch.cuda.Event() for _ in range(ring)]
        blocks = self.blocks(s_max * es)
        with ce.section():
            for j in range(k):
                nj, shard, off = geometry(j)
                if j >= ring:
                    push_s.wait_event(reduced[j % ring])
                for q in peers:
                    m = length(nj, shard, q)
                    if m:
                        ce.push(ps, q, (off + r * s_max) * es, base + (j * chunk + q * shard) * es, m * es)
                for q in peers:
                    ce.signal(ps, q, j % ring, CE_PUSHED, j // ring + 1)
                reduce(blocks, main, base + j * chunk * es, base + j * chunk * es, off, shard, nj, j, ring, s_max)
                u = j // ring
                ce.wait(ls, j % ring, CE_REDUCED, u + 1)
                reduced[j % ring].record(pull_s)
                for q in peers:
                    m = length(nj, shard, q)
                    if m:
                        ce.pull(ls, q, (off + w * s_max) * es, base + (j * chunk + q * shard) * es, m * es)
                for q in peers:
                    ce.signal(ls, q, j % ring, CE_PULLED, u + 1)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, average: bool = False,
                       algorithm: str = "one_shot") -> None:
        """``output`` ([m]) = this rank's shard of the sum of every rank's ``input`` ([world * m]).
        ``algorithm``: 'one_shot' (SM pushes) or 'copy_engine' (``_ce_by_shard``)."""
        if _by_copy_engine(algorithm):
            self._ce_by_shard("reduce_scatter", output, input, output.numel())
        else:
            self._by_shard("reduce_scatter", output, input, output.numel())
        if average:
            output.detach().div_(self.world)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, algorithm: str = "one_shot") -> None:
        """``output`` ([world * m]) = every rank's ``input`` ([m]) in rank order.
        ``algorithm``: 'one_shot' (SM pushes) or 'copy_engine' (``_ce_by_shard``)."""
        if _by_copy_engine(algorithm):
            self._ce_by_shard("all_gather", output, input, input.numel())
        else:
            self._by_shard("all_gather", output, input, input.numel())

    def _ce_by_shard(self, kind: str, output: torch.Tensor, input: torch.Tensor, m: int) -> None:
        """Reduce-scatter, all-gather or one-shot all-reduce (``input`` is ``output``, ``m`` all of
        it: every peer is sent all of it and sums what it gets) with every byte between GPUs moved
        by the copy engines.

        Shards of ``m`` elements are cut into chunks that cycle through a ring of slots; each
        slot holds one chunk per source rank. Push stream: chunk j's part for each peer into that
        peer's slot j % R (once the peers are done with that slot's previous use), then flag
        PUSHED. Reduce-scatter: a kernel on the caller's stream waits for PUSHED, sums my part of
        chunk j from ``input`` and the slot into ``output`` and flags REDUCED (the slot is free).
        All-gather: the pull stream waits for PUSHED, copies the peers' parts of chunk j out of
        my slot into ``output`` and flags PULLED. Flags hold the slot's use count within the
        call (see kernels.cu, "copy-engine path"); the call is bracketed by two barriers.
        """
        self.validate(output)
        self.validate(input)
        w, r, es = self.world, self.rank, output.element_size()
        pack = PACK_BYTES // es
        fits = self.slot_bytes // es // (2 * w)  # a chunk per source in each of two ring slots
        in_place = kind == "all_reduce"
        least = self.ce_all_reduce_chunk_bytes if in_place else self.ce_chunk_bytes
        want = max(least // es, -(-m // self.ce_max_chunks))
        chunk = max(pack, min(want, fits) // pack * pack)
        ring = min(CE_RING, self.slot_bytes // es // (w * chunk))
        if ring < 2:
            raise UnsupportedError("COMMOPS_PEER_BYTES", self.slot_bytes, "leaves fewer than 2 ring slots for "
                                   "the copy-engine path", "use a larger COMMOPS_PEER_BYTES")
        ce = self.copy_engines
        main = self.stream()
        ps, ls = (side.cuda_stream for side in ce.streams)
        src, dst = input.data_ptr(), output.data_ptr()
        vec = src % PACK_BYTES == 0 and dst % PACK_BYTES == 0 and m % pack == 0
        summed = kind != "all_gather"
        reduce = self.kernel("ce_reduce_rs", output.dtype, vec, 7) if summed else None
        blocks = self.blocks(chunk * es)
        peers = [(r + d) % w for d in range(1, w)]
        free = CE_REDUCED if summed else CE_PULLED
        caller, push_stream = torch.cuda.current_stream(self.device), ce.streams[0]
        # (Pushes taking turns on both copy streams, so that a chunk's wait for its slot cannot
        # hold the next chunk's copy back, were tried on 2xH200 on 2026-11-30 and measured 1-2%
        # slower at 256 MB - 1 GB, in all-reduce and reduce-scatter alike.)
        with ce.section():  # the copy streams' waits: stream memory waits (CopyEngines.wait)
            if kind == "all_gather" and m:
                ce.copy(ls, dst + r * m * es, src, m * es)  # my own shard, beside the pushes
            for j, (lo, nj) in enumerate(ce_pieces(m, chunk, pack, ramp=in_place)):
                s, u = j % ring, j // ring
                off = s * w * chunk  # elements into the slot buffer: source q's part at off + q * chunk
                if u:
                    ce.wait(ps, s, free, u)  # every peer is done with this slot's previous use
                for q in peers:
                    at = q * m + lo if kind == "reduce_scatter" else lo
                    ce.push(ps, q, (off + r * chunk) * es, src + at * es, nj * es)
                for q in peers:
                    ce.signal(ps, q, s, CE_PUSHED, u + 1)
                if reduce is not None:
                    if in_place:  # the sum overwrites what the copies read: after them
                        sent = torch.cuda.Event()
                        sent.record(push_stream)
                        caller.wait_event(sent)
                    at = r * m + lo if kind == "reduce_scatter" else lo
                    reduce(blocks, main, src + at * es, dst + lo * es, off, chunk, nj, j, ring)
                else:
                    ce.wait(ls, s, CE_PUSHED, u + 1)
                    for q in peers:
                        ce.take(ls, (off + q * chunk) * es, dst + (q * m + lo) * es, nj * es)
                    for q in peers:
                        ce.signal(ls, q, s, CE_PULLED, u + 1)

    def _by_shard(self, kind: str, output: torch.Tensor, input: torch.Tensor, m: int) -> None:
        """Launch ``kind`` over shards of ``m`` elements, in pieces that fit one set of slots."""
        self.validate(output)
        self.validate(input)
        stream = self.stream()
        for k, blocks, args in self._shard_launches(kind, output, input, m):
            k(blocks, stream, *args)

    def _shard_launches(self, kind: str, output: torch.Tensor, input: torch.Tensor, m: int
                        ) -> Iterator[tuple[_launch.Kernel, int, tuple[int, ...]]]:
        """``_by_shard``'s launches: (kernel, blocks, arguments after the context)."""
        es = output.element_size()
        pack = PACK_BYTES // es
        piece = self.set_bytes // es // self.world // pack * pack
        src, dst = input.data_ptr(), output.data_ptr()
        aligned = dst % PACK_BYTES == 0 and src % PACK_BYTES == 0
        vec = aligned and m % pack == 0
        # low-latency words: shards of whole 4-byte words, the whole message in their area
        if aligned and m * es % 4 == 0 and m * es * self.world <= self._ll_limit():
            yield self.kernel(kind + "_ll", output.dtype, True), self.blocks(m * es), (src, dst, m, m)
            return
        k = self.kernel(kind, output.dtype, vec)
        for off in range(0, m, piece):
            n = min(piece, m - off)
            yield k, self.blocks(n * es * self.world), (src + off * es, dst + off * es, n, m)

    # -- repeated calls --------------------------------------------------------------------------
    def runner(self, op: str, algorithm: str, average: bool = False, prepared: bool = True
               ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """``run(output, input)``: ``op`` by ``algorithm`` ('all_reduce', in place on ``output``, which
        is ``input``; 'reduce_scatter'; 'all_gather'), for repeats of one call signature: the same
        dtype and element counts on every call (the dispatcher's fast path keys its runners so).

        With ``prepared``, a call that is one kernel launch keeps that launch's parameter block per
        tensor address (``_launch.Kernel.prepare``): a repeat on the same tensors is then a single
        driver call, with nothing planned or written. A new address, a call of several pieces, the
        copy engines and averages take the general method; so does every call once a kernel has
        reported a timeout (which then raises), and the blocks are dropped when the grid changes
        or the buffers close.
        """
        if op == "all_reduce":
            def general(out: torch.Tensor, inp: torch.Tensor) -> None:
                self.all_reduce(out, algorithm, average)
        elif op == "reduce_scatter":
            def general(out: torch.Tensor, inp: torch.Tensor) -> None:
                self.reduce_scatter(out, inp, average, algorithm)
        elif op == "all_gather":
            def general(out: torch.Tensor, inp: torch.Tensor) -> None:
                self.all_gather(out, inp, algorithm)
        else:
            raise AssertionError(op)
        if not prepared or average or algorithm == "copy_engine":
            return general
        ready = _Ready()  # held by run() alone: a runner the dispatcher lets go takes its blocks with it
        self._ready.add(ready)
        err, index, launch = self._err_np, self.device_index, _launch.launch
        in_place = op == "all_reduce"  # one tensor: its address is the key

        def run(out: torch.Tensor, inp: torch.Tensor) -> None:
            key = out.data_ptr() if in_place else (out.data_ptr(), inp.data_ptr())
            hit = ready.get(key)
            if hit is None or err[0]:
                general(out, inp)
                self._remember(ready, key, op, algorithm, out, inp)
                return
            launch(hit[0], hit[1], _launch.current_stream(index), hit[2].params, hit[3], index)
        run.ready = ready  # type: ignore[attr-defined]  # (launch/tune_peer.py times the bare launch)
        native = _native.configure_cuda()
        if native is not None:  # the same runner, compiled (collectives/_native.py): ``run`` serves its misses
            ready.graphs = _env.GRAPH_LAUNCH.get()
            return native.Runner(ready, self._err.data_ptr(), index, run, in_place)  # type: ignore[no-any-return]
        return run

    READY_MAX = 64  # prepared launches per runner; a full cache starts again

    def _remember(self, ready: _Ready, key: Any, op: str, algorithm: str, out: torch.Tensor,
                  inp: torch.Tensor) -> None:
        """Keep the launch of a call that was one launch (just made by the general method)."""
        if op == "all_reduce":
            plan = self._plans.get((algorithm, out.dtype, out.numel()))
            if plan is None or plan is _COPY_ENGINE:
                return
            base = out.data_ptr()
            aligned = base % PACK_BYTES == 0
            pieces = plan[2] if aligned else plan[3]
            if len(pieces) != 1:
                return
            blocks, off, a, b = pieces[0]
            k = plan[0] if aligned else plan[1]
            args: tuple[int, ...] = (base + off, base + off, a, b)
        else:
            launches = list(self._shard_launches(op, out, inp, out.numel() if op == "reduce_scatter" else inp.numel()))
            if len(launches) != 1:
                return
            k, blocks, args = launches[0]
        if len(ready) >= self.READY_MAX:
            ready.clear()
        prepared = k.prepare(*args)
        entry: tuple[Any, ...] = (k.fn, blocks, prepared, k.name)
        if ready.graphs and not _GRAPHS_FAILED and not torch.cuda.is_current_stream_capturing():
            try:
                graph = _launch.OneKernelGraph(k.fn, blocks, prepared.params)
                entry += (graph.handle, graph)
            except (OSError, AttributeError, RuntimeError) as exc:  # an older driver: kernel launches, as before
                _GRAPHS_FAILED.append(repr(exc))
                warnings.warn(f"commops: repeated GPU calls are launched as kernels, not one-kernel CUDA graphs "
                              f"(each then costs the host more): {exc!r}. COMMOPS_GRAPH_LAUNCH=0 asks for kernel "
                              "launches and silences this.", RuntimeWarning, stacklevel=2)
        ready[key] = entry

    # -- the grid of the SM kernels --------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        """About how many bytes one thread block moves (sets the grid of the SM kernels)."""
        return self._block_bytes

    @block_bytes.setter
    def block_bytes(self, value: int) -> None:
        self._block_bytes = int(value)
        self._forget_plans()

    @property
    def max_blocks(self) -> int:
        """The most thread blocks one call uses."""
        return self._max_blocks

    @max_blocks.setter
    def max_blocks(self, value: int) -> None:
        if not 1 <= value <= MAX_BLOCKS:
            raise UnsupportedError("max_blocks", value, f"must be in 1..{MAX_BLOCKS}", f"pass {MAX_BLOCKS}")
        self._max_blocks = int(value)
        self._forget_plans()

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

    def _forget_plans(self) -> None:
        self._plans.clear()
        for ready in self._ready:
            ready.clear()

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
        """Release the buffers (collective: waits until no rank can still touch them)."""
        if self.closed:
            return
        import cupy  # deferred: as in _map_buffers

        rt = cupy.cuda.runtime
        torch.cuda.synchronize(self.device)
        self.copy_engines.stop()  # its watchdog: before the flags it may write are freed
        _all_gather_ints(self.comm, [0])  # nobody pushes into my slots any more
        with cupy.cuda.Device(self.device.index):
            for p in self._opened:
                rt.ipcCloseMemHandle(p)
        _all_gather_ints(self.comm, [0])  # nobody maps my memory any more
        with cupy.cuda.Device(self.device.index):
            for p in self._own:
                rt.free(p)
        self._opened, self._own = [], []
        self._slot_tensor = None
        self._views.clear()
        self._forget_plans()  # the next call re-plans, and validate() refuses a closed PeerMemory
        self.closed = True

    # -- transitional: overlap/_moe_peer.py still calls these (the names above replace them) -----
    def _kernel(self, kind: str, dtype: torch.dtype | None, vec: bool, nargs: int = 4,
                bases: tuple[int, ...] | None = None) -> _launch.Kernel:
        # transitional: overlap/_moe_peer.py still calls this (kernel); a rows_* kind compiles _moe_rows.cu
        return self.kernel(kind, dtype, vec, nargs, bases, _ROWS_SOURCE if kind.startswith("rows_") else None)

    @property
    def _index(self) -> int:  # transitional: overlap/_moe_peer.py still calls this (device_index)
        return self.device_index

    @property
    def copy_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        # transitional: overlap/_moe_peer.py still calls this (copy_engines.streams)
        return self.copy_engines.streams

    def ce_push(self, stream: int, peer: int, offset: int, src: int, nbytes: int) -> None:
        # transitional: overlap/_moe_peer.py still calls this (copy_engines.push)
        self.copy_engines.push(stream, peer, offset, src, nbytes)

    def ce_signal(self, stream: int, peer: int, slot: int, stage: int, value: int) -> None:
        # transitional: overlap/_moe_peer.py still calls this (copy_engines.signal)
        self.copy_engines.signal(stream, peer, slot, stage, value)

    def ce_wait(self, stream: int, slot: int, stage: int, value: int, *, kernel: bool | None = None,
                source: int | None = None) -> None:
        # transitional: overlap/_moe_peer.py still calls this (copy_engines.wait)
        self.copy_engines.wait(stream, slot, stage, value, kernel=kernel, source=source)

    def __repr__(self) -> str:
        return (f"PeerMemory(rank={self.rank}/{self.world}, {self.device}, slots={self.slot_bytes} B, "
                f"{'closed' if self.closed else 'open'})")
