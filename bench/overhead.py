"""What our dispatch point costs per call, measured against calling torch.distributed directly.

Both paths call the same backend collective on the same tiny tensor; blocks of calls alternate
(ours, theirs, ours, ...) so that drift in the machine's speed hits both alike, and the overhead
is the median over rounds of the paired difference of per-call times.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import collectives as C

__all__ = ["dispatch_overhead", "recorder_and_debug_cost", "issue_ways"]


def _per_call(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / calls


def dispatch_overhead(comm: C.Communicator, device: torch.device, *, calls: int = 200, rounds: int = 41,
                      op: str = "all_reduce") -> dict[str, float]:
    """Median per-call microseconds of ``C.<op>(algorithm="native")`` and of ``torch.distributed.<op>``."""
    x = torch.ones(1, device=device)
    g = comm.group
    if op == "all_reduce":
        def ours() -> object:
            return C.all_reduce(x, group=g, algorithm="native")

        def theirs() -> object:
            return dist.all_reduce(x, group=g)
    elif op == "broadcast":
        def ours() -> object:
            return C.broadcast(x, 0, group=g, algorithm="native")

        def theirs() -> object:
            return dist.broadcast(x, 0, group=g)
    else:
        raise ValueError(op)
    for _ in range(3):
        _per_call(ours, calls // 4 + 1, device)
        _per_call(theirs, calls // 4 + 1, device)
    mine, base, diff = [], [], []
    for i in range(rounds):
        dist.barrier(group=g)
        # alternate which goes first so that neither always follows the barrier
        if i % 2:
            a = _per_call(ours, calls, device)
            b = _per_call(theirs, calls, device)
        else:
            b = _per_call(theirs, calls, device)
            a = _per_call(ours, calls, device)
        mine.append(a)
        base.append(b)
        diff.append(a - b)
    # The slowest rank's figures, on the device the group's backend moves.
    t = torch.tensor([statistics.median(mine), statistics.median(base), statistics.median(diff)],
                     dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.MAX, group=g)
    return {"ours_us": t[0].item() * 1e6, "torch_us": t[1].item() * 1e6, "overhead_us": t[2].item() * 1e6,
            "calls_per_round": calls, "rounds": rounds, "world": comm.size}


def recorder_and_debug_cost(comm: C.Communicator, device: torch.device, *, calls: int = 2000,
                            rounds: int = 21) -> dict[str, float]:
    """Microseconds per call of the flight recorder (``start`` + ``end`` of one entry) and of
    debug check mode's fingerprint comparison (a store round trip, collective), medians over rounds."""
    from collectives.debug import check_call
    from collectives.dispatch import Call
    from collectives.recorder import RECORDER

    x = torch.ones(4, device=device)
    call = Call("all_reduce", comm, x, reduce_op="sum")
    rec = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(calls):
            call.seq = i
            RECORDER.end(RECORDER.start(call, "native"))
        rec.append((time.perf_counter() - t0) / calls)
    dbg = []
    n = max(1, calls // 20)
    for r in range(max(3, rounds // 4)):
        dist.barrier(group=comm.group)
        t0 = time.perf_counter()
        for i in range(n):
            call.seq = 10_000_000 + r * n + i
            check_call(call, "native")
        dbg.append((time.perf_counter() - t0) / n)
    t = torch.tensor([statistics.median(rec), statistics.median(dbg)], dtype=torch.float64)
    if device.type == "cuda":
        t = t.to(device)
    dist.all_reduce(t, dist.ReduceOp.MAX, group=comm.group)
    return {"recorder_us": t[0].item() * 1e6, "debug_check_us": t[1].item() * 1e6,
            "recorder_calls_per_round": calls, "debug_calls_per_round": n}



def issue_ways(comm: C.Communicator, device: torch.device, *, calls: int = 200,
               rounds: int = 41) -> dict[str, Any]:
    """Per-call microseconds of ways to issue a one-element sum all-reduce on ``device`` (blocks
    interleaved, the order flipped every round): ``torch.distributed.all_reduce``, the process
    group's ``allreduce`` and the backend's (each then ``wait``), ``collectives.all_reduce`` with
    ``native`` and ``auto``, and ``torch.compile``'d one-line functions calling ours and torch's.
    Returns the medians (``us``) and the medians of the paired differences to torch's
    (``minus_torch_us``), the slowest rank's."""
    x = torch.ones(1, device=device)
    g = comm.group
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.asyncOp = False
    backend = g._get_backend(device)

    def waited(work: Any) -> None:
        if work is not None:  # None: the backend synchronised itself
            work.wait()

    def ours(t: torch.Tensor) -> torch.Tensor:
        C.all_reduce(t, group=g, algorithm="native")
        return t

    def theirs(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=g)
        return t

    compiled_ours, compiled_theirs = torch.compile(ours, fullgraph=True), torch.compile(theirs, fullgraph=True)
    ways: dict[str, Callable[[], object]] = {
        "torch": lambda: dist.all_reduce(x, group=g),
        "process_group_method": lambda: waited(g.allreduce([x], opts)),
        "backend_method": lambda: waited(backend.allreduce([x], opts)),
        "ours_native": lambda: C.all_reduce(x, group=g, algorithm="native"),
        "ours_auto": lambda: C.all_reduce(x, group=g),
        "ours_compiled": lambda: compiled_ours(x),
        "torch_compiled": lambda: compiled_theirs(x),
    }
    for _ in range(3):
        for fn in ways.values():
            _per_call(fn, calls // 4 + 1, device)
    per: dict[str, list[float]] = {k: [] for k in ways}
    names = list(ways)
    for i in range(rounds):
        dist.barrier(group=g)
        for k in (names if i % 2 == 0 else names[::-1]):
            per[k].append(_per_call(ways[k], calls, device) * 1e6)
    us = {k: statistics.median(v) for k, v in per.items()}
    minus = {k: statistics.median([a - b for a, b in zip(per[k], per["torch"], strict=True)]) for k in ways}
    t = torch.tensor([*us.values(), *minus.values()], dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.MAX, group=g)
    n = len(ways)
    return {"us": dict(zip(names, t[:n].tolist())), "minus_torch_us": dict(zip(names, t[n:].tolist())),
            "calls_per_round": calls, "rounds": rounds, "world": comm.size}
