"""The one dispatch point every collective passes through.

``dispatch(call)`` validates the arguments (before anything is sent), on a communicator's first
call checks that its ranks' settings agree (:mod:`collectives._agree`), resolves the algorithm
(an explicit name, or ``auto`` through :mod:`collectives.selection`), records the call in the
flight recorder (:mod:`collectives.recorder`), in debug check mode compares it across ranks
(:mod:`collectives.debug`), notifies the trace hooks, labels the call for profilers, and hands
it to the algorithm; when the call fails it dumps the recorder, turns a timeout into
``CollectiveTimeout`` naming the ranks that never entered the call, and a peer's dropped
connection into ``RankLeft`` naming the ranks whose heartbeat stopped. No verb bypasses it:
``dispatch_tensors`` is its way in for the tensor verbs, with a fast path for repeated calls.

Design note: the call is a small ``__slots__`` object rather than a dataclass and the profiler
label is only built when a profiler is recording, because this function sits on every
collective's path and its cost is measured against calling torch.distributed directly
(``launch/bench_dispatch.py``).
"""

from __future__ import annotations

import difflib
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from . import _env, _native, _watch
from ._agree import agree, refuse
from ._validate import _current_device, validate
from ._wait import call_timeout, limit, wait
from .algos import REGISTRY, Algorithm, ScheduledAlgorithm, for_op
from .algos._schedule import Layout
from .debug import check_call
from .errors import (CollectiveMismatch, CollectiveTimeout, CommopsError, GroupAborted, RankFailed, RankLeft,
                     UnsupportedError)
from .recorder import RECORDER, missing_ranks, ranks_gone
from .recorder import STATE as _STATE, T_END as _T_END
from .selection import Choice, choose
from .work import EventWork, FutureWork, TorchWork, Work

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Call", "dispatch", "dispatch_tensors", "refused", "recorded", "add_trace_hook", "remove_trace_hook", "TraceHook"]

# A trace hook is called as hook(event, call, detail) with event "start" (after validation and
# choice, before anything is sent), "end" (the call returned; async calls may still run) or
# "error" (detail is the exception).
TraceHook = Callable[[str, "Call", Any], None]
_HOOKS: list[TraceHook] = []


def add_trace_hook(hook: TraceHook) -> None:
    _HOOKS.append(hook)


def remove_trace_hook(hook: TraceHook) -> None:
    _HOOKS.remove(hook)


class Call:
    """One collective call: what was asked, on which communicator, and what ran it."""

    __slots__ = ("op", "comm", "input", "output", "reduce_op", "root", "group_root", "in_rows",
                 "out_rows", "async_op", "algorithm", "choice", "seq", "tag", "fast", "device_ids")

    def __init__(self, op: str, comm: Communicator, output: Any, input: Any = None, *,
                 reduce_op: str | None = None, root: int | None = None, group_root: int | None = None,
                 in_rows: Any = None, out_rows: Any = None, async_op: bool = False,
                 algorithm: str = "auto") -> None:
        self.op = op
        self.comm = comm
        self.output = output
        self.input = output if input is None else input
        self.reduce_op = reduce_op
        self.root = root
        self.group_root = group_root
        self.in_rows = in_rows
        self.out_rows = out_rows
        self.async_op = async_op
        self.algorithm = algorithm
        self.choice: Choice | None = None
        self.seq = 0
        self.tag = 0
        self.fast: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # see dispatch_tensors
        self.device_ids: list[int] | None = None  # a barrier's (torch.distributed.barrier's device_ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the op's larger buffer (nccl-tests' "size")."""
        if self.output is None:
            return 0
        return max(self.output.numel(), self.input.numel()) * self.output.element_size()

    def layout(self) -> Layout:
        comm, op = self.comm, self.op
        if op == "all_to_all":
            row_in = _row(self.input)
            row_out = _row(self.output)
            return Layout(op, comm.size, comm.rank,
                          in_splits=tuple(r * row_in for r in self.in_rows),
                          out_splits=tuple(r * row_out for r in self.out_rows))
        count = self.input.numel() if op == "all_gather" else self.output.numel()
        return Layout(op, comm.size, comm.rank, count, self.root)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {"in": self.input.view(-1), "out": self.output.view(-1)}

    def __repr__(self) -> str:
        return (f"Call(op={self.op}, algorithm={self.algorithm}, seq={self.seq}, rank={self.comm.rank}/"
                f"{self.comm.size}, bytes={self.nbytes})")


def _row(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape[1:]:
        n *= s
    return n


# (algorithm, op, dtype, device type, backend) -> (algorithm, its Choice): an explicit algorithm's
# capability check is the same for every call with the same key, so it runs once.
_RESOLVED: dict[tuple[Any, ...], tuple[Algorithm, Choice]] = {}


def _resolve(call: Call) -> Algorithm:
    op, comm = call.op, call.comm
    t = call.output
    # t.device builds a device object; is_cuda answers the common case without one.
    dtype, dev = (t.dtype, "cuda" if t.is_cuda else t.device.type) if t is not None else (None, None)
    if call.algorithm == "auto":
        backend = comm.backend_for(dev) if dev is not None else comm.backend
        call.choice = choose(call, backend or "")
        comm.last_choice = call.choice
        return REGISTRY[call.choice.algorithm]
    key = (call.algorithm, op, dtype, dev, comm.backend)
    hit = _RESOLVED.get(key)
    if hit is None:
        backend = comm.backend_for(dev) if dev is not None else comm.backend
        algo = REGISTRY.get(call.algorithm)
        if algo is None or not algo.supports(op, dtype, backend):
            usable = for_op(op, dtype, backend)
            why = "is not a registered algorithm" if algo is None else f"does not run {op} on {dtype} with {backend}"
            near = difflib.get_close_matches(call.algorithm, usable, n=1) if isinstance(call.algorithm, str) else []
            raise UnsupportedError("algorithm", call.algorithm, why, (f"did you mean {near[0]!r}? " if near else "")
                                   + f"pass 'auto' or one of {usable}")
        hit = _RESOLVED[key] = (algo, Choice(algo.name, "requested", "algorithm= given by the caller"))
    algo, choice = hit
    if call.choice is None:  # set by validation where the call decided it (a sparse tensor)
        call.choice = choice
    if algo.equal_splits_only and op == "all_to_all" and (len(set(call.in_rows)) > 1 or len(set(call.out_rows)) > 1):
        raise UnsupportedError("algorithm", call.algorithm, "needs equal all-to-all splits",
                               f"use 'pairwise' or 'native' for uneven splits (usable: {for_op(op, dtype, comm.backend_for(dev or 'cpu'))})")
    return algo


def _use_native() -> None:
    """Load the compiled fast path (collectives/_native.py) for this process's CUDA calls."""
    global _native_dispatch, _native_verb, _native_tried
    module = _native.configure_cuda()
    _native_dispatch = None if module is None else module.fast_dispatch
    _native_verb = None if module is None else module.fast_verb
    _native_tried = True


# the compiled fast path's entry point, once loaded: fast_dispatch(comm, op, output, input,
# reduce_op, algorithm) is None when it ran the call, NotImplemented when Python should
_native_dispatch: Callable[..., Any] | None = None
# the same for the verbs, finding the communicator too: fast_verb(op, output, input, reduce_op,
# group, async_op, algorithm) (collectives/__init__.py)
_native_verb: Callable[..., Any] | None = None
_native_tried = False
_now = time.time
_FAST_MAX = 512  # call signatures kept per communicator (dispatch_tensors); a full table starts again

# What keys a repeat's fast path, defined here once: the compiled fast path is handed these by
# collectives/_native.py's configure and builds its key from them (collectives/_fastpath.c).
# comm._fast's key is the facts of a call, in this order: the arguments op, algorithm and
# reduce_op (by value where its type is one of _FAST_BY_VALUE, else by id: a ReduceOp member
# hashes slowly, ~0.2 us), the output's dtype and numel, and out of place the input's numel.
# _fast_key builds it.
_FAST_KEY = ("op", "algorithm", "reduce_op", "dtype", "numel")
_FAST_KEY_OUT_OF_PLACE = (*_FAST_KEY, "input_numel")
_FAST_BY_VALUE = (type(None), str)
# comm._fast's values are (runner, the reduce op itself): the entry holds the op so that the id
# its key holds cannot be reused while the entry lives.
_FAST_RUNNER = 0

# True while torch.profiler (or the legacy autograd profiler) records; a C call, cheap enough
# to ask on every collective.
_profiling = torch._C._autograd._profiler_enabled


def dispatch_tensors(comm: Communicator, op: str, output: torch.Tensor, input: torch.Tensor, reduce_op: Any,
                     algorithm: str, async_op: bool, native_tried: bool = False) -> Work | None:
    """The tensor verbs' way in: a repeat of a call already resolved takes the fast path, any other
    call the full :func:`dispatch`.

    A call's signature (op, algorithm, reduce op as given, dtype, element counts, in place or
    not) fixes everything the full path checks and decides except what belongs to the tensor
    objects themselves, which the fast path checks again (CUDA tensors of one dtype, contiguous,
    on the current device). It applies only to synchronous calls of algorithms that offer a
    runner (``Algorithm.fast_path``), outside ``call_timeout`` blocks, with no trace hook,
    profiler or NVTX tool to inform; the call still counts in ``comm.seq`` and is recorded. On
    the 2xH200 machine it takes several microseconds off each small peer-memory call, which is
    most of the host time such a call has. The compiled fast path (collectives/_native.py) is
    tried first, unless the caller has just tried it (``native_tried``: the verbs do).
    """
    if _native_dispatch is not None and not async_op and not native_tried \
            and _native_dispatch(comm, op, output, input, reduce_op, algorithm) is None:
        return None  # the compiled fast path ran it (the same checks, tables and record as below)
    # The compiled fast_dispatch (collectives/_fastpath.c) makes these checks too, in this order,
    # from the tables above and on the same objects: a check changed here is changed there.
    if not async_op and type(output) is torch.Tensor and output.is_cuda and not _HOOKS and not comm.debug \
            and limit() is None:
        key = _fast_key(op, algorithm, reduce_op, output, input)
        hit = comm._fast.get(key)  # None (no key) is never one
        if output is input:  # all_reduce: one tensor to check
            fast = hit is not None and output.is_contiguous() and output.get_device() == _current_device()
        else:
            fast = hit is not None and input.dtype is output.dtype and output.is_contiguous() \
                and input.is_contiguous() and output.get_device() == _current_device() == input.get_device()
        if fast and not _profiling() and not _env.nvtx_enabled():
            runner = hit[_FAST_RUNNER]  # type: ignore[index]
            comm.seq += 1
            entry = RECORDER.start_fast(comm, op, algorithm, output, input, reduce_op)
            try:
                runner(output, input)
            except BaseException as exc:
                # Marked inline, before any call: a signal handler (a launcher's SIGTERM) runs at the
                # next call's entry and may raise there, and the entry would stay "started".
                entry[_STATE] = "failed"
                entry[_T_END] = _now()
                _failed(comm, op, comm.seq, exc)
                raise
            entry[_T_END], entry[_STATE] = _now(), "completed"  # RECORDER.end, inlined on this path
            return None
    else:
        key = None
    call = Call(op, comm, output, input, reduce_op=reduce_op, async_op=async_op, algorithm=algorithm)
    result = dispatch(call)
    if key is not None and call.fast is not None and call.output is output:  # not a complex tensor's real view
        if not _native_tried:
            _use_native()
        if len(comm._fast) >= _FAST_MAX:
            comm._fast.clear()
        comm._fast[key] = (call.fast, reduce_op)  # the runner at _FAST_RUNNER
    return result


def _fast_key(op: str, algorithm: str, reduce_op: Any, output: torch.Tensor, input: Any) -> tuple[Any, ...] | None:
    """``comm._fast``'s key for a call: ``_FAST_KEY``'s facts (``_FAST_KEY_OUT_OF_PLACE``'s where
    ``input`` is not ``output``), in that order; None where the input is not a tensor."""
    rop = reduce_op if type(reduce_op) in _FAST_BY_VALUE else id(reduce_op)
    if output is input:
        return (op, algorithm, rop, output.dtype, output.numel())
    if type(input) is torch.Tensor:
        return (op, algorithm, rop, output.dtype, output.numel(), input.numel())
    return None


@contextmanager
def recorded(comm: Communicator, op: str, algorithm: str, output: torch.Tensor, input: torch.Tensor) -> Iterator[None]:
    """Count and record, like a collective, communication that runs outside the verbs (the
    overlap operators' copy-engine paths, the peer MoE transport): a sequence number of ``comm``,
    a flight-recorder entry, and on an exception the same dump and timeout handling as a
    collective's. A group in trouble is settled first, as before a verb. The host waits inside
    such a call on the GPU (or compiles), where the patrol cannot break the wait: what the patrol
    found meanwhile (a mismatch, another rank's failure) is raised when the block ends."""
    entry = _record_start(comm, op, algorithm, output, input)
    try:
        yield
        _raise_kept(comm)
    except BaseException as exc:
        _record_failure(comm, op, entry, exc)
    RECORDER.end(entry, "enqueued")


def run_recorded(comm: Communicator, op: str, algorithm: str, output: torch.Tensor, input: torch.Tensor,
                 fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` inside ``recorded(comm, op, algorithm, output, input)``, without a
    generator's frames: for the calls whose host time is a few microseconds (a decode kernel)."""
    entry = _record_start(comm, op, algorithm, output, input)
    try:
        fn(*args)
        _raise_kept(comm)
    except BaseException as exc:
        _record_failure(comm, op, entry, exc)
    RECORDER.end(entry, "enqueued")


def _record_start(comm: Communicator, op: str, algorithm: str, output: torch.Tensor, input: torch.Tensor) -> list[Any]:
    if comm._trouble is not None:
        _watch.settle(comm, op)
    comm.seq += 1
    return RECORDER.start_fast(comm, op, algorithm, output, input, None)


def _raise_kept(comm: Communicator) -> None:
    kept, comm._kept = comm._kept, None
    if kept is not None:
        raise kept


def _record_failure(comm: Communicator, op: str, entry: list[Any], exc: BaseException) -> NoReturn:
    entry[_STATE] = "failed"
    entry[_T_END] = _now()
    try:
        _failed(comm, op, comm.seq, exc)
    except BaseException as typed:  # the peers hear of it, as of a verb's failure
        _watch.failed(comm, comm.seq, op, typed)
        raise
    _watch.failed(comm, comm.seq, op, exc)
    raise exc


def dispatch(call: Call) -> Work | None:
    """Validate, choose, trace and run ``call``; returns a handle when ``call.async_op``."""
    comm = call.comm
    if comm._trouble is not None:  # an earlier call failed: aborted, or this rank awaits the verdict
        _watch.settle(comm, call.op)
    if comm._pending and comm._topology is None:
        # The choice below may discover the topology, a collective on this group: not while
        # the worker runs this group's earlier async calls.
        comm._drain()
    try:
        validate(call)
    except BaseException as exc:
        refused(comm, call.op, exc)
        raise
    if comm._settings is None:  # the communicator's first call: its ranks' settings must agree (one store round trip)
        agree(comm, call.op)
        RECORDER.track(comm)  # the heartbeat RankLeft reads, recorder on or off
    try:
        algo = _resolve(call)
        if algo.topology_aware:
            algo.check(call)
    except BaseException as exc:
        refused(comm, call.op, exc)
        raise
    comm.seq += 1
    call.seq = comm.seq
    entry = RECORDER.start(call, algo.name)
    if comm.debug:
        try:
            check_call(call, algo.name)
        except BaseException as exc:
            entry[_STATE] = "failed"
            entry[_T_END] = _now()
            _failed(comm, call.op, call.seq, exc)
            raise
    hooks = _HOOKS
    if hooks:
        for h in hooks:
            h("start", call, None)
    # Labels cost host time on every call (record_function alone is several microseconds), so
    # each is paid only when someone can see it: a torch profiler that is recording, or, on CUDA
    # tensors, NVTX while a tool listens (COMMOPS_NVTX, see collectives/_env.py).
    profiling = _profiling()
    nvtx = call.output is not None and call.output.is_cuda and _env.nvtx_enabled()
    try:
        if not (profiling or nvtx):
            result = _run(algo, call)
        else:
            label = f"commops.{call.op}[{algo.name}] {call.nbytes}B"
            if nvtx:
                torch.cuda.nvtx.range_push(label)
            try:
                if profiling:
                    with torch.profiler.record_function(label):
                        result = _run(algo, call)
                else:
                    result = _run(algo, call)
            finally:
                if nvtx:
                    torch.cuda.nvtx.range_pop()
    except BaseException as exc:
        entry[_STATE] = "failed"
        entry[_T_END] = _now()
        if hooks:
            for h in hooks:
                h("error", call, exc)
        try:
            _failed(comm, call.op, call.seq, exc)
        except BaseException as typed:
            _watch.failed(comm, call.seq, call.op, typed)
            raise
        _watch.failed(comm, call.seq, call.op, exc)
        raise
    RECORDER.end(entry, "enqueued" if call.async_op else "completed")
    if hooks:
        for h in hooks:
            h("end", call, result)
    elif not call.async_op and call.output is not None and call.output.is_cuda:
        call.fast = algo.fast_path(call)
    return result


def refused(comm: Communicator, op: str, exc: BaseException) -> None:
    """This rank's call failed before it sent anything: tell the others, who may be waiting in it
    (a group's first call through the settings check, later ones through a failure notice that
    uses up the call's number here)."""
    if comm._settings is None:
        refuse(comm, op, exc)
    elif comm._epoch is not None:
        comm.seq += 1
        _watch.failed(comm, comm.seq, op, exc)


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


# raised by the watch with what it read from the store; never retyped as a timeout or a lost peer
_FROM_PEERS = (RankFailed, GroupAborted, CollectiveMismatch)

# What Gloo's TCP transport says when a peer's socket closes under it (its process is gone).
_CONNECTION_LOST = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
                    "socket closed")


def _is_connection_loss(exc: BaseException) -> bool:
    if isinstance(exc, CommopsError) or not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(s in text for s in _CONNECTION_LOST)


def _failed(comm: Communicator, op: str, seq: int, exc: BaseException) -> None:
    """A collective raised: dump the flight recorder; a timeout becomes ``CollectiveTimeout``
    naming the ranks that never entered this call (from their published progress), a dropped
    connection ``RankLeft`` naming the ranks that are gone (from their heartbeats)."""
    RECORDER.dump(f"{op} #{seq} on group {comm._group_name} raised: {exc}"[:2000])
    if isinstance(exc, _FROM_PEERS):  # typed already
        return
    kept = comm._kept
    if kept is not None:  # the patrol broke this call's wait, for a failure it read in the store
        comm._kept = None
        raise kept from exc
    if _is_connection_loss(exc):
        culprit = _watch.first_failure(comm, seq, op)
        if culprit is not None:  # a peer broke its connections on hearing of that failure
            raise culprit from exc
        raise RankLeft(op, seq, ranks_gone(comm), str(exc)[:1000]) from exc
    if isinstance(exc, CollectiveTimeout) or not _is_timeout(exc):
        return
    missing = missing_ranks(comm, seq)
    detail = (f"call #{seq} on group {comm._group_name} (global ranks {list(comm.global_ranks)}) timed out "
              f"on rank {comm.global_ranks[comm.rank]}; " +
              (f"rank(s) {missing} never reported entering it (skipped it, stuck before it, or cut off from "
               "the store)" if missing else "every rank reported entering it (one is slow, stuck inside it, or "
               "gone mid-call)"))
    failures = _watch.failures_before(comm, seq)
    if failures:
        detail += f"; failure notices: {failures}"
    _abort(comm)
    raise CollectiveTimeout(op, missing, detail, str(exc)[:1000]) from exc


def _abort(comm: Communicator) -> None:
    # So that no rank stays blocked in this group's collectives (NCCL); Gloo's connections close
    # when the process exits.
    abort = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
    if abort is not None and comm.backend_for("cuda"):
        try:
            abort(comm.group)
        except Exception:  # noqa: BLE001 - best effort: the error being raised matters more
            pass


def _run(algo: Algorithm, call: Call) -> Work | None:
    out, inp = call.output, call.input
    if out is not None and (out.requires_grad or inp.requires_grad) and torch.is_grad_enabled():
        # torch.distributed's verbs write a tensor that requires grad in place without autograd
        # seeing it (the version counter still moves); ours do the same instead of failing in
        # their first in-place torch op after some ranks have sent.
        with torch.no_grad():
            return _run_plain(algo, call)
    return _run_plain(algo, call)


def _run_plain(algo: Algorithm, call: Call) -> Work | None:
    comm = call.comm
    cuda = call.output is not None and call.output.is_cuda
    if not cuda and comm._pending:
        # Async work of this group is still running on its worker thread: this call queues behind
        # it, so that every rank issues the group's collectives (and those of its derived groups)
        # in the order the program called them. Run inline, a call issued before an earlier
        # async one's wait() would pair with a different call on each rank.
        if isinstance(algo, ScheduledAlgorithm):
            call.tag = comm.next_tag()
        bound = limit()
        future = comm._submit(_in_order, algo, call, bound)
        if call.async_op:
            return FutureWork(future, _outputs(call))
        try:
            future.result(timeout=None if bound is None else bound.total_seconds())
        except FutureTimeout:
            raise CollectiveTimeout(call.op, [], f"call #{call.seq} on group {comm._group_name} waited "
                                    f"{bound.total_seconds() if bound else 0:g} s (its call_timeout) behind this group's earlier "
                                    "async calls, still running on its worker thread") from None
        return None
    if algo.returns_work:
        work = algo.run(call)
        return TorchWork(work) if call.async_op else None
    if isinstance(algo, ScheduledAlgorithm):
        call.tag = call.comm.next_tag()
    if not call.async_op:
        algo.run(call)
        return None
    if call.output.is_cuda:
        # Point-to-point steps and the backends' collectives only order streams on GPUs: enqueue now, hand back an event.
        algo.run(call)
        event = torch.cuda.Event()
        event.record()
        return EventWork(event, _outputs(call))
    return FutureWork(call.comm._submit(_in_order, algo, call, limit()), _outputs(call))


def _outputs(call: Call) -> list[torch.Tensor]:
    """What a handle's ``result()`` gives: the call's output tensor (none for a barrier)."""
    return [] if call.output is None else [call.output]




def _in_order(algo: Algorithm, call: Call, bound: Any) -> None:
    """Run ``call`` to completion on the communicator's worker thread, under the caller's
    ``call_timeout`` bound (thread-local, so carried here) and without autograd (see ``_run``)."""
    try:
        with torch.no_grad(), (call_timeout(bound) if bound is not None else nullcontext()):
            work = algo.run(call)
            if work is not None:  # the backend's own Work (an async native call queued here)
                wait(work)
    except BaseException as exc:
        if call.async_op:  # a synchronous call queued here fails through dispatch's own handler, once
            _failed(call.comm, call.op, call.seq, exc)  # a timeout or a lost peer, typed as on the caller's thread
        raise


_native.provide("dispatch", sys.modules[__name__])  # what the compiled fast path reads (_native.py)
