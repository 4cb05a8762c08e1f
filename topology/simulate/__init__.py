"""Predict collectives at scale: ``python -m topology.simulate [--preset NAME | --machine FILE] ...``.

For each GPU count (8 to 4096 by default), collective and message size, the cost model
(``topology/cost.py``) predicts the time and bus bandwidth of every algorithm it is handed on
``gpus / per_node`` nodes laid out as torchrun does (node-major ranks), and names what
``algorithm="auto"`` would pick (the least predicted time). The algorithms are an argument
(:func:`simulate`), anything with ``cost()`` and ``supports()``; the command line
(``topology/simulate/__main__.py``, a program) passes ``collectives``' registry. A table goes to
stdout; ``--json`` and ``--plot`` write the numbers and a busbw-vs-GPUs plot.

Presets are named hardware, with link figures from vendor data sheets (per GPU and direction):

* ``hgx-h100-ndr400``: 8 H100 SXM per node on NVLink 4 (900 GB/s bidirectional per GPU, taken as
  370 GB/s of achievable bus bandwidth, NCCL's measured all-reduce busbw on such nodes) and one
  ConnectX-7 NDR 400 Gb/s NIC per GPU (rail-optimised: 50 GB/s, 8 NICs per node).
* ``pcie-roce200``: 8 GPUs per node on PCIe Gen4 x16 (~24 GB/s achievable) with two 200 Gb/s RoCE NICs.
* ``pcie-roce100``: the same with one 100 Gb/s RoCE NIC per node.
* ``h200x2-measured``, ``emu-2x2-measured``: our calibrations (``topology/calibrations/``), extended
  to more nodes of the same shape.

Limits, read before trusting a row: ``native`` is priced as the pattern in ``Machine.native``
(NCCL: ring), so at hundreds of nodes it pays 2(p-1) latencies where NCCL would switch to its tree
or PAT algorithms: native is pessimistic there. An all-to-all round is charged one latency however
many messages a rank posts, so ``native``/``hierarchical`` all-to-all at thousands of ranks are
optimistic for small messages. Only the 2-node configurations were ever checked against
measurements (``bench/results/model_vs_measured.md``).

Latencies are typical published orders (NCCL's per-step latency on NVLink of a few microseconds,
RDMA round trips of about 10 us); they matter for small messages only. A user machine is a JSON
file of :class:`topology.cost.Machine` fields (``--machine``), e.g. a calibration file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from ..cost import NCCL_NATIVE, CostPlan, LinkCost, Machine, price

__all__ = ["PRESETS", "OPS", "Simulated", "simulate", "machine_named", "format_rows", "plot", "parse_size",
           "preset_names"]

CALIBRATIONS = Path(__file__).resolve().parent.parent / "calibrations"

# Host time our point-to-point executor adds per round on a GPU host, as fitted on 2xH200
# (topology/calibrations/h200x2_nccl.json, 2026-11-30); the backend's own collectives do not pay it.
GPU_STEP_S = 47e-6

# (machine, ranks per node)
PRESETS: dict[str, tuple[Machine, int]] = {
    "hgx-h100-ndr400": (Machine("hgx-h100-ndr400", LinkCost(5e-6, 1 / 370e9), LinkCost(10e-6, 1 / 50e9), 8, 1 / 2000e9,
                                dict(NCCL_NATIVE), step=GPU_STEP_S), 8),
    "pcie-roce200": (Machine("pcie-roce200", LinkCost(8e-6, 1 / 24e9), LinkCost(12e-6, 1 / 25e9), 2, 1 / 1000e9,
                             dict(NCCL_NATIVE), step=GPU_STEP_S), 8),
    "pcie-roce100": (Machine("pcie-roce100", LinkCost(8e-6, 1 / 24e9), LinkCost(12e-6, 1 / 12.5e9), 1, 1 / 1000e9,
                             dict(NCCL_NATIVE), step=GPU_STEP_S), 8),
}
_MEASURED = {"h200x2-measured": ("h200x2_nccl.json", 2), "emu-2x2-measured": ("emu_2x2_400mbit.json", 2)}

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
# Algorithms that need equal all-to-all splits (Bruck) are left out above this many ranks.
EQUAL_SPLITS_MAX_RANKS = 512


class Simulated(Protocol):
    """What the simulator needs of an algorithm (``collectives.algos.Algorithm`` fills it)."""

    @property
    def equal_splits_only(self) -> bool:
        """Whether its all-to-all needs equal splits."""
        ...

    def supports(self, op: str) -> bool:
        """Whether it runs ``op``."""
        ...

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """Its plan for ``op`` on ``nodes`` (``topology.cost.Priced``), or None: not priced."""
        ...


def preset_names() -> list[str]:
    """Every name :func:`machine_named` knows."""
    return sorted(PRESETS) + sorted(_MEASURED)


def machine_named(name: str) -> tuple[Machine, int]:
    """The preset or shipped calibration ``name`` and its ranks per node.

    Raises:
        SystemExit: an unknown name, or a shipped calibration file that is missing.
    """
    if name in PRESETS:
        return PRESETS[name]
    if name in _MEASURED:
        file, per_node = _MEASURED[name]
        path = CALIBRATIONS / file
        if not path.exists():
            raise SystemExit(f"--preset {name}: calibration {path} is missing")
        return Machine.load(path), per_node
    raise SystemExit(f"--preset {name!r} is not known; use one of {preset_names()} or --machine FILE")


def _busbw_factor(op: str, p: int) -> float:
    if op == "all_reduce":
        return 2 * (p - 1) / p
    return (p - 1) / p


def simulate(machine: Machine, per_node: int, gpus: list[int], ops: list[str], sizes: list[int],
             algorithms: Mapping[str, Simulated]) -> list[dict[str, Any]]:
    """One row per (gpus, op, algorithm, size): predicted seconds, busbw GB/s, and whether auto picks it.

    Args:
        machine: the link costs.
        per_node: ranks per node.
        gpus: world sizes to predict.
        ops: op names (see :data:`OPS`).
        sizes: message sizes in bytes (nccl-tests' sizes).
        algorithms: name -> algorithm; those that run the op and price it (``cost()`` returns a
            plan) are predicted, in this order (ties go to the first).
    """
    rows = []
    for p in gpus:
        g = min(per_node, p)
        nodes = [list(range(k * g, min((k + 1) * g, p))) for k in range((p + g - 1) // g)]
        for op in ops:
            plans = {}
            for a, algo in algorithms.items():
                if not algo.supports(op) or (algo.equal_splits_only and p > EQUAL_SPLITS_MAX_RANKS):
                    continue
                plan = algo.cost(op, nodes, machine)
                if plan is not None:
                    plans[a] = plan
            names = list(plans)
            table = {a: price(plan, op, nodes, machine, sizes, anchor=a) for a, plan in plans.items()}
            for i, size in enumerate(sizes):
                best = min(names, key=lambda a: table[a][i])
                for a in names:
                    t = float(table[a][i])
                    rows.append({"gpus": p, "nodes": len(nodes), "op": op, "algorithm": a, "bytes": size,
                                 "time_us": t * 1e6, "busbw_GBps": size / t * _busbw_factor(op, p) / 1e9 if t else 0.0,
                                 "auto": a == best})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`simulate` as a table: one line per (gpus, op, size), a column per algorithm."""
    out = []
    keyed: dict[tuple[int, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        keyed.setdefault((r["gpus"], r["op"], r["bytes"]), []).append(r)
    algos = sorted({r["algorithm"] for r in rows}, key=lambda a: (a != "native", a))
    out.append(f"{'gpus':>5} {'nodes':>5} {'op':<15} {'size':>8}  " + "".join(f"{a[:12]:>13}" for a in algos)
               + "   auto (busbw GB/s)")
    for (p, op, size), rs in keyed.items():
        by = {r["algorithm"]: r for r in rs}
        pick = next(r for r in rs if r["auto"])
        cells = "".join(f"{by[a]['time_us']:>11.0f}us" if a in by else f"{'-':>13}" for a in algos)
        out.append(f"{p:>5} {rs[0]['nodes']:>5} {op:<15} {_size(size):>8}  {cells}   {pick['algorithm']} ({pick['busbw_GBps']:.1f})")
    return "\n".join(out)


def _size(n: int) -> str:
    for unit, k in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k}{unit}"
    return str(n)


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536 (suffixes K, M, G: powers of 1024)."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in "KMG" else text) * mult)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Predicted busbw against GPUs at the largest size, one panel per op, to ``path``."""
    import matplotlib  # deferred: optional (commops[plot]) and slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred: as above, after choosing the headless backend

    ops = sorted({r["op"] for r in rows})
    size = max(r["bytes"] for r in rows)
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        sel = [r for r in rows if r["op"] == op and r["bytes"] == size]
        for a in sorted({r["algorithm"] for r in sel}):
            pts = sorted((r["gpus"], r["busbw_GBps"]) for r in sel if r["algorithm"] == a)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=a)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(f"predicted busbw at {_size(size)} (GB/s)")
        ax.set_title(op)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
