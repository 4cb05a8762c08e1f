"""One GPU's share of the MoE overlap: what the experts lose to transfers beside them, and what
reading the tokens where they landed saves, as functions that return records.

``measure_beside``: the experts (``GroupedSwiGLU`` without autograd, the forward a pipeline
overlaps) alone, and beside a stream of copies on a side stream: by copy engine (a device copy
and a copy to pinned host memory, ``Tensor.copy_`` of large buffers) and by an SM kernel held
to ``blocks`` thread blocks (a persistent Triton copy), each also with the experts' own grid
reduced by the same number of SMs (``_grouped_gemm.sm_carveout``): the budget a user sets.
Two spans per pairing, so that neither figure is diluted: ``slowdown`` is the experts' time
with the copies outlasting them over their time alone, and ``copy_slowdown`` the copies' time
with the experts outlasting them over the copies alone, both the median over rounds of the
per-round ratio (each round times alone and beside, alternating which goes first).

``measure_gather``: the gate/up product and activation of rows that stay where they landed.
``grouped_swiglu_segments(..., index=)`` reads each row through a table (the layout a dispatch
that does not materialise ``recv_x`` leaves), against ``index_select`` into a grouped copy then
torch's grouped GEMMs (``torch._grouped_mm`` twice, SiLU, product: the anchor) and then our
kernel on the grouped copy; outputs checked against float64.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from overlap.moe import GroupedSwiGLU, _grouped_gemm

from .experts import uneven_counts

__all__ = ["BesideRecord", "GatherRecord", "measure_beside", "measure_gather", "plot_beside"]

COPY_BYTES = 256 << 20  # one copy of the side stream's loop
BLOCKS = (8, 16, 32)


@dataclass
class BesideRecord:
    config: str
    rows: int
    hidden: int
    ffn_hidden: int
    experts: int
    transfer: str          # "ce_device", "ce_host", "sm_<blocks>", "sm_<blocks>_carveout"
    experts_us: float      # the experts alone (this pairing's rounds)
    experts_beside_us: float
    slowdown: float        # paired: beside / alone (1.0: nothing lost)
    copy_GBps: float       # the copies alone (bytes read, counted once)
    copy_beside_GBps: float
    copy_slowdown: float   # paired: the copies' time beside the experts / alone

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class GatherRecord:
    config: str
    rows: int
    tokens: int
    hidden: int
    ffn_hidden: int
    experts: int
    gather_torch_us: float   # index_select + torch._grouped_mm (gate, up) + SiLU * up: the anchor
    gather_fused_us: float   # index_select + our fused gate/up kernel
    fused_index_us: float    # our fused gate/up kernel reading the rows through the table
    index_over_torch_paired: float
    index_over_gather_fused_paired: float
    wrong_index: int         # elements more than 2% of the largest off float64
    wrong_torch: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _copy_kernel() -> Any:
    import triton  # deferred: Triton is optional and compiles on first use
    import triton.language as tl

    @triton.jit
    def copy_rows(src, dst, n, BLOCK: tl.constexpr, GRID: tl.constexpr):  # noqa: ANN001, ANN202
        start = tl.program_id(0) * BLOCK
        for s in range(start, n, GRID * BLOCK):
            offs = s + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return copy_rows


_KERNEL: list[Any] = []


def _sm_copy(src: torch.Tensor, dst: torch.Tensor, blocks: int) -> None:
    """``dst.copy_(src)`` by ``blocks`` persistent thread blocks (int64 words)."""
    if not _KERNEL:
        _KERNEL.append(_copy_kernel())
    n = src.numel()
    _KERNEL[0][(blocks,)](src, dst, n, BLOCK=4096, GRID=blocks, num_warps=8)


def _span(fn: Callable[[], object], n: int, stream: torch.cuda.Stream) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """``n`` calls of ``fn`` on ``stream`` between two events (returned, not waited for)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        a.record()
        for _ in range(n):
            fn()
        b.record()
    return a, b


def _us(a: torch.cuda.Event, b: torch.cuda.Event, n: int) -> float:
    return a.elapsed_time(b) * 1e3 / n


def _pair(main: Callable[[], object], side: Callable[[], object], n_main: int, n_side: int
          ) -> tuple[float, float, float, float]:
    """(main alone, main beside side, side alone, side beside main), microseconds per call; the
    caller picks the counts so that the span it reads is the one covered."""
    s_main, s_side = torch.cuda.current_stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    alone_m = _span(main, n_main, s_main)
    torch.cuda.synchronize()
    alone_s = _span(side, n_side, s_side)
    torch.cuda.synchronize()
    bs = _span(side, n_side, s_side)  # issued first: the side's work is queued when main starts
    bm = _span(main, n_main, s_main)
    torch.cuda.synchronize()
    return _us(*alone_m, n_main), _us(*bm, n_main), _us(*alone_s, n_side), _us(*bs, n_side)


def measure_beside(name: str, rows: int, hidden: int, ffn_hidden: int, experts: int, device: torch.device, *,
                   reps: int = 7, seed: int = 0, blocks: tuple[int, ...] = BLOCKS) -> list[BesideRecord]:
    counts = uneven_counts(rows, experts, seed)
    torch.manual_seed(seed)
    m = GroupedSwiGLU(experts, hidden, ffn_hidden, dtype=torch.bfloat16, device=device)
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    ends = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=device)
    src = torch.randint(-2 ** 62, 2 ** 62, (COPY_BYTES // 8,), device=device)
    dst = torch.empty_like(src)
    host = torch.empty(COPY_BYTES // 8, dtype=torch.int64, pin_memory=True)
    transfers: dict[str, tuple[Callable[[], object], int | None]] = {
        "ce_device": (lambda: dst.copy_(src, non_blocking=True), None),
        "ce_host": (lambda: host.copy_(src, non_blocking=True), None)}
    for b in blocks:
        sm_copy = functools.partial(_sm_copy, src, dst, b)
        transfers[f"sm_{b}"] = (sm_copy, None)
        transfers[f"sm_{b}_carveout"] = (sm_copy, b)
    records = []
    with torch.no_grad():
        def run() -> object:
            return m(x, counts, ends=ends)

        for _ in range(3):
            run()
        for fn, _ in transfers.values():
            fn()
        torch.cuda.synchronize()
        t_exp = _pair(run, lambda: None, 10, 1)[0]
        for kind, (copy, carve) in transfers.items():
            t_copy = _pair(lambda: None, copy, 1, 3)[2]
            # the copies outlast 20 expert calls by half again; the experts outlast 3 copies likewise
            n_side = max(3, int(1.5 * 20 * t_exp / t_copy) + 1)
            n_main = max(20, int(1.5 * 3 * t_copy / t_exp) + 1)
            got: dict[str, list[float]] = {k: [] for k in ("alone", "beside", "c_alone", "c_beside")}
            with _grouped_gemm.sm_carveout(carve):
                for _ in range(reps):
                    a, b_, _, _ = _pair(run, copy, 20, n_side)
                    _, _, c, d = _pair(run, copy, n_main, 3)
                    got["alone"].append(a)
                    got["beside"].append(b_)
                    got["c_alone"].append(c)
                    got["c_beside"].append(d)
            med = {k: statistics.median(v) for k, v in got.items()}
            records.append(BesideRecord(
                name, rows, hidden, ffn_hidden, experts, kind, med["alone"], med["beside"],
                statistics.median(b / a for a, b in zip(got["alone"], got["beside"])),
                COPY_BYTES / med["c_alone"] / 1e3, COPY_BYTES / med["c_beside"] / 1e3,
                statistics.median(d / c for c, d in zip(got["c_alone"], got["c_beside"]))))
    return records


def measure_gather(name: str, rows: int, hidden: int, ffn_hidden: int, experts: int, device: torch.device, *,
                   tokens: int, iters: int = 10, reps: int = 9, seed: int = 0) -> GatherRecord:
    """``rows`` (token, expert) pairs of ``tokens`` tokens grouped by expert, each row a read of
    its token through an int32 table."""
    counts = uneven_counts(rows, experts, seed)
    torch.manual_seed(seed)
    m = GroupedSwiGLU(experts, hidden, ffn_hidden, dtype=torch.bfloat16, device=device)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    index = torch.randint(tokens, (rows,), device=device, dtype=torch.int32)
    ends = torch.tensor(np.cumsum(counts), dtype=torch.int32, device=device)
    starts = (ends - torch.tensor(counts, dtype=torch.int32, device=device)).contiguous()
    cnt = torch.tensor(counts, dtype=torch.int32, device=device)
    w1, w3 = m.w1.detach(), m.w3.detach()
    out = torch.empty(rows, ffn_hidden, device=device, dtype=torch.bfloat16)

    def gather_torch() -> torch.Tensor:
        g = x.index_select(0, index)
        return F.silu(torch._grouped_mm(g, w1, offs=ends)) * torch._grouped_mm(g, w3, offs=ends)

    def gather_fused() -> torch.Tensor:
        return _grouped_gemm.grouped_swiglu(x.index_select(0, index), w1, w3, ends)

    def fused_index() -> torch.Tensor:
        return _grouped_gemm.grouped_swiglu_segments(x, w1, w3, starts, cnt, out, index=index)

    fns = {"gather_torch": gather_torch, "gather_fused": gather_fused, "fused_index": fused_index}
    with torch.no_grad():
        g64 = x.index_select(0, index).double()
        want = torch.cat([F.silu(ge @ w1[e].double()) * (ge @ w3[e].double())
                          for e, ge in enumerate(g64.split(counts))])
        tol = 2e-2 * want.abs().max()
        wrong = {k: int(((fn().double() - want).abs() > tol).sum()) for k, fn in fns.items()}
        del want, g64
        times: dict[str, list[float]] = {k: [] for k in fns}
        names = list(fns)
        for rep in range(reps):
            for k in (names if rep % 2 else names[::-1]):
                fn = fns[k]
                for _ in range(2):
                    fn()
                a, b = _span(fn, iters, torch.cuda.current_stream())
                b.synchronize()
                times[k].append(_us(a, b, iters))
    med = {k: statistics.median(v) for k, v in times.items()}
    return GatherRecord(name, rows, tokens, hidden, ffn_hidden, experts, med["gather_torch"], med["gather_fused"],
                        med["fused_index"],
                        statistics.median(f / t for f, t in zip(times["fused_index"], times["gather_torch"])),
                        statistics.median(f / t for f, t in zip(times["fused_index"], times["gather_fused"])),
                        wrong["fused_index"], wrong["gather_torch"])


def plot_beside(beside: list[BesideRecord], gather: list[GatherRecord], path: str, title: str) -> None:
    """PNG: the experts' slowdown per transfer and configuration; the gathered gate/up times."""
    import matplotlib  # deferred: plotting is optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_s, ax_g) = plt.subplots(1, 2, figsize=(13, 4.5))
    configs = list(dict.fromkeys(r.config for r in beside))
    kinds = list(dict.fromkeys(r.transfer for r in beside))
    width = 0.8 / max(1, len(kinds))
    for i, kind in enumerate(kinds):
        vals = [next((r.slowdown for r in beside if r.config == c and r.transfer == kind), 0.0) for c in configs]
        ax_s.bar([x + i * width for x in range(len(configs))], vals, width, label=kind)
    ax_s.axhline(1.0, color="k", lw=0.8)
    ax_s.set_xticks([x + 0.4 - width / 2 for x in range(len(configs))], configs, fontsize=8, rotation=30, ha="right")
    ax_s.set_ylabel("experts' time beside / alone (paired)")
    ax_s.legend(fontsize=7)
    gc = [r.config for r in gather]
    for i, (label, key) in enumerate((("index_select + torch grouped GEMM", "gather_torch_us"),
                                      ("index_select + fused kernel", "gather_fused_us"),
                                      ("fused kernel through the index", "fused_index_us"))):
        ax_g.bar([x + i * 0.27 for x in range(len(gc))], [getattr(r, key) for r in gather], 0.27, label=label)
    ax_g.set_xticks([x + 0.27 for x in range(len(gc))], gc, fontsize=8, rotation=30, ha="right")
    ax_g.set_ylabel("gate/up + activation (us)")
    ax_g.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
