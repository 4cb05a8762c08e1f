"""Timing ``fused_all_reduce_rmsnorm`` against the three separate steps it replaces.

Per (rows, hidden), in the same rounds (``bench.harness.time_interleaved``, paired by round):

- ``fused``: ``fused_all_reduce_rmsnorm(..., strategy="fused")``, one kernel;
- ``three``: our ``collectives.all_reduce`` (``auto``) in place, torch's add, torch's
  ``rms_norm``: the steps a decoder layer runs without the fusion (the anchor);
- ``nccl_three``: the same with ``torch.distributed.all_reduce`` (NCCL on GPUs);
- ``sequential``: the operator's own fallback (a copy of ``x``, then the three steps).

Each variant's output is first checked against float64 on fresh random data (``wrong``: elements
outside the dtype's bound, ``tests/gpu_norm_check.py``'s). ``ratio`` is the median over rounds of
fused's time over three's in the same round; ``ratio_nccl`` over nccl_three's. At one rank the
all-reduces do nothing and the comparison is the add and the norm against one kernel. Eagerly
and (``graph``) replaying each variant's loop from one CUDA graph.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import collectives as C
from overlap.norm import fused_all_reduce_rmsnorm
from overlap.ops import last_choice

from .harness import paired_ratio, time_interleaved

__all__ = ["NormRecord", "measure_norm", "format_norm_table", "plot_norm"]

EPS = 1e-6
_TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


@dataclass
class NormRecord:
    rows: int
    hidden: int
    world: int
    dtype: str
    device: str
    graph: bool
    fused_ran: str     # what the "fused" variant ran (the kernel, or auto's fallback where it cannot)
    fused_reason: str
    fused_us: float
    three_us: float
    nccl_three_us: float
    sequential_us: float
    ratio: float       # fused / three, paired by round
    ratio_nccl: float  # fused / nccl_three, paired by round
    wrong: int         # elements outside the bound, over every variant's check

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _variants(comm: C.Communicator, x: torch.Tensor, res: torch.Tensor, w: torch.Tensor,
              fused: str) -> dict[str, Any]:
    group, hidden = comm.group, x.shape[-1]

    def three(native: bool) -> Any:
        scratch = x.clone()

        def run() -> Any:
            if comm.size > 1:  # in place on a scratch copy: the values grow, the time does not
                (dist.all_reduce if native else C.all_reduce)(scratch, group=group)
            r = scratch + res
            return torch.nn.functional.rms_norm(r, (hidden,), w, EPS), r
        return run

    return {"fused": lambda: fused_all_reduce_rmsnorm(x, res, w, EPS, group, strategy=fused),
            "three": three(False), "nccl_three": three(True),
            "sequential": lambda: fused_all_reduce_rmsnorm(x, res, w, EPS, group, strategy="sequential")}


def _wrong(comm: C.Communicator, rows: int, hidden: int, dtype: torch.dtype, device: torch.device, seed: int,
           fused: str) -> int:
    """Elements outside the bound, of every variant, on fresh data (every rank's x regenerated)."""
    gens = [torch.Generator(device=device).manual_seed(seed * 97 + q) for q in range(comm.size + 1)]
    xs = [torch.randn(rows, hidden, generator=g, device=device, dtype=torch.float64).to(dtype) for g in gens[:-1]]
    res = torch.randn(rows, hidden, generator=gens[-1], device=device, dtype=torch.float64).to(dtype)
    w = (0.5 + torch.rand(hidden, generator=gens[-1], device=device, dtype=torch.float64)).to(dtype)
    r64 = torch.stack([x.double() for x in xs]).sum(0) + res.double()
    y64 = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + EPS) * w.double()
    bad = 0
    for fn in _variants(comm, xs[comm.rank].clone(), res, w, fused).values():
        y, r = fn()
        for got, want in ((y, y64), (r, r64)):
            scale = float(want.abs().max().clamp(min=1))
            bad += int(((got.double() - want).abs() > _TOL[dtype] * scale).sum()) + int(got.isnan().sum())
    return bad


def measure_norm(comm: C.Communicator, rows: int, hidden: int, dtype: torch.dtype, device: torch.device, *,
                 graph: bool = False, iters: int = 20, reps: int = 15) -> NormRecord:
    g = torch.Generator(device=device).manual_seed(comm.rank)
    x, res = (torch.randn(rows, hidden, generator=g, device=device, dtype=dtype) for _ in range(2))
    w = 0.5 + torch.rand(hidden, generator=g, device=device, dtype=dtype)
    try:  # where the kernel cannot run (a CPU smoke run), "auto", and the record says what ran instead
        fused_all_reduce_rmsnorm(x, res, w, EPS, comm.group, strategy="fused")
        fused = "fused"
    except C.UnsupportedError:
        fused = "auto"
    fused_all_reduce_rmsnorm(x, res, w, EPS, comm.group, strategy=fused)
    ran = last_choice(comm.group)
    assert ran is not None
    wrong = _wrong(comm, rows, hidden, dtype, device, rows * 31 + hidden, fused)
    rounds: dict[str, list[float]] = {}
    t = time_interleaved(_variants(comm, x, res, w, fused), comm, device, iters, reps, graph=graph, rounds=rounds,
                         min_loop_s=0.0 if graph else 2e-3)
    return NormRecord(rows, hidden, comm.size, str(dtype).removeprefix("torch."), device.type, graph, ran.strategy,
                      ran.reason, t["fused"], t["three"], t["nccl_three"], t["sequential"],
                      paired_ratio(rounds, "fused", "three"), paired_ratio(rounds, "fused", "nccl_three"), wrong)


def format_norm_table(records: list[NormRecord]) -> str:
    lines = [f"{'rows':>5} {'hidden':>6} {'mode':>5} {'fused us':>9} {'three us':>9} {'nccl3 us':>9} {'seq us':>8} "
             f"{'fused/three':>11} {'fused/nccl3':>11} {'wrong':>5}"]
    for r in records:
        lines.append(f"{r.rows:>5} {r.hidden:>6} {'graph' if r.graph else 'eager':>5} {r.fused_us:>9.2f} "
                     f"{r.three_us:>9.2f} {r.nccl_three_us:>9.2f} {r.sequential_us:>8.2f} {r.ratio:>11.3f} "
                     f"{r.ratio_nccl:>11.3f} {r.wrong:>5}")
    return "\n".join(lines)


def plot_norm(records: list[NormRecord], path: str, title: str = "") -> None:
    """PNG: fused / three (paired) per row count, a line per (hidden, mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for hidden in sorted({r.hidden for r in records}):
        for graph in (False, True):
            rs = sorted((r for r in records if r.hidden == hidden and r.graph == graph), key=lambda r: r.rows)
            if rs:
                ax.plot([r.rows for r in rs], [r.ratio for r in rs], marker="o",
                        label=f"hidden {hidden}, {'graph' if graph else 'eager'}")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (tokens)")
    ax.set_ylabel("fused / (all-reduce + add + rms_norm)")
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
