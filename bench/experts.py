"""Timing one rank's experts (``GroupedSwiGLU`` without autograd): the Triton kernels against
torch's GEMMs, as functions that return records.

The variants of a configuration are timed in the same rounds, alternating which goes first;
``fused_over_torch_paired`` is the median over rounds of the fused time over torch's in that
round; ``fused_path`` says what ``fused=True`` ran (torch's path where the call is bound by its
host: ``overlap.moe._grouped_gemm.gpu_bound``). ``wrong_*`` counts output elements more than 2% of
the largest away from float64 products per expert (the activation rounded once to the run's
dtype, as the fused kernel does).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from overlap.moe import GroupedSwiGLU

CHECK_ROWS = 256  # rows of each expert the FP8 benchmark checks

__all__ = ["ExpertsRecord", "PaddedRecord", "Fp8ExpertsRecord", "uneven_counts", "measure_experts", "measure_padded",
           "plot_experts", "timed_us", "dense_peaks", "measure_fp8_experts", "plot_fp8_experts"]


@dataclass
class ExpertsRecord:
    config: str
    dtype: str
    rows: int
    hidden: int
    ffn_hidden: int
    experts: int
    counts_min: int
    counts_max: int
    torch_us: float
    fused_us: float
    fused_over_torch_paired: float
    wrong_fused: int
    wrong_torch: int
    fused_path: str  # what fused=True ran: "fused", or "torch" where the call is bound by its host

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def uneven_counts(rows: int, experts: int, seed: int) -> list[int]:
    """``experts`` counts summing to ``rows``, drawn around the mean (Dirichlet, concentration 8)."""
    g = torch.Generator().manual_seed(seed)
    share = torch._standard_gamma(torch.full((experts,), 8.0), generator=g)
    counts = (share / share.sum() * rows).floor().long()
    counts[int(torch.randint(experts, (1,), generator=g))] += rows - int(counts.sum())
    return counts.tolist()


def _float64(m: GroupedSwiGLU, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    w1, w3, w2 = (p.detach().double() for p in (m.w1, m.w3, m.w2))
    out = []
    for e, xe in enumerate(x.split(counts)):
        xe = xe.double()
        act = (F.silu(xe @ w1[e]) * (xe @ w3[e])).to(x.dtype).double()
        out.append(act @ w2[e])
    return torch.cat(out)


def measure_experts(name: str, rows: int, hidden: int, ffn_hidden: int, experts: int, device: torch.device, *,
                    iters: int = 10, reps: int = 9, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16) -> ExpertsRecord:
    """``fused=True`` against ``fused=False`` (torch's grouped GEMMs; for fp16, which they do not
    take, one GEMM per expert)."""
    counts = uneven_counts(rows, experts, seed)
    torch.manual_seed(seed)
    m = GroupedSwiGLU(experts, hidden, ffn_hidden, dtype=dtype, device=device)
    x = torch.randn(rows, hidden, device=device, dtype=dtype)
    times: dict[bool, list[float]] = {True: [], False: []}
    wrong: dict[bool, int] = {}
    ran = ""
    with torch.no_grad():
        want = _float64(m, x, counts)
        for fused in times:
            m.fused = fused
            got = m(x, counts).double()
            if fused:
                ran = m.last_path[0] if m.last_path else ""
            wrong[fused] = int(((got - want).abs() > 2e-2 * want.abs().max()).sum())
            for _ in range(3):
                m(x, counts)
        del want
        torch.cuda.synchronize(device)
        for rep in range(reps):
            for fused in ((True, False) if rep % 2 else (False, True)):
                m.fused = fused
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(iters):
                    m(x, counts)
                e.record()
                e.synchronize()
                times[fused].append(s.elapsed_time(e) * 1e3 / iters)
    paired = statistics.median(f / t for f, t in zip(times[True], times[False], strict=True))
    return ExpertsRecord(name, str(dtype).removeprefix("torch."), rows, hidden, ffn_hidden, experts, min(counts),
                         max(counts), statistics.median(times[False]), statistics.median(times[True]), paired,
                         wrong[True], wrong[False], ran)


@dataclass
class PaddedRecord:
    config: str
    experts: int
    capacity: int
    rows: int
    hidden: int
    ffn_hidden: int
    bmm_us: float           # forward_padded(x): batched GEMMs over every row of every block
    fused_us: float         # forward_padded(x, counts): the counted rows only (Triton)
    bmm_graph_us: float     # the same, replayed from CUDA graphs
    fused_graph_us: float
    fused_over_bmm_graph_paired: float
    wrong_fused: int
    wrong_bmm: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def timed_us(call: Callable[[], object], n: int, per: int | None = None) -> float:
    """Microseconds per one of ``per`` calls (default ``n``) of ``n`` calls of ``call`` in a row,
    timed by CUDA events on the current stream."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        call()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / (per or n)


def _rounds(fns: dict[str, Callable[[], float]], reps: int) -> dict[str, list[float]]:
    """Each of ``fns`` (one timed loop, returning microseconds per call) in ``reps`` rounds, each
    round in the other order from the last."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for rep in range(reps):
        for k in (names if rep % 2 else names[::-1]):
            out[k].append(fns[k]())
    return out


def measure_padded(name: str, experts: int, capacity: int, rows: int, hidden: int, ffn_hidden: int,
                   device: torch.device, *, iters: int = 10, reps: int = 9, seed: int = 0) -> PaddedRecord:
    """``GroupedSwiGLU.forward_padded`` on the low-latency layout (``experts`` blocks of ``capacity``
    rows, ``rows`` of them counted), every row against the counted rows only, eagerly and
    replayed from CUDA graphs of ``iters`` calls."""
    counts_l = uneven_counts(rows, experts, seed)
    assert max(counts_l) <= capacity, (counts_l, capacity)
    torch.manual_seed(seed)
    m = GroupedSwiGLU(experts, hidden, ffn_hidden, dtype=torch.bfloat16, device=device)
    x = torch.randn(experts, capacity, hidden, device=device, dtype=torch.bfloat16)
    counts = torch.tensor(counts_l, device=device)
    calls = {"bmm": lambda: m.forward_padded(x), "fused": lambda: m.forward_padded(x, counts)}
    with torch.no_grad():
        w1, w3, w2 = (p.detach().double() for p in (m.w1, m.w3, m.w2))
        wrong = {}
        for k, call in calls.items():
            got = call()
            bad = 0
            for e, c in enumerate(counts_l):
                xe = x[e, :c].double()
                want = (F.silu(xe @ w1[e]) * (xe @ w3[e])).to(x.dtype).double() @ w2[e]
                bad += int(((got[e, :c].double() - want).abs() > 2e-2 * want.abs().max().clamp_min(1e-30)).sum())
            wrong[k] = bad
        graphs = {}
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for k, call in calls.items():
                for _ in range(3):
                    call()
                graphs[k] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[k], stream=stream):
                    for _ in range(iters):
                        call()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)

        def loop(fn: Callable[[], object], n: int) -> Callable[[], float]:
            return lambda: timed_us(fn, n, iters)  # n calls of fn: iters experts calls in all

        per = _rounds({"bmm": loop(calls["bmm"], iters), "fused": loop(calls["fused"], iters),
                       "bmm_graph": loop(graphs["bmm"].replay, 1), "fused_graph": loop(graphs["fused"].replay, 1)},
                      reps)
    paired = statistics.median(f / b for f, b in zip(per["fused_graph"], per["bmm_graph"], strict=True))
    med = {k: statistics.median(v) for k, v in per.items()}
    return PaddedRecord(name, experts, capacity, rows, hidden, ffn_hidden, med["bmm"], med["fused"],
                        med["bmm_graph"], med["fused_graph"], paired, wrong["fused"], wrong["bmm"])


def plot_experts(records: list[ExpertsRecord], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(records))
    ax.bar([i - 0.2 for i in xs], [r.torch_us for r in records], 0.4,
           label="fused=False: torch's grouped GEMMs (fp16: a GEMM per expert)")
    ax.bar([i + 0.2 for i in xs], [r.fused_us for r in records], 0.4, label="fused=True: the Triton kernels")
    for i, r in enumerate(records):
        note = "" if r.fused_path == "fused" else f"\n({r.fused_path})"
        ax.text(i + 0.2, r.fused_us, f"{r.fused_over_torch_paired:.2f}x{note}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [f"{r.config} {r.dtype}" for r in records], rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("GroupedSwiGLU forward, no grad (us)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass
class Fp8ExpertsRecord:
    """One configuration's experts forward (no grad) four ways, timed in the same rounds.

    ``*_us``: median per call; ``*_tflops``: ``6 rows hidden ffn`` over it; ``fp8_over_bf16_paired``:
    the median over rounds of our FP8 time over our bf16 (``GroupedSwiGLU`` fused); the peaks are
    dense 8192^3 GEMMs measured in the same run (bf16 ``torch.mm``; e4m3 ``torch._scaled_mm`` with
    fast accumulation). ``wrong_fp8``: elements more than 2% of the largest away from the torch
    definition of the FP8 experts (``_fp8_gemm.*_reference``); ``fp8_rel_error``: our FP8 output's
    RMS distance from the float64 bf16 experts over their RMS (the cost of e4m3)."""

    config: str
    rows: int
    hidden: int
    ffn_hidden: int
    experts: int
    fp8_us: float
    bf16_us: float
    torch_bf16_us: float
    torch_fp8_us: float
    fp8_tflops: float
    bf16_tflops: float
    torch_bf16_tflops: float
    torch_fp8_tflops: float
    fp8_over_bf16_paired: float
    fp8_over_torch_fp8_paired: float
    bf16_peak_tflops: float
    fp8_peak_tflops: float
    wrong_fp8: int
    fp8_rel_error: float
    fp8_config: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def dense_peaks(device: torch.device, n: int = 8192, iters: int = 20) -> tuple[float, float]:
    """(bf16, e4m3) TFLOP/s of one ``n^3`` GEMM on ``device``, best of 3 loops."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device=device)
    calls = {"bf16": lambda: torch.mm(a, b),
             "fp8": lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)}
    best = {}
    for k, call in calls.items():
        call()
        best[k] = 2 * n ** 3 / (min(timed_us(call, iters) for _ in range(3)) * 1e-6) / 1e12
    return best["bf16"], best["fp8"]


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, K]`` as e4m3 with one float32 scale per row (torch's rowwise FP8)."""
    s = (x.float().abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (x.float() / s).to(torch.float8_e4m3fn), s.view(-1)


def _rowwise_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, K, N]`` as e4m3 ``[E, K, N]`` column-major (``[E, N, K]`` transposed) with a scale per
    (expert, column): ``_scaled_grouped_mm``'s second operand."""
    t = w.float().transpose(1, 2)  # [E, N, K]
    s = (t.abs().amax(-1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (t / s).to(torch.float8_e4m3fn).contiguous().transpose(1, 2), s.squeeze(-1)


def measure_fp8_experts(name: str, rows: int, hidden: int, ffn_hidden: int, experts: int, device: torch.device,
                        *, iters: int = 10, reps: int = 9, seed: int = 0,
                        peaks: tuple[float, float] | None = None) -> Fp8ExpertsRecord:
    """Our FP8 experts (``forward_fp8`` on packed rows) against our bf16 experts (``fused=True``),
    torch's bf16 grouped GEMMs (``fused=False``) and torch's rowwise FP8 grouped GEMMs
    (``_scaled_grouped_mm`` for gate, up and down, the activation quantized per row between)."""
    from overlap import _kernel_tuning
    from overlap.moe import _fp8_gemm
    from overlap.moe.fp8 import quantize_rows

    counts = uneven_counts(rows, experts, seed)
    torch.manual_seed(seed)
    m = GroupedSwiGLU(experts, hidden, ffn_hidden, dtype=torch.bfloat16, device=device, fp8=True)
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    ends = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    with torch.no_grad():
        packed = quantize_rows(x)
        q1, q3, q2 = m.fp8_weights()
        r1, r3, r2 = (_rowwise_weight(p.detach()) for p in (m.w1, m.w3, m.w2))
        xr = _rowwise(x)

        def torch_fp8() -> torch.Tensor:
            h1 = torch._scaled_grouped_mm(xr[0], r1[0], xr[1], r1[1], offs=ends, out_dtype=torch.bfloat16)
            h3 = torch._scaled_grouped_mm(xr[0], r3[0], xr[1], r3[1], offs=ends, out_dtype=torch.bfloat16)
            hq, hs = _rowwise(F.silu(h1) * h3)
            return torch._scaled_grouped_mm(hq, r2[0], hs, r2[1], offs=ends, out_dtype=torch.bfloat16)

        def ours(fused: bool) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:
                m.fused = fused
                return m(x, counts, ends=ends)
            return call

        calls: dict[str, Callable[[], torch.Tensor]] = {
            "fp8": lambda: m.forward_fp8(packed, counts, ends=ends), "bf16": ours(True), "torch_bf16": ours(False),
            "torch_fp8": torch_fp8}
        got = calls["fp8"]()
        assert m.last_path is not None and m.last_path[0] == "fp8", m.last_path
        cfg = _kernel_tuning.last_pick("fp8_swiglu"), _kernel_tuning.last_pick("fp8_mm")
        # checked on up to CHECK_ROWS rows of each expert (the float64 product of every row of a
        # 32K-token prefill would take the GPU minutes)
        starts = [0, *itertools.accumulate(counts)][:-1]
        sub = [min(c, CHECK_ROWS) for c in counts]
        idx = torch.tensor([i for a, c in zip(starts, sub, strict=True) for i in range(a, a + c)], device=device,
                           dtype=torch.long)
        xq, xs = _fp8_gemm.split_rows(packed[idx], hidden)
        hq, hs = _fp8_gemm.grouped_swiglu_fp8_reference(xq, xs, q1, q3, sub)
        want = _fp8_gemm.grouped_mm_fp8_reference(hq, hs, q2, sub, torch.float32)
        mine = got[idx].float()
        wrong = int(((mine - want).abs() > 2e-2 * want.abs().max()).sum())
        true = _float64(m, x[idx], sub)
        rel = float((mine.double() - true).norm() / true.norm())
        del hq, hs, want, true
        for call in calls.values():
            for _ in range(3):
                call()
        torch.cuda.synchronize(device)

        per = _rounds({k: (lambda c=c: timed_us(c, iters)) for k, c in calls.items()}, reps)
    med = {k: statistics.median(v) for k, v in per.items()}
    flops = 6 * rows * hidden * ffn_hidden
    tf = {k: flops / (v * 1e-6) / 1e12 for k, v in med.items()}
    pb, pf = peaks if peaks is not None else dense_peaks(device)

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(per[a], per[b], strict=True))

    return Fp8ExpertsRecord(name, rows, hidden, ffn_hidden, experts, med["fp8"], med["bf16"], med["torch_bf16"],
                            med["torch_fp8"], tf["fp8"], tf["bf16"], tf["torch_bf16"], tf["torch_fp8"],
                            paired("fp8", "bf16"), paired("fp8", "torch_fp8"), pb, pf, wrong, rel,
                            f"gate/up {cfg[0]}; down {cfg[1]}")


def plot_fp8_experts(records: list[Fp8ExpertsRecord], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(records))
    ways = [("fp8_tflops", "ours, FP8 (e4m3, 128x128 weight blocks)"), ("bf16_tflops", "ours, bf16"),
            ("torch_bf16_tflops", "torch _grouped_mm, bf16"), ("torch_fp8_tflops", "torch _scaled_grouped_mm, FP8 rowwise")]
    for j, (field, label) in enumerate(ways):
        ax.bar([i + (j - 1.5) * 0.2 for i in xs], [getattr(r, field) for r in records], 0.2, label=label)
    if records:
        ax.axhline(records[0].fp8_peak_tflops, color="k", ls="--", lw=0.8, label="dense FP8 peak (measured)")
        ax.axhline(records[0].bf16_peak_tflops, color="gray", ls=":", lw=0.8, label="dense bf16 peak (measured)")
    for i, r in enumerate(records):
        ax.text(i - 0.3, r.fp8_tflops, f"{1 / r.fp8_over_bf16_paired:.2f}x", fontsize=7, ha="center", va="bottom")
    ax.set_xticks(list(xs), [f"{r.config}\n{r.rows} rows" for r in records], fontsize=7)
    ax.set_ylabel("experts forward, TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
