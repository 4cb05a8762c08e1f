"""``Communicator``: a process group plus what commops keeps per group.

It caches what every call needs (rank, size, global ranks, which backend serves which device
type), counts calls (``seq``, for tracing) and message tags, holds reusable CPU scratch, and runs
asynchronous point-to-point algorithms on CPU backends in one worker thread. Its methods are the
module-level verbs with ``group`` bound. ``close()`` stops the worker thread; it communicates
nothing, and the process group stays the caller's to destroy.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist

from topology import discover, groups
from topology.cost import Machine

from . import _env, _lists, _native, _traced
from ._launcher import launcher_environment
from ._types import BACKEND_DEVICES, ReduceOp
from .algos import for_op
from .dispatch import Call, dispatch, dispatch_tensors
from ._wait import call_timeout, group_timeout_s
from .errors import InvalidTypeError, NotInitializedError
from .peer import close_peer_memory
from .recorder import RECORDER
from .selection import Choice
from .work import Work

if TYPE_CHECKING:
    from ._agree import Settings

__all__ = ["Communicator", "get_communicator", "destroy"]

_COMMS: WeakKeyDictionary[Any, Communicator] = WeakKeyDictionary()
_WORLD: list[Communicator] = []  # the world communicator of the current default group


def _backend_map(backend: str) -> dict[str, str]:
    """'gloo' -> {'cpu': 'gloo'}; 'cpu:gloo,cuda:nccl' -> {'cpu': 'gloo', 'cuda': 'nccl'}."""
    backend = str(backend).lower()
    if ":" in backend:
        pairs = (item.split(":") for item in backend.split(","))
        return {dev.strip(): name.strip() for dev, name in pairs}
    dev = BACKEND_DEVICES.get(backend)
    return {dev: backend} if dev else {}


class Communicator:
    """A process group with commops' verbs as methods.

    Args:
        group: a ``torch.distributed`` process group; ``None`` is the default (world) group.
            torch.distributed must be initialised (by :func:`collectives.init` or by the caller).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise NotInitializedError(
                "torch.distributed is not initialised: call collectives.init() (under torchrun or mpiexec) "
                "or torch.distributed.init_process_group() before any collective"
            )
        world = dist.group.WORLD
        assert world is not None
        self.group: dist.ProcessGroup = world if group is None else group
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        if self.group is dist.group.WORLD:
            self.global_ranks = tuple(range(self.size))
        else:
            self.global_ranks = tuple(dist.get_global_rank(self.group, i) for i in range(self.size))
        self._group_rank = {g: i for i, g in enumerate(self.global_ranks)}
        self.backend = str(dist.get_backend(self.group))
        self._group_name = str(getattr(self.group, "group_name", "") or id(self.group))
        self._backends = _backend_map(self.backend)
        self.device_types = tuple(self._backends) or ("cpu",)
        self.seq = 0
        self.timeout_s: float | None = None  # init(timeout=...) for the world group
        self._tag = 0
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pending = 0  # calls submitted to the worker and not yet finished (_submit)
        self._scratch: dict[tuple[Any, ...], torch.Tensor] = {}
        self.last_choice: Choice | None = None
        self._topology: Any = None
        self._derived: Any = None
        self._p2p: Any = None  # p2p_group() on CPU backends
        self._choices: dict[Any, Any] = {}  # auto's cached choices and calibration (selection.py)
        self._peer_reason: str | None = None  # why peer memory cannot run here ("" if it can; collectives/peer)
        self._peer_memory: Any = None  # collectives.peer.PeerMemory, built on first use
        self._fast: dict[Any, Any] = {}  # signature -> (runner, reduce op) of calls already resolved (dispatch_tensors)
        self.debug: bool = _env.DEBUG.get()  # debug check mode (collectives/debug.py)
        self._settings: Settings | None = None  # what the ranks agreed on at the first call (collectives/_agree.py)
        # collectives/_watch.py: the store keys' epoch (set by the settings check where there is
        # a store and more than one rank), ("suspect", seq) or ("aborted", why) after a failure,
        # the failure notices read so far, and the calls every rank failed (nothing happened)
        self._epoch: str | None = None
        self._trouble: tuple[str, Any] | None = None
        self._notices: list[dict[str, Any]] = []
        self._notices_read = 0
        self._settled: set[int] = set()
        self._kept: BaseException | None = None  # what to raise in a call the patrol broke

    # -- facts -------------------------------------------------------------------------------
    def backend_for(self, device_type: str) -> str | None:
        """The backend that moves tensors of ``device_type`` in this group, or None."""
        return self._backends.get(device_type)

    def group_rank(self, global_rank: int) -> int | None:
        return self._group_rank.get(global_rank)

    def algorithms(self, op: str, dtype: torch.dtype | None = None, device_type: str | None = None) -> list[str]:
        """Algorithm names usable for ``op`` on this group (and ``dtype`` / ``device_type``)."""
        backend = self.backend_for(device_type or self.device_types[0])
        return for_op(op, dtype, backend)

    @property
    def topology(self) -> Any:
        """This group's :class:`topology.Topology`, discovered on first use.

        Discovery exchanges a few facts over the group, so the first access is collective: every
        rank must reach it (the topology-aware algorithms and ``auto`` all ask at the same call).
        ``COMMOPS_TOPOLOGY`` or :meth:`set_topology` replaces discovery. Under torchrun, its node
        rank (``GROUP_RANK``) and local rank number the nodes and the ranks in them.
        """
        if self._topology is None:
            launch = launcher_environment()
            torchrun = launch if launch is not None and launch.launcher == "torchrun" else None
            self._topology = discover(self.group, override=_env.TOPOLOGY.get() or None,
                                      group_rank=torchrun.group_rank if torchrun else None,
                                      local_rank=torchrun.local_rank if torchrun else None)
        return self._topology

    def set_topology(self, topo: Any) -> None:
        """Use ``topo`` instead of discovering it (``None``: discover again). Local; give every rank the same one."""
        if topo is not None and topo.world != self.size:
            raise ValueError(f"topology has {topo.world} ranks but this group has {self.size}")
        self._topology = topo
        self._derived = None
        self._choices.clear()
        self._fast.clear()

    def set_calibration(self, machine: Any) -> None:
        """Price ``auto``'s choices with ``machine`` (a :class:`topology.cost.Machine`, or a
        calibration file's path); ``None`` goes back to ``COMMOPS_CALIBRATION`` or a shipped file.
        Local; give every rank the same one."""
        if isinstance(machine, (str, bytes)) or hasattr(machine, "__fspath__"):
            machine = Machine.load(machine)
        self._forget_choices(keep="tuned_table")
        if machine is not None:
            self._choices["calibration"] = machine

    def set_tuned(self, table: Any) -> None:
        """Follow this tuned table (the dict ``bench/cli.py --tune`` writes, or its path) first in
        ``auto``; ``None`` goes back to ``COMMOPS_TUNED``. Local; give every rank the same one."""
        if isinstance(table, (str, bytes)) or hasattr(table, "__fspath__"):
            table = json.loads(Path(table).read_text())
        self._forget_choices(keep="calibration")
        if table is not None:
            self._choices["tuned_table"] = table

    def _forget_choices(self, keep: str) -> None:
        kept = self._choices.get(keep)
        self._choices.clear()
        self._fast.clear()
        if kept is not None:
            self._choices[keep] = kept

    def derived_groups(self) -> Any:
        """This rank's :class:`topology.groups.DerivedGroups`, created on first use (collective)."""
        if self._derived is None:
            self._derived = groups.derive(self.topology, self.rank, self.global_ranks, self.backend, self.group,
                                   self._group_timeout())
        return self._derived

    def p2p_group(self, cuda: bool) -> dist.ProcessGroup:
        """The group our point-to-point schedules send on: on Gloo a private twin of this group
        (same ranks, created on first use, collective), so that a program's own ``isend``/``irecv``
        on the group, whatever its tags, never matches one of ours (Gloo matches messages by peer
        and tag); on CUDA the group itself (NCCL ignores tags and orders by stream, in the
        program's order), and on MPI too (a new MPI group is made by the whole world at once)."""
        if cuda:
            return self.group
        if self._p2p is None:
            backend = self.backend_for("cpu") or self.backend
            if self.size == 1 or backend != "gloo":  # MPI makes a group collectively over the whole world
                self._p2p = self.group
            else:
                self._p2p = groups.private_group(self.group, self._group_name, "p2p", self.global_ranks, backend,
                                          self._group_timeout())
        return self._p2p

    def _group_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=group_timeout_s(self))

    # -- internals used by algorithms -------------------------------------------------------
    def next_tag(self) -> int:
        with self._lock:
            self._tag = (self._tag + 1) % (1 << 30)
            return self._tag

    def _submit(self, fn: Any, *args: Any) -> Future[None]:
        """Run ``fn(*args)`` on this group's one worker thread, after everything submitted before
        (``_pending`` counts what has not finished: while it is not zero, the dispatch point sends
        every call of this group here, in call order)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"commops-r{self.rank}")
            self._pending += 1
            future = self._executor.submit(fn, *args)
        future.add_done_callback(self._finished)
        return future

    def _drain(self) -> None:
        """Wait until the worker has finished everything submitted (each job bounded by its own waits)."""
        with self._lock:
            executor = self._executor
        if executor is not None and self._pending:
            executor.submit(lambda: None).result()

    def _finished(self, _: Future[None]) -> None:
        with self._lock:
            self._pending -= 1

    def _workspace(self, key: str, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        """Flat scratch of at least ``numel`` elements.

        On CPU it is kept per thread and reused (fresh host allocations fault in every page); on
        GPUs the caching allocator already reuses memory and keeps it stream-safe.
        """
        if device.type != "cpu":
            return torch.empty(numel, dtype=dtype, device=device)
        k = (key, threading.get_ident(), dtype)
        buf = self._scratch.get(k)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1024), dtype=dtype)
            self._scratch[k] = buf
        return buf[:numel]

    def close(self) -> None:
        """Stop the worker thread and free scratch. Local only: sends nothing."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._scratch.clear()
        self._fast.clear()

    # -- verbs -------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, async_op: bool = False, *,
                   algorithm: str = "auto") -> Work | None:
        """In-place all-reduce of ``tensor`` over the group (``torch.distributed.all_reduce``)."""
        if _compiling():
            return _traced.all_reduce(tensor, op, self.group, async_op, algorithm)
        return dispatch_tensors(self, "all_reduce", tensor, tensor, op, algorithm, async_op)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                              async_op: bool = False, *, algorithm: str = "auto") -> Work | None:
        """Reduce ``input`` ([world * n]) over the group; rank r gets elements [r*n, (r+1)*n) in ``output``."""
        if _compiling():
            return _traced.reduce_scatter(output, input, op, self.group, async_op, algorithm)
        return dispatch_tensors(self, "reduce_scatter", output, input, op, algorithm, async_op)

    reduce_scatter_tensor = reduce_scatter_single

    def all_gather_single(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, async_op: bool = False,
                          *, algorithm: str = "auto") -> Work | None:
        """Concatenate every rank's ``input_tensor`` ([n]) in rank order into ``output_tensor`` ([world * n])."""
        if _compiling():
            return _traced.all_gather(output_tensor, input_tensor, self.group, async_op, algorithm)
        return dispatch_tensors(self, "all_gather", output_tensor, input_tensor, None, algorithm, async_op)

    all_gather_into_tensor = all_gather_single

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                          input_split_sizes: Any = None, async_op: bool = False, *,
                          algorithm: str = "auto") -> Work | None:
        """Rank r sends rows ``input_split_sizes[q]`` of ``input`` to rank q and receives ``output_split_sizes[q]`` rows from q."""
        if _compiling():
            return _traced.all_to_all_single(output, input, output_split_sizes, input_split_sizes, self.group,
                                             async_op, algorithm)
        return dispatch(Call("all_to_all", self, output, input, in_rows=input_split_sizes,
                             out_rows=output_split_sizes, async_op=async_op, algorithm=algorithm))

    def broadcast(self, tensor: torch.Tensor, src: int | None = None, async_op: bool = False, *,
                  group_src: int | None = None, algorithm: str = "auto") -> Work | None:
        """Copy ``tensor`` of global rank ``src`` (or group rank ``group_src``) to every rank."""
        if _compiling():
            return _traced.broadcast(tensor, src, self.group, async_op, group_src, algorithm)
        return dispatch(Call("broadcast", self, tensor, root=src, group_root=group_src,
                             async_op=async_op, algorithm=algorithm))

    def reduce(self, tensor: torch.Tensor, dst: int | None = None, op: Any = ReduceOp.SUM, async_op: bool = False,
               *, group_dst: int | None = None, algorithm: str = "auto") -> Work | None:
        """Reduce ``tensor`` over the group into global rank ``dst`` (or group rank ``group_dst``)."""
        if _compiling():
            return _traced.reduce(tensor, dst, op, self.group, async_op, group_dst, algorithm)
        return dispatch(Call("reduce", self, tensor, reduce_op=op, root=dst,
                             group_root=group_dst, async_op=async_op, algorithm=algorithm))

    # torch.distributed's list forms, each one flat call of the verbs above (collectives/_lists.py)
    all_gather = _lists.all_gather
    reduce_scatter = _lists.reduce_scatter
    all_to_all = _lists.all_to_all
    gather = _lists.gather
    scatter = _lists.scatter

    def barrier(self, async_op: bool = False, device_ids: list[int] | None = None,
                timeout: datetime.timedelta | None = None) -> Work | None:
        """Block until every rank of the group has reached this call.

        Args:
            device_ids: the GPUs the backend's barrier uses (NCCL), as ``torch.distributed.barrier``'s.
            timeout: how long to wait at most (else the group's timeout); past it,
                ``CollectiveTimeout`` names the ranks that did not arrive.
        """
        if _compiling():
            return _traced.barrier(self.group, async_op, device_ids, timeout)
        if device_ids is not None and not (isinstance(device_ids, list) and
                                           all(isinstance(d, int) and not isinstance(d, bool) for d in device_ids)):
            raise InvalidTypeError("device_ids", device_ids, "is not a list of ints",
                                   "pass the GPU indices, e.g. [torch.cuda.current_device()]")
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise InvalidTypeError("timeout", timeout, f"is a {type(timeout).__name__}, not a datetime.timedelta",
                                   "pass e.g. datetime.timedelta(seconds=30)")
        call = Call("barrier", self, None, async_op=async_op, algorithm="native")
        call.device_ids = device_ids
        if timeout is None:
            return dispatch(call)
        with call_timeout(timeout):
            return dispatch(call)

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, backend={self.backend!r})"


# True while torch.compile traces: the methods then trace to the torch.ops.commops ops (_traced.py)
_compiling = torch.compiler.is_compiling


def get_communicator(group: dist.ProcessGroup | None = None) -> Communicator:
    """The (cached) communicator of ``group``; ``None`` means the default group."""
    if group is None or group is dist.GroupMember.WORLD:
        if _WORLD and _WORLD[0].group is dist.GroupMember.WORLD:
            return _WORLD[0]
        if not dist.is_initialized():
            Communicator()  # raises NotInitializedError with the how-to
        comm = Communicator()
        _WORLD[:] = [comm]
        return comm
    try:
        found = _COMMS.get(group)
    except TypeError:  # not weakly referenceable: an int, a str, a list
        found = None
    if found is None:
        if not isinstance(group, dist.ProcessGroup):
            raise InvalidTypeError("group", group, f"is a {type(group).__name__}, not a process group",
                                   "pass a torch.distributed.ProcessGroup (from new_group) or None for the world")
        found = _COMMS[group] = Communicator(group)
    return found


def destroy(group: dist.ProcessGroup | None = None) -> None:
    """Close and forget the communicator(s), then ``torch.distributed.destroy_process_group(group)``.

    ``None`` closes every communicator and destroys every group. Use this instead of calling
    torch's function directly when commops created communicators: a cached communicator would
    otherwise keep the process group alive until interpreter shutdown, where Gloo's destructor can
    abort the process ("terminate called without an active exception").
    """
    if group is None:
        comms = list(_COMMS.values()) + _WORLD
        _COMMS.clear()
        _WORLD.clear()
    else:
        comms = [c for c in (_COMMS.pop(group, None),) if c is not None]
        if _WORLD and _WORLD[0].group is group:
            comms += _WORLD
            _WORLD.clear()
    if group is None:  # every group, and with them the default store its progress goes to
        RECORDER.stop_progress()  # no thread may touch a store once it goes
    for c in comms:
        close_peer_memory(c)  # collective, like destroy itself
        c.close()
        if group is not None:  # the groups it made (derived, p2p twin) go with it
            for g in groups.forget(c._group_name):
                with contextlib.suppress(Exception):
                    dist.destroy_process_group(g)
        c.group = None  # type: ignore[assignment]
    del comms
    if group is None:
        groups.clear()
    if dist.is_initialized():
        dist.destroy_process_group(group)


_native.provide("communicator", sys.modules[__name__])  # what the compiled fast path reads (_native.py)
