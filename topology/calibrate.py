"""Calibration: measure each tier's alpha and beta (and gamma) and fit a :class:`~topology.cost.Machine`.

Collective over the group (run it on every rank, e.g. ``torchrun ... launch/calibrate.py``):

* **intra**: every node's ranks pair up (local ``2i``, ``2i+1``) and send one way (``2i -> 2i+1``),
  then both ways at once over one connection ("exchange"), all pairs at once, so the fit includes
  the contention of a busy node;
* **inter**: local rank 0 of node 0 sends to local rank 0 of node 1 while the others wait (one
  flow), then both exchange; **uplink**: every local rank of node 0 sends to its peer on node 1
  at once (then both ways), which gives the node's capacity as a whole, and its ratio to one
  flow's the number of flows that run at full speed (``nics_per_node``);
* **gamma**: a local ``add_`` over the message;
* **step**: our ring all-reduce at the smallest sizes, minus what the links explain, per round:
  the host time our point-to-point executor adds to every step;
* **native all-to-all** (optional): the backend's all-to-all with equal splits, fitted as one line
  for this group's topology (Gloo posts every send before its receives, and over TCP that
  halves the rate of some exchanges at random, which no link cost describes);
* **native** (optional): the backend's all-reduce over the whole group, fitted with the ring formula
  ``2(p-1) a + 2(p-1)/p n b`` into the backend's own link cost (NCCL runs a fused kernel whose
  per-step cost differs from our point-to-point steps');
* **anchors** (optional, ``anchor_bytes``): every usable algorithm of every op with a choice, one
  small call timed through the bench harness in loops of ``anchor_loop_s``: the algorithm's whole
  fixed cost on this group (``Machine.anchors``). On a few CPU cores the small-message time of a
  Gloo collective is set by how often the ranks' threads get scheduled, milliseconds that differ
  by algorithm (one C++ call against several Python-driven steps) and no link latency describes.

Each point is the median of several timed exchanges (the slowest rank's time). Measuring and
fitting are separate (:func:`measure`, :func:`fit_machine`): a calibration file keeps the measured
points, and ``python -m topology.calibrate FILE`` fits them again.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .cost import GLOO_NATIVE, NCCL_NATIVE, LinkCost, Links, Machine, flat_plan, price
from .model import Topology

__all__ = ["fit", "measure", "measure_anchors", "fit_machine", "calibrate", "refit", "exchange_times"]


def fit(sizes: Sequence[float], times: Sequence[float]) -> LinkCost:
    """Hockney's fit: ``beta`` from the large messages, ``alpha`` from the small ones.

    ``beta`` is the least-squares slope over the sizes within 16x of the largest (the bandwidth
    regime); ``alpha`` the median of ``t - beta * n`` over the sizes within 4x of the smallest.
    One straight line through every size was tried first (least relative error): it bent the
    slope towards the latency-bound sizes and under-predicted NCCL's large-message bandwidth
    by 13% on 2xH200, enough for ``auto`` to pick a 15% slower algorithm at 512 MB.
    """
    x = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    big = x >= x.max() / 16
    if big.sum() < 2:
        big = x >= np.sort(x)[-2]
    beta = float(np.polyfit(x[big], t[big], 1)[0]) if big.sum() >= 2 and np.ptp(x[big]) > 0 else float(t[-1] / x[-1])
    beta = max(beta, 0.0)
    small = x <= x.min() * 4
    alpha = max(0.0, float(np.median(t[small] - beta * x[small])))
    return LinkCost(alpha, beta)


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
    import collectives as C

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
    import collectives as C

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
    import collectives as C

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


def fit_machine(name: str, raw: dict[str, Any], backend: str, meta: dict[str, Any]) -> Machine:
    """The machine the measurements in ``raw`` describe (pure: refit a calibration file any time)."""
    sizes = raw["sizes"]
    nodes = raw["nodes"]
    p = sum(len(n) for n in nodes)

    def link(key: str, per: int = 1) -> LinkCost | None:
        return fit([per * s for s in sizes], raw[key]) if key in raw else None

    intra, intra_x = link("intra"), link("intra_exchange")
    inter, inter_x = link("inter"), link("inter_exchange")
    g = raw.get("uplink_flows", 1)
    uplink, uplink_x = link("uplink", g), link("uplink_exchange", g)
    nics = int(min(g, max(1, round(inter.beta / uplink.beta)))) if inter and uplink and uplink.beta else 1
    native_intra = native_inter = None
    if "native_all_reduce" in raw:
        ring = fit([2 * (p - 1) / p * s for s in sizes], raw["native_all_reduce"])
        native = LinkCost(ring.alpha / (2 * (p - 1)), ring.beta)
        native_intra, native_inter = (native, None) if len(nodes) == 1 else (None, native)
    table = NCCL_NATIVE if backend == "nccl" else GLOO_NATIVE
    a2a = fit(sizes, raw["native_all_to_all"]) if "native_all_to_all" in raw else None
    machine = Machine(name, intra or inter or LinkCost(0.0, 0.0), inter, nics, raw["gamma_s_per_byte"], dict(table),
                      native_intra, native_inter, intra_x, inter_x, uplink, uplink_x, 0.0, a2a, meta)
    # What our ring all-reduce took beyond what the links explain, per round: the executor's host
    # time. The measured call is collectives' "ring", which runs the ring pattern step by step.
    rounds = 2 * (p - 1)
    ring_plan = flat_plan("ring", "all_reduce", nodes, Links.EXECUTOR)
    extra = [(t - float(price(ring_plan, "all_reduce", nodes, machine, [n])[0])) / rounds
             for t, n in zip(raw["ring_all_reduce"], raw["ring_sizes"])]
    return dataclasses.replace(machine, step=max(0.0, statistics.median(extra)), anchors=raw.get("anchors", {}),
                               anchor_bytes=raw.get("anchor_bytes", 0))


def calibrate(name: str, topo: Topology, sizes: Sequence[int], device: torch.device, *, iters: int = 5,
              reps: int = 3, backend: str = "gloo", native: bool = False, native_a2a: bool = False,
              anchor_bytes: int = 0, anchor_loop_s: float = 2.0, group: Any = None,
              log: Any = None) -> tuple[Machine, dict[str, Any]]:
    """Measure and fit; returns the machine and the raw points (for the calibration file)."""
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


def refit(path: str) -> Machine:
    """Fit a calibration file's stored points again (after a change to the fit) and rewrite it."""
    import json
    from pathlib import Path

    data = json.loads(Path(path).read_text())
    old = Machine.from_dict(data["machine"])
    new = fit_machine(old.name, data["points"], old.meta.get("backend", "gloo"), old.meta)
    data["machine"] = new.to_dict()
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return new


def device_label(device: Any) -> str:
    """What a calibration is keyed by: the GPU's name, or ``cpu:<cores>`` (Gloo's speed on a host
    follows its core count more than anything else we can name)."""
    if device is not None and getattr(device, "type", None) == "cuda":
        return torch.cuda.get_device_name(device)
    import os

    return f"cpu:{os.cpu_count()}"


if __name__ == "__main__":
    import sys

    for f in sys.argv[1:]:
        print(f, refit(f))
