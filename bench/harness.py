"""Timing collectives the way nccl-tests does, as functions that return records.

Conventions (nccl-tests' ``PERFORMANCE.md``): ``bytes`` is the op's "size" (the all-reduce
buffer, the reduce-scatter input, the all-gather output, the all-to-all send buffer, the
broadcast/reduce buffer); ``algbw = bytes / time``; ``busbw = algbw * factor(op, world)``;
``#wrong`` counts output elements outside the float64 reference's rounding bound, checked on
fresh random data before timing.

Timing: ``warmup`` calls, then ``reps`` loops of ``iters`` back-to-back calls (more calls per loop
when ``min_loop_s`` asks for loops of at least that duration). On GPUs a loop is
timed with CUDA events (or replayed as one captured CUDA graph with ``graph=True``), from the end
of a one-element all-reduce that lines the GPUs up (``_align``); on CPUs with ``perf_counter``. A
loop's time per call is the maximum over ranks (the slowest rank sets the pace); the record holds
the median, min and max over loops. The algorithms of one size are timed side by side, a loop of
each per round (:func:`measure_side_by_side`), so that a comparison shares the host's drift.
"""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

import collectives as C
from collectives.algos import REGISTRY, busbw_factor

from . import anchors as A
from . import reference as R

__all__ = ["Record", "bind_to_core", "measure", "measure_side_by_side", "sweep", "element_count", "prepare", "time_fn", "time_interleaved"]

K = TypeVar("K", bound=Hashable)

_DIVIDED = ("reduce_scatter", "all_gather", "all_to_all")


@dataclass
class Record:
    op: str
    algorithm: str
    dtype: str
    bytes: int
    count: int
    world: int
    backend: str
    device: str
    graph: bool
    time_us: float
    time_us_min: float
    time_us_max: float
    algbw_GBps: float
    busbw_GBps: float
    wrong: int | None
    chosen: str | None = None  # what "auto" ran
    vs_native: float | None = None  # median over rounds of time / native's in the same round
    time_us_rounds: list[float] | None = None  # the time of each round, in round order

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def element_count(op: str, nbytes: int, dtype: torch.dtype, world: int) -> int:
    """Elements of the op's "size" buffer for about ``nbytes``: a multiple of ``world`` where the op divides it."""
    n = max(1, nbytes // torch.empty((), dtype=dtype).element_size())
    if op in _DIVIDED:
        n = max(world, n - n % world)
    return n


def bind_to_core(local_rank: int, local_world: int, cpus: Iterable[int] | None = None) -> int | None:
    """Bind this process (and the threads it starts from now on) to one CPU core of its own, the
    local ranks spread evenly over the cores it may use, CPU 0 left out where there are cores to
    spare (it takes most interrupts on many hosts). Returns the core, or None where there are
    fewer cores than local ranks (nothing is bound).

    Small GPU calls are bound by the host's time to launch them. On the 2xH200 host, unbound
    ranks ran a loop of 8-byte all-reduces about 1.5x slower for stretches of seconds, every
    implementation alike (NCCL's 40 -> 60-80 us, torch's two-shot 7.4 -> 9-10 us), and one
    core per rank kept most loops at the fast figures (probe, 2026-12-01)."""
    free = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(free) > local_world and 0 in free:
        free.remove(0)
    if local_world < 1 or len(free) < local_world or not 0 <= local_rank < local_world:
        return None
    core = free[local_rank * (len(free) // local_world)]
    os.sched_setaffinity(0, {core})
    return core


def _caller(op: str, a: str, out: torch.Tensor, inp: torch.Tensor, g: dist.ProcessGroup, root: int) -> Callable[[], object]:
    """The call a user would write, bound once: a loop of calls times the verb, not the benchmark
    (the anchors are timed as the bare calls they are, too)."""
    if op == "all_reduce":
        return lambda: C.all_reduce(out, group=g, algorithm=a)
    if op == "reduce_scatter":
        return lambda: C.reduce_scatter_single(out, inp, group=g, algorithm=a)
    if op == "all_gather":
        return lambda: C.all_gather_single(out, inp, group=g, algorithm=a)
    if op == "all_to_all":
        return lambda: C.all_to_all_single(out, inp, group=g, algorithm=a)
    if op == "broadcast":
        return lambda: C.broadcast(out, group=g, group_src=root, algorithm=a)
    if op == "reduce":
        return lambda: C.reduce(out, group=g, group_dst=root, algorithm=a)
    raise ValueError(op)


class _Case:
    """Buffers and the call for one (op, algorithm, size), built once and called many times."""

    def __init__(self, comm: C.Communicator, op: str, algorithm: str, total: int, dtype: torch.dtype,
                 device: torch.device, seed: int, root: int = 0) -> None:
        self.comm, self.op, self.algorithm, self.total = comm, op, algorithm, total
        self.dtype, self.device, self.seed, self.root = dtype, device, seed, root
        w, r = comm.size, comm.rank
        n_in = total if op != "all_gather" else total // w
        if algorithm in A.ANCHORS:
            self.inp, self.out, anchor = A.build(algorithm, comm.group, total, dtype, device)
            self.inp.copy_(R.rank_data(r, n_in, dtype, seed, device))
            self.call: Callable[[], object] = anchor
            return
        self.inp = R.rank_data(r, n_in, dtype, seed, device)
        if op in ("reduce_scatter", "all_gather", "all_to_all"):
            self.out = torch.empty(total // w if op == "reduce_scatter" else total, dtype=dtype, device=device)
        else:
            self.out = self.inp
        self.call = _caller(op, algorithm, self.out, self.inp, comm.group, root)

    def check(self) -> int:
        """#wrong of one call on fresh data (all ranks' inputs regenerated locally)."""
        w, r = self.comm.size, self.comm.rank
        n_in = self.inp.numel()
        xs = [R.rank_data(q, n_in, self.dtype, self.seed + 1, self.device) for q in range(w)]
        self.inp.copy_(xs[r])
        if self.out is not self.inp:
            self.out.fill_(float("nan") if self.dtype.is_floating_point else -1)
        self.call()
        if self.op == "reduce" and r != self.root:
            return 0
        splits = [[n_in // w] * w for _ in range(w)] if self.op == "all_to_all" else None
        ref = R.expected(self.op, xs, r, "sum", self.root, splits)
        tol = R.tolerance(self.op, xs, r, self.dtype, "sum", self.root)
        return R.count_wrong(self.out, ref, tol)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(comm: C.Communicator, seconds: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(seconds, dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.MAX, group=comm.group)
    return t.tolist()


def _time_loops(case: _Case, iters: int, reps: int, graph: bool) -> list[float]:
    dev = case.device
    if dev.type != "cuda":
        out = []
        for _ in range(reps):
            dist.barrier(group=case.comm.group)
            t0 = time.perf_counter()
            for _ in range(iters):
                case.call()
            out.append((time.perf_counter() - t0) / iters)
        return out
    if graph:
        run = _captured(case.call, iters)
    else:
        def run() -> None:
            for _ in range(iters):
                case.call()
    return _timed_runs(run, case.comm, dev, iters, reps)


def _captured(call: Callable[[], object], iters: int) -> Callable[[], None]:
    """``iters`` calls captured in one CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm the side stream before capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            call()
    return g.replay


_ALIGN: dict[torch.device, torch.Tensor] = {}


def _align(comm: C.Communicator, dev: torch.device) -> None:
    """Line the GPUs up on the current stream: a one-element all-reduce of the group's device
    backend, which ends on every GPU once the last rank has reached it.

    After a host barrier the ranks leave at different times, by up to a few hundred microseconds
    on the 2xH200 host. Without this, each rank's loop of calls that wait for one another would
    start its clock when it alone got there and absorb that skew: ``skew / iters`` per call,
    several microseconds for loops of a few dozen small calls."""
    t = _ALIGN.get(dev)
    if t is None:
        t = _ALIGN[dev] = torch.zeros(1, device=dev)
    dist.all_reduce(t, group=comm.group)


def _timed_runs(run: Callable[[], None], comm: C.Communicator, dev: torch.device, iters: int, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        _sync(dev)
        dist.barrier(group=comm.group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _align(comm, dev)  # the start event fires on every GPU when the last rank is there
        start.record()
        run()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / iters)
    return out


def _per_call_s(fn: Callable[[], object], comm: C.Communicator, device: torch.device, calls: int) -> float:
    """Seconds per call in a loop of ``calls`` back-to-back calls (the slowest rank's), to size
    loops by. (From one call and a sync it would be the call's latency, several times the pace of
    a loop of small calls, and the loops ``min_loop_s`` asks for would come out that much shorter.)"""
    dist.barrier(group=comm.group)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return _slowest(comm, [(time.perf_counter() - t0) / calls], device)[0]


class _Fn:
    """What ``_time_loops`` needs of a case: a call, a device, a communicator."""

    def __init__(self, fn: Callable[[], object], comm: C.Communicator, device: torch.device) -> None:
        self.call, self.comm, self.device = fn, comm, device


def time_fn(fn: Callable[[], object], comm: C.Communicator, device: torch.device, iters: int, reps: int,
            graph: bool = False, warmup: int = 2) -> float:
    """Microseconds per call of ``fn`` timed like a collective (see the module docstring): the
    median over ``reps`` loops of the slowest rank's time, eagerly or replayed from a CUDA graph."""
    for _ in range(warmup):
        fn()
    _sync(device)
    per = _slowest(comm, _time_loops(_Fn(fn, comm, device), iters, reps, graph), device)  # type: ignore[arg-type]
    return statistics.median(per) * 1e6


def time_interleaved(fns: dict[str, Callable[[], object]], comm: C.Communicator, device: torch.device, iters: int,
                     reps: int, warmup: int = 2, graph: bool = False, min_loop_s: float = 0.0,
                     rounds: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Microseconds per call of each of ``fns``, timed like :func:`time_fn` but in rounds: each
    round times one loop of every function in turn (each round in its own order), and each gets
    the median over ``reps`` rounds. ``rounds``, if given, receives each function's time in every
    round, in round order (for comparisons paired within a round: :func:`paired_ratio`).
    Variants compared with each other then share the machine's drift instead of each getting a
    different stretch of it (on a busy host, a loop timed a second later can be 2x off). With
    ``graph`` (CUDA), each function's loop is captured once in a CUDA graph and the rounds replay it.
    ``min_loop_s`` > 0 (eager) gives every function more than ``iters`` calls per loop where a loop
    would be shorter (from the slowest rank's time of one call), so that fast calls are timed over
    enough of the host's jitter for a stable median."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    loops = dict.fromkeys(fns, iters)
    if min_loop_s > 0 and not graph:
        for name, fn in fns.items():
            one = _per_call_s(fn, comm, device, iters)
            loops[name] = max(iters, min(100 * iters, math.ceil(min_loop_s / max(one, 1e-9))))
    replays = {name: _captured(fn, iters) for name, fn in fns.items()} if graph and device.type == "cuda" else {}
    per = _in_rounds({name: _Fn(fn, comm, device) for name, fn in fns.items()}, loops, replays, comm, device, reps)
    if rounds is not None:
        rounds.update({name: [t * 1e6 for t in v] for name, v in per.items()})
    return {name: statistics.median(v) * 1e6 for name, v in per.items()}


def _in_rounds(timed: dict[K, Any], loops: dict[K, int], replays: dict[K, Callable[[], None]], comm: C.Communicator,
               device: torch.device, reps: int) -> dict[K, list[float]]:
    """Seconds per call of each of ``timed`` (a ``_Case`` or ``_Fn``: a call, a communicator, a
    device) in ``reps`` rounds of one loop of ``loops[k]`` calls each (the replay of its captured
    loop, where ``replays`` has one), the slowest rank's, in round order."""
    per: dict[K, list[float]] = {k: [] for k in timed}
    for i in range(reps):
        # each round in its own order (seeded by the round: the same on every rank), so that no
        # function always follows the same one; a GPU's clocks after a heavy loop would bias it
        order = list(timed)
        random.Random(i).shuffle(order)
        for k in order:
            if k in replays:
                loop = _timed_runs(replays[k], comm, device, loops[k], 1)
            else:
                loop = _time_loops(timed[k], loops[k], 1, False)
            per[k] += _slowest(comm, loop, device)
    return per


def paired_ratio(rounds: dict[str, list[float]], name: str, base: str) -> float:
    """The median over rounds of ``name``'s time over ``base``'s in the same round.

    Two variants timed in the same round share that stretch of the machine's drift; the ratio
    of their medians does not pair them, and on a host-bound loop of 40-90 us calls two runs of
    one program differed by up to 4-6% that way on 2xH200."""
    return statistics.median(t / b for t, b in zip(rounds[name], rounds[base], strict=True))


def paired_hidden_share(rounds: dict[str, list[float]], base: str, name: str,
                        terms: tuple[tuple[str, ...], ...]) -> float:
    """The median over rounds of ``(base - name) / min(the sums of terms)`` in the same round, in %:
    the share of the smaller term (each term a sum of functions timed in those rounds) that
    ``name`` hides against ``base`` (0 in a round where a term took no time)."""
    shares = []
    for i, (b, t) in enumerate(zip(rounds[base], rounds[name], strict=True)):
        small = min(sum(rounds[f][i] for f in term) for term in terms)
        shares.append((b - t) / small if small > 0 else 0.0)
    return 100 * statistics.median(shares)


def measure(comm: C.Communicator, op: str, algorithm: str, nbytes: int, dtype: torch.dtype, device: torch.device, *,
            iters: int = 20, warmup: int = 5, reps: int = 5, check: bool = True, graph: bool = False,
            seed: int = 0, min_loop_s: float = 0.0) -> Record:
    """Time one (op, algorithm, size); see the module docstring for the conventions."""
    return measure_side_by_side(comm, op, [algorithm], nbytes, dtype, device, iters=iters, warmup=warmup, reps=reps,
                                check=check, graph=graph, seed=seed, min_loop_s=min_loop_s)[0]


def measure_side_by_side(comm: C.Communicator, op: str, algorithms: list[str], nbytes: int | list[int],
                         dtype: torch.dtype, device: torch.device, *, iters: int = 20, warmup: int = 5, reps: int = 5,
                         check: bool = True, graph: bool = False, seed: int = 0,
                         min_loop_s: float = 0.0) -> list[Record]:
    """Time each of ``algorithms`` at each size of ``nbytes`` (one or a list) in rounds: each
    round times one loop of every (size, algorithm), each round in its own order, and each record
    holds its median, min and max over the ``reps`` rounds, each round's time, and (where "native"
    is among ``algorithms``) the median over rounds of its time over native's in the same round.
    What is compared then shares the
    host's drift instead of each getting a different stretch of it: on the 2xH200 hosts, loops
    of small calls ran 1.3-1.5x slower for stretches of 0.1-1 s, every implementation alike, and
    a stretch now spoils a few rounds of many sizes (the medians drop them) instead of every
    round of one size.

    ``min_loop_s`` > 0 raises a loop's calls above ``iters`` until it lasts about that long (from
    the slowest rank's time for one call, so every rank makes the same number of calls): fast
    calls then get enough repetitions for a stable median. Records come in (size, algorithm) order.
    """
    w = comm.size
    jobs = [(s, a) for s in ([nbytes] if isinstance(nbytes, int) else nbytes) for a in algorithms]
    cases: dict[tuple[int, str], _Case] = {}
    wrong: dict[tuple[int, str], int | None] = {}
    chosen: dict[tuple[int, str], str | None] = {}
    loops: dict[tuple[int, str], int] = {}
    for job in jobs:
        s, a = job
        case = cases[job] = _Case(comm, op, a, element_count(op, s, dtype, w), dtype, device, seed)
        wrong[job] = case.check() if check else None
        chosen[job] = comm.last_choice.algorithm if a == "auto" and comm.last_choice else None
        for _ in range(warmup):
            case.call()
        _sync(device)
        loops[job] = iters
        if min_loop_s > 0:
            one = _per_call_s(case.call, comm, device, iters)
            loops[job] = max(iters, min(10_000, int(min_loop_s / max(one, 1e-7))))
    replays = {job: _captured(cases[job].call, loops[job]) for job in jobs} if graph and device.type == "cuda" else {}
    per = _in_rounds(cases, loops, replays, comm, device, reps)
    native = {s: per[(s, a)] for s, a in jobs if a == "native"}
    elem = torch.empty((), dtype=dtype).element_size()
    out = []
    for job in jobs:
        a, total = job[1], cases[job].total
        n_wrong = wrong[job]
        if n_wrong is not None:
            n_wrong = int(_slowest(comm, [float(n_wrong)], device)[0])
        med = statistics.median(per[job])
        algbw = total * elem / med / 1e9 if med > 0 else 0.0
        out.append(Record(op, a, str(dtype).removeprefix("torch."), total * elem, total, w,
                          comm.backend_for(device.type) or comm.backend, str(device), graph, med * 1e6,
                          min(per[job]) * 1e6, max(per[job]) * 1e6, algbw, algbw * busbw_factor(op, w), n_wrong,
                          chosen[job],
                          statistics.median(t / b for t, b in zip(per[job], native[job[0]], strict=True))
                          if job[0] in native else None, [t * 1e6 for t in per[job]]))
    return out


def prepare(op: str, algorithms: Iterable[str], comm: C.Communicator, dtype: torch.dtype, device: torch.device,
            say: Callable[[str], None] | None = None, skip_unsupported: bool = False) -> list[str]:
    """The algorithms to sweep: "all" expands to every registered one usable here, plus "auto";
    one that this group refuses (``Algorithm.unavailable``) is left out of "all", and ``say`` is
    told why, and raises when named.

    Anchors (``bench/anchors.py``) are swept where they can run; elsewhere ``say`` is told why.
    A registered algorithm that does not run ``op`` raises, or with ``skip_unsupported`` (a sweep
    over several ops) is left out and ``say`` is told.
    """
    usable = comm.algorithms(op, dtype, device.type)
    # Registered for this backend but refused by this group (peer memory on one GPU, a grid over
    # nodes of unequal size): asked on every rank, as the answer may take a collective to find.
    refused = {a: why for a in usable if (why := REGISTRY[a].unavailable(comm, op))}
    names: list[str] = []
    for a in algorithms:
        if a in refused:
            raise C.UnsupportedError("--algorithms", a, f"cannot run {op} here: {refused[a]}",
                                     f"use one of {[u for u in usable if u not in refused] + ['auto']}")
        if a == "all":
            for r, why in refused.items():
                if say is not None:
                    say(f"# {r} not measured for {op}: {why}")
            names += [u for u in usable if u not in refused] + ["auto"]
        elif a in A.ANCHORS:
            why = A.unavailable(a, op, dtype, device)
            if not why:
                names.append(a)
            elif say is not None:
                say(f"# {a} not measured: {why}")
        elif a == "auto" or a in usable:
            names.append(a)
        elif skip_unsupported and a in REGISTRY:
            if say is not None:
                say(f"# {a} not measured for {op}: it does not run {op} on {dtype} here")
        else:
            raise C.UnsupportedError("--algorithms", a, f"does not run {op} on {dtype} here", f"use one of {usable + ['auto']}")
    return list(dict.fromkeys(names))


def sweep(comm: C.Communicator, op: str, algorithms: list[str], sizes: list[int], dtype: torch.dtype,
          device: torch.device, *, graph_modes: tuple[bool, ...] = (False,),
          progress: Callable[[int, int, str], None] | None = None, together_bytes: int = 1 << 20,
          **kw: object) -> list[Record]:
    """Measure every (size, graph mode) with the algorithms side by side (:func:`measure_side_by_side`),
    the sizes up to ``together_bytes`` all in the same rounds (their buffers are small), each larger
    size in rounds of its own; returns the records in (size, graph mode, algorithm) order."""
    small = [s for s in sizes if s <= together_bytes]
    batches = ([small] if small else []) + [[s] for s in sizes if s > together_bytes]
    jobs = [(b, g) for b in batches for g in graph_modes]
    got: dict[tuple[int, bool], list[Record]] = {}
    m = len(algorithms)
    for i, (batch, g) in enumerate(jobs):
        if progress is not None:
            what = f"{batch[0]} B" if len(batch) == 1 else f"{batch[0]}-{batch[-1]} B"
            progress(i, len(jobs), f"{op}{' graph' if g else ''} {what}")
        recs = measure_side_by_side(comm, op, algorithms, batch, dtype, device, graph=g, **kw)  # type: ignore[arg-type]
        for j, s in enumerate(batch):  # records come in (size, algorithm) order
            got[(s, g)] = recs[j * m:(j + 1) * m]
    if progress is not None:
        progress(len(jobs), len(jobs), "done")
    return [rec for s in sizes for g in graph_modes for rec in got[(s, g)]]

