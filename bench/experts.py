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

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from overlap.moe import GroupedSwiGLU

__all__ = ["ExpertsRecord", "PaddedRecord", "uneven_counts", "measure_experts", "measure_padded", "plot_experts"]


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
            def timed() -> float:  # n calls of fn: iters experts calls in all
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(n):
                    fn()
                e.record()
                e.synchronize()
                return s.elapsed_time(e) * 1e3 / iters
            return timed

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
