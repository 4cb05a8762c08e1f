"""Calibration's fit: the :class:`~topology.cost.Machine` that measured points describe.

Measuring is collective and runs our collectives, so it lives a layer up (``bench/calibrate.py``,
run by ``launch/calibrate.py``); what it returns is plain lists of seconds per size, kept in the
calibration file's ``points``. This module only fits them, with no communication:

* **intra**, **inter** and their **exchange** variants: one link cost each (:func:`fit`);
* **uplink**: the node's capacity as a whole, and its ratio to one flow's the number of flows that
  run at full speed (``nics_per_node``);
* **gamma**: seconds per byte of the local ``add_``;
* **step**: our ring all-reduce at the smallest sizes, minus what the links explain, per round:
  the host time our point-to-point executor adds to every step;
* **native** (when measured): the backend's all-reduce over the whole group fitted with the ring
  formula ``2(p-1) a + 2(p-1)/p n b`` into the backend's own link cost (NCCL runs a fused kernel
  whose per-step cost differs from our point-to-point steps');
* **native all-to-all** (when measured): one line for this group's topology;
* **anchors** (when measured): kept as measured (``Machine.anchors``).

Measuring and fitting are separate so that a change to the fit can be applied to old points:
``python -m topology.calibrate FILE`` fits a calibration file again (:func:`refit`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .cost import GLOO_NATIVE, NCCL_NATIVE, LinkCost, Links, Machine, flat_plan, price

__all__ = ["fit", "fit_machine", "refit", "device_label"]


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


def fit_machine(name: str, raw: dict[str, Any], backend: str, meta: dict[str, Any]) -> Machine:
    """The machine the measurements in ``raw`` describe (pure: refit a calibration file any time).

    Args:
        name: the machine's label.
        raw: the measured points (``bench.calibrate.measure``; a calibration file's ``points``).
        backend: the backend measured ("gloo", "nccl", ...): which patterns its collectives run.
        meta: where and how it was measured (``Machine.meta``).
    """
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


def refit(path: str) -> Machine:
    """Fit a calibration file's stored points again (after a change to the fit) and rewrite it."""
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
    return f"cpu:{os.cpu_count()}"


if __name__ == "__main__":
    for f in sys.argv[1:]:
        print(f, refit(f))
