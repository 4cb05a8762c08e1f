"""Calibration's measurements: each tier's latency and bandwidth, timed on this group.

Collective over the group (run it on every rank, e.g. ``torchrun ... launch/calibrate.py``);
:func:`calibrate` measures, then fits with ``topology.calibrate.fit_machine``:

* **intra**: every node's ranks pair up (local ``2i``, ``2i+1``) and send one way (``2i -> 2i+1``),
  then both ways at once over one connection ("exchange"), all pairs at once, so the fit includes
  the contention of a busy node;
* **inter**: local rank 0 of node 0 sends to local rank 0 of node 1 while the others wait (one
  flow), then both exchange; **uplink**: every local rank of node 0 sends to its peer on node 1
  at once (then both ways), which gives the node's capacity as a whole, and its ratio to one
  flow's the number of flows that run at full speed (``nics_per_node``);
* **gamma**: a local ``add_`` over the message;
* **step**: our ring all-reduce (``algorithm="ring"``) at the smallest sizes, which the fit
  compares with what the links explain;
* **native all-to-all** (optional): the backend's all-to-all with equal splits, fitted as one line
  for this group's topology (Gloo posts every send before its receives, and over TCP that
  halves the rate of some exchanges at random, which no link cost describes);
* **native** (optional): the backend's all-reduce over the whole group, which the fit turns into
  the backend's own link cost;
* **anchors** (optional, ``anchor_bytes``): every usable algorithm of every op with a choice, one
  small call timed in loops of ``anchor_loop_s``: the algorithm's whole fixed cost on this group
  (``Machine.anchors``). On a few CPU cores the small-message time of a Gloo collective is set by
  how often the ranks' threads get scheduled, milliseconds that differ by algorithm (one C++ call
  against several Python-driven steps) and no link latency describes.

Each point is the median of several timed exchanges (the slowest rank's time). The points are
plain lists of seconds per size (:func:`measure`), kept in the calibration file so that the fit
(pure, in ``topology/calibrate.py``) can be run again on them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import collectives as C
from topology.calibrate import device_label, fit_machine
from topology.cost import Machine
from topology.model import Topology

__all__ = ["measure", "measure_anchors", "calibrate", "exchange_times", "ANCHOR_OPS"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _slowest(value: float, device: torch.device, group: Any) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, dist.ReduceOp.MAX, group=group)
    return float(t.item())


def exchange_times(pairs: dict[int, int], sizes: Sequence[int], device: torch.device, *, iters: int, reps: int,
                   group: Any = None, global_ranks: Sequence[int] | None = None) -> list[float]:
    """Median seconds for every flow in ``pairs`` (sender -> receiver, group ranks) to move ``size`` bytes, all at once.

    A pair listed both ways (``{a: b, b: a}``) is an exchange over one connection.
    """
    rank = dist.get_rank(group)
    glob = list(global_ranks) if global_ranks is not None else list(range(dist.get_world_size(group)))
    to = pairs.get(rank)
    frm = next((s for s, d in pairs.items() if d == rank), None)
    out = []
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        send = torch.randn(n, device=device)
        recv = torch.empty(n, device=device)

        ops = []  # receive first, as the executor does (collectives/algos/_executor.py)
        if frm is not None:
            ops.append(dist.P2POp(dist.irecv, recv, glob[frm], group))
        if to is not None:
            ops.append(dist.P2POp(dist.isend, send, glob[to], group))

        def once() -> None:
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

        out.append(_timed(once, device, iters, reps, group))
    return out


def _reduce_time(nbytes: int, device: torch.device, iters: int) -> float:
    n = max(1, nbytes // 4)
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    x.add_(y)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        x.add_(y)
    _sync(device)
    return (time.perf_counter() - t0) / iters


def _timed(fn: Any, device: torch.device, iters: int, reps: int, group: Any, min_loop_s: float = 0.0) -> float:
    """Median over ``reps`` loops of ``iters`` calls of the slowest rank's seconds per call (after one untimed call).

    ``min_loop_s`` > 0 raises ``iters`` (the same on every rank) until a loop lasts about that long.
    """
    fn()
    if min_loop_s > 0:
        _sync(device)
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        iters = max(iters, min(100_000, int(min_loop_s / max(_slowest(time.perf_counter() - t0, device, group), 1e-7))))
    samples = []
    for _ in range(reps):
        dist.barrier(group)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        samples.append(_slowest((time.perf_counter() - t0) / iters, device, group))
    return statistics.median(samples)


ANCHOR_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def _anchor_call(op: str, algorithm: str, nbytes: int, device: torch.device, group: Any) -> Any:
    """A no-argument call of ``op`` with ``algorithm`` on about ``nbytes`` (the nccl-tests size) of fresh data."""
    w = dist.get_world_size(group)
    n = max(w, nbytes // 4 // w * w)
    x = torch.randn(n, device=device)
    if op == "all_reduce":
        return lambda: C.all_reduce(x, group=group, algorithm=algorithm)
    if op == "reduce_scatter":
        out = torch.empty(n // w, device=device)
        return lambda: C.reduce_scatter_single(out, x, group=group, algorithm=algorithm)
    if op == "all_gather":
        part, out = x[: n // w].clone(), torch.empty(n, device=device)
        return lambda: C.all_gather_single(out, part, group=group, algorithm=algorithm)
    out = torch.empty(n, device=device)
    return lambda: C.all_to_all_single(out, x, group=group, algorithm=algorithm)


def measure_anchors(nbytes: int, device: torch.device, *, loop_s: float, reps: int, group: Any = None,
                    log: Any = None) -> dict[str, dict[str, float]]:
    """op -> algorithm -> median seconds of one ``nbytes`` call (every usable algorithm, native included)."""
    comm = C.get_communicator(group)
    out: dict[str, dict[str, float]] = {}
    for op in ANCHOR_OPS:
        out[op] = {a: _timed(_anchor_call(op, a, nbytes, device, group), device, 5, reps, group, min_loop_s=loop_s)
                   for a in comm.algorithms(op, torch.float32, device.type)}
        if log:
            log(f"anchor {op} {nbytes} B: " + ", ".join(f"{a} {t * 1e6:.0f}" for a, t in out[op].items()) + " us")
    return out


def measure(topo: Topology, sizes: Sequence[int], device: torch.device, *, iters: int = 5, reps: int = 3,
            native: bool = False, native_a2a: bool = False, anchor_bytes: int = 0, anchor_loop_s: float = 2.0,
            group: Any = None, log: Any = None) -> dict[str, Any]:
    """Every measurement the fit needs, as plain lists of seconds per size (collective)."""
    say = log or (lambda *_: None)
    nodes = topo.nodes()
    raw: dict[str, Any] = {"sizes": list(sizes), "nodes": nodes}
    one_way: dict[int, int] = {}
    for members in nodes:
        for i in range(0, len(members) - 1, 2):
            one_way[members[i]] = members[i + 1]

    def pairs(key: str, flows: dict[int, int]) -> None:
        raw[key] = exchange_times(flows, sizes, device, iters=iters, reps=reps, group=group)
        say(f"{key}: " + ", ".join(f"{t * 1e6:.0f}" for t in raw[key]) + " us")

    if one_way:
        pairs("intra", one_way)
        pairs("intra_exchange", one_way | {b: a for a, b in one_way.items()})
    if len(nodes) > 1:
        a, b = nodes[0], nodes[1]
        pairs("inter", {a[0]: b[0]})
        pairs("inter_exchange", {a[0]: b[0], b[0]: a[0]})
        g = min(len(a), len(b))
        if g > 1:
            pairs("uplink", {a[i]: b[i] for i in range(g)})
            pairs("uplink_exchange", {a[i]: b[i] for i in range(g)} | {b[i]: a[i] for i in range(g)})
            raw["uplink_flows"] = g
    raw["gamma_s_per_byte"] = statistics.median(_reduce_time(sizes[-1], device, iters) for _ in range(reps)) / sizes[-1]
    small = list(sizes[:3])
    raw["ring_sizes"] = small
    raw["ring_all_reduce"] = []
    for nbytes in small:
        x = torch.randn(max(1, nbytes // 4), device=device)
        raw["ring_all_reduce"].append(_timed(lambda: C.all_reduce(x, group=group, algorithm="ring"), device, iters,
                                             reps, group))
    if native:
        times = []
        for nbytes in sizes:
            x = torch.randn(max(1, nbytes // 4), device=device)
            times.append(_timed(lambda: dist.all_reduce(x, group=group), device, iters, reps, group))
        raw["native_all_reduce"] = times
        say("native all-reduce: " + ", ".join(f"{t * 1e6:.0f}" for t in times) + " us")
    if native_a2a:
        times = []
        for nbytes in sizes:
            n = max(topo.world, nbytes // 4 // topo.world * topo.world)
            x, y = torch.randn(n, device=device), torch.empty(n, device=device)
            times.append(_timed(lambda: dist.all_to_all_single(y, x, group=group), device, iters, reps, group))
        raw["native_all_to_all"] = times
        say("native all-to-all: " + ", ".join(f"{t * 1e6:.0f}" for t in times) + " us")
    if anchor_bytes > 0:
        raw["anchor_bytes"] = anchor_bytes
        raw["anchors"] = measure_anchors(anchor_bytes, device, loop_s=anchor_loop_s, reps=reps, group=group, log=say)
    return raw


def calibrate(name: str, topo: Topology, sizes: Sequence[int], device: torch.device, *, iters: int = 5,
              reps: int = 3, backend: str = "gloo", native: bool = False, native_a2a: bool = False,
              anchor_bytes: int = 0, anchor_loop_s: float = 2.0, group: Any = None,
              log: Any = None) -> tuple[Machine, dict[str, Any]]:
    """Measure (collective) and fit (``topology.calibrate.fit_machine``); returns the machine and
    the raw points (for the calibration file)."""
    raw = measure(topo, sizes, device, iters=iters, reps=reps, native=native, native_a2a=native_a2a,
                  anchor_bytes=anchor_bytes, anchor_loop_s=anchor_loop_s, group=group, log=log)
    nodes = topo.nodes()
    meta = {"backend": backend, "device": device_label(device), "nodes": len(nodes),
            "ranks_per_node": [len(n) for n in nodes], "world": topo.world, "dtype": "float32",
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}
    machine = fit_machine(name, raw, backend, meta)
    if log:
        for key in ("intra", "intra_exchange", "inter", "inter_exchange", "uplink", "uplink_exchange",
                    "native_intra", "native_inter"):
            lc = getattr(machine, key)
            if lc is not None:
                log(f"fit {key}: alpha {lc.alpha * 1e6:.1f} us, {lc.bandwidth_GBps:.3f} GB/s")
        log(f"fit point-to-point executor: {machine.step * 1e6:.1f} us per round; {machine.nics_per_node} "
            f"full-speed inter-node flow(s) per node")
    return machine, raw
