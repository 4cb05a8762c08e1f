"""Timing the overlap operators against their plain sequence, as functions that return records.

For one shape ``(M, K, N)`` and op, the same run times: the GEMM alone, the collective alone, the
plain sequence, each strategy (``chunked`` and, on the GPUs of one node, ``copy_engine``, at
several chunk counts), ``auto``, and torch's AsyncTP fused op where the installed torch has it
(``fused_matmul_reduce_scatter``, ``fused_all_gather_matmul``). Derived: the ideal ``max(GEMM, collective)`` and the share of the
collective hidden, ``(sequential - time) / collective``. Every variant's output is checked
against the plain sequence computed in float32 (``#wrong``: elements outside the rounding bound
of ``_wrong``).

Shapes follow a row-parallel linear: ``a`` is ``[M, K]`` and ``b`` ``[K, N]`` on every rank; the
all-gather op gathers ``[M / p, K]`` shards. Times are medians of loops timed like the
collectives benchmark (``bench/harness.py``), the slowest rank's.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import collectives as C
import overlap
from overlap import ops as O

from .harness import _slowest, paired_hidden_share, paired_ratio
from .harness import time_interleaved as _time_interleaved

__all__ = ["OverlapRecord", "measure_shape", "format_overlap_table", "plot_overlap", "tuned_overlap_table", "OPS"]

# A strategy replaces the plain sequence in a tuned table only when it measured at least this
# much faster: a margin for run-to-run noise, so that `auto` never trades a sure baseline for a
# measured tie.
TUNE_MARGIN = 0.97

OPS = ("gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm")


@dataclass
class OverlapRecord:
    op: str
    M: int
    K: int
    N: int
    dtype: str
    world: int
    device: str
    variant: str          # sequential, chunked/4, copy_engine/4, auto, asynctp, gemm, collective
    time_us: float
    gemm_us: float
    comm_us: float
    sequential_us: float
    ideal_us: float
    hidden_pct: float     # (sequential - time) / collective, in %
    vs_sequential: float  # time / sequential
    wrong: int | None
    chosen: str | None = None
    # the median over rounds of time / sequential in the same round (bench.harness.paired_ratio)
    vs_sequential_paired: float | None = None
    # the median over rounds of (sequential - time) / min(GEMM, collective) in the same round, in %:
    # the share of the smaller term hidden
    hidden_small_pct: float | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _wrong(got: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor, dtype: torch.dtype) -> int:
    """Elements farther from the float32 reference than the rounding bound: 4 units of ``dtype``'s
    last place times the magnitude of the terms summed (the same op on ``|a|`` and ``|b|``), which
    allows for any order of accumulation, plus one rounding of the result."""
    eps = torch.finfo(dtype).eps
    return int(((got.float() - ref).abs() > 4 * eps * magnitude + eps * ref.abs()).sum())


def _asynctp(op: str, device: torch.device) -> str:
    """The AsyncTP op's name for ``op``, or "" where it cannot run here."""
    name = {"gemm_reduce_scatter": "fused_matmul_reduce_scatter", "all_gather_gemm": "fused_all_gather_matmul"}.get(op)
    if name is None or device.type != "cuda":
        return ""
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return ""
    return name if hasattr(torch.ops.symm_mem, name) else ""


def _enable_symm_mem(group_name: str) -> None:
    # Older torch needs the group registered for symmetric memory; torch 2.11 warns that this
    # is no longer needed.
    import warnings

    symm = importlib.import_module("torch.distributed._symmetric_memory")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            symm.enable_symm_mem_for_group(group_name)
        except (RuntimeError, ValueError):  # already registered
            pass


def measure_shape(comm: C.Communicator, op: str, M: int, K: int, N: int, dtype: torch.dtype, device: torch.device,
                  *, chunk_counts: tuple[int, ...] = (2, 4, 8), iters: int = 10, reps: int = 5,
                  seed: int = 0, graph: bool = False, min_loop_s: float = 0.0) -> list[OverlapRecord]:
    """Every variant of ``op`` on one shape (see the module docstring); the first two records are
    the GEMM alone and the collective alone. With ``graph`` every variant is timed replayed from a
    CUDA graph (no host cost), except AsyncTP's op, which is then left out."""
    w, g = comm.size, comm.group
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1009 + comm.rank)
    m_in = M // w if op == "all_gather_gemm" else M
    a = (torch.randn(m_in, K, generator=gen, device=device) / K ** 0.5).to(dtype)
    b = torch.randn(K, N, generator=gen, device=device).to(dtype)
    full_a = torch.empty(M, K, dtype=dtype, device=device)
    c = torch.empty(M, N, dtype=dtype, device=device)
    shard = torch.empty(M // w, N, dtype=dtype, device=device)
    if op == "gemm_all_reduce":
        def gemm() -> object:
            return torch.matmul(a, b, out=c)

        def comm_only() -> object:
            return C.all_reduce(c, group=g)

        def run(strategy: str, chunks: int) -> torch.Tensor:
            return O.gemm_all_reduce(a, b, g, strategy=strategy, chunks=chunks)

        ref = O.reference_gemm_all_reduce(a.float(), b.float(), g)
        mag = O.reference_gemm_all_reduce(a.float().abs(), b.float().abs(), g)
    elif op == "gemm_reduce_scatter":
        def gemm() -> object:
            return torch.matmul(a, b, out=c)

        def comm_only() -> object:
            return C.reduce_scatter_single(shard, c, group=g)

        def run(strategy: str, chunks: int) -> torch.Tensor:
            return O.gemm_reduce_scatter(a, b, g, scatter_dim=0, strategy=strategy, chunks=chunks)

        ref = O.reference_gemm_reduce_scatter(a.float(), b.float(), g, scatter_dim=0)
        mag = O.reference_gemm_reduce_scatter(a.float().abs(), b.float().abs(), g, scatter_dim=0)
    elif op == "all_gather_gemm":
        def gemm() -> object:
            return torch.matmul(full_a, b, out=c)

        def comm_only() -> object:
            return C.all_gather_single(full_a, a, group=g)

        def run(strategy: str, chunks: int) -> torch.Tensor:
            return O.all_gather_gemm(a, b, g, gather_dim=0, strategy=strategy, chunks=chunks)

        ref = O.reference_all_gather_gemm(a.float(), b.float(), g, gather_dim=0)
        mag = O.reference_all_gather_gemm(a.float().abs(), b.float().abs(), g, gather_dim=0)
    else:
        raise C.UnsupportedError("op", op, "is not an overlap operator", f"use one of {list(OPS)}")

    with torch.no_grad():
        variants: list[tuple[str, Callable[[], object]]] = [("gemm", gemm), ("collective", comm_only),
                                                              ("sequential", lambda: run("sequential", 1))]
        variants += [(f"chunked/{k}", functools.partial(run, "chunked", k)) for k in chunk_counts if k <= M // w]
        from overlap import _copy_engine

        if not _copy_engine.unavailable(comm, device, dtype):
            variants += [(f"copy_engine/{k}", functools.partial(run, "copy_engine", k)) for k in chunk_counts
                         if k <= M // w]
        from overlap import _tile_signal

        if op != "all_gather_gemm" and not _tile_signal.unavailable(comm, device, dtype) and _tile_signal.fits(M, w):
            variants += [(f"tile_signal/{k}", functools.partial(run, "tile_signal", k)) for k in chunk_counts
                         if k <= M // w]
        in_graph: list[str] = []

        def auto() -> torch.Tensor:
            out = run("auto", 1)
            if graph and torch.cuda.is_current_stream_capturing():  # what auto follows inside the graph
                in_graph.append(overlap.last_choice(g).strategy)  # type: ignore[union-attr]
            return out

        variants.append(("auto", auto))
        fused = "" if graph else _asynctp(op, device)
        if fused:
            _enable_symm_mem(g.group_name)
            if fused == "fused_matmul_reduce_scatter":
                variants.append(("asynctp", lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(
                    a, b, "sum", 0, g.group_name)))
            else:
                variants.append(("asynctp", lambda: torch.ops.symm_mem.fused_all_gather_matmul(
                    a, [b], 0, g.group_name)[1][0]))
        checked = {}
        for name, fn in variants[2:]:
            out = fn()
            wrong = int(_slowest(comm, [float(_wrong(out, ref, mag, dtype))], device)[0])  # type: ignore[arg-type]
            chosen = overlap.last_choice(g).strategy if name == "auto" else None  # type: ignore[union-attr]
            checked[name] = (wrong, chosen)
        # every variant timed in the same rounds (bench/harness.py:time_interleaved)
        rounds: dict[str, list[float]] = {}
        times = _time_interleaved(dict(variants), comm, device, iters, reps, graph=graph, min_loop_s=min_loop_s,
                                  rounds=rounds)
        if in_graph:  # the label is the choice the timed graph holds, not the eager check's
            checked["auto"] = (checked["auto"][0], in_graph[-1])
        t_gemm, t_comm = times["gemm"], times["collective"]
        timed = [(name, times[name], *checked[name]) for name, _ in variants[2:]]
    seq = timed[0][1]
    common = dict(op=op, M=M, K=K, N=N, dtype=str(dtype).removeprefix("torch."), world=w, device=str(device),
                  gemm_us=t_gemm, comm_us=t_comm, sequential_us=seq, ideal_us=max(t_gemm, t_comm))
    out_records = [OverlapRecord(variant="gemm", time_us=t_gemm, hidden_pct=0.0, vs_sequential=t_gemm / seq,
                                 wrong=None, **common),  # type: ignore[arg-type]
                   OverlapRecord(variant="collective", time_us=t_comm, hidden_pct=0.0, vs_sequential=t_comm / seq,
                                 wrong=None, **common)]  # type: ignore[arg-type]
    for name, t, wrong, chosen in timed:
        out_records.append(OverlapRecord(variant=name, time_us=t, hidden_pct=100 * (seq - t) / t_comm if t_comm else 0.0,
                                         vs_sequential=t / seq, wrong=wrong, chosen=chosen,
                                         vs_sequential_paired=paired_ratio(rounds, name, "sequential"),
                                         hidden_small_pct=paired_hidden_share(rounds, "sequential", name,
                                                                              (("gemm",), ("collective",))),
                                         **common))  # type: ignore[arg-type]
    dist.barrier(group=g)
    return out_records


def format_overlap_table(records: list[OverlapRecord]) -> str:
    """One block per (op, shape): each variant's time, its ratio to the sequence, and % hidden."""
    lines = []
    key = None
    for r in records:
        k = (r.op, r.M, r.K, r.N)
        if k != key:
            key = k
            lines.append(f"# {r.op} M={r.M} K={r.K} N={r.N} {r.dtype} x{r.world}: GEMM {r.gemm_us:.1f} us, "
                         f"collective {r.comm_us:.1f} us, ideal {r.ideal_us:.1f} us")
        if r.variant in ("gemm", "collective"):
            continue
        label = r.variant + (f"({r.chosen})" if r.chosen else "")
        wrong = "-" if r.wrong is None else str(r.wrong)
        paired = "" if r.vs_sequential_paired is None else f" ({r.vs_sequential_paired:.3f}x paired)"
        small = "" if r.hidden_small_pct is None else f" ({r.hidden_small_pct:.1f}% of the smaller)"
        lines.append(f"  {label:<22} {r.time_us:>10.1f} us  {r.vs_sequential:6.2f}x seq{paired}  {r.hidden_pct:7.1f}% hidden"
                     f"{small}  #wrong {wrong}")
    return "\n".join(lines)


def plot_overlap(records: list[OverlapRecord], path: str, title: str = "") -> None:
    """PNG: per op, each variant's time over the sequence's, one group of bars per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in records))
    # one colour per variant across every panel
    every = sorted(dict.fromkeys(r.variant for r in records if r.variant not in ("gemm", "collective")),
                   key=lambda v: (v != "sequential", v == "auto", v == "asynctp", len(v), v))
    colour = {v: f"C{i}" for i, v in enumerate(every)}
    fig, axes = plt.subplots(len(ops), 1, figsize=(12, 3.6 * len(ops)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops):
        mine = [r for r in records if r.op == op and r.variant not in ("gemm", "collective")]
        shapes = list(dict.fromkeys((r.M, r.K, r.N) for r in mine))
        names = [v for v in every if any(r.variant == v for r in mine)]
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            xs, ys = [], []
            for j, s in enumerate(shapes):
                hit = [r for r in mine if (r.M, r.K, r.N) == s and r.variant == name]
                if hit:
                    xs.append(j + i * width)
                    ys.append(hit[0].vs_sequential)
            ax.bar(xs, ys, width, label=name, color=colour[name])
        ideal = [min(r.ideal_us / r.sequential_us for r in mine if (r.M, r.K, r.N) == s) for s in shapes]
        ax.scatter([j + 0.4 - width / 2 for j in range(len(shapes))], ideal, marker="_", s=400, c="k", label="ideal")
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], [f"{m}x{k}x{n}" for m, k, n in shapes],
                      fontsize=8)
        ax.set_ylabel("time / sequential")
        ax.set_title(op)
        ax.legend(fontsize=7, ncol=4)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def tuned_overlap_table(records: list[OverlapRecord], meta: dict[str, object], graph: bool = False) -> dict[str, object]:
    """The table ``overlap.set_tuned`` / ``COMMOPS_OVERLAP_TUNED`` reads: per (op, shape), the
    fastest of our strategies, or the sequence unless one is ``TUNE_MARGIN`` faster; ``graph``:
    the records were timed replaying CUDA graphs (``auto`` follows such entries while capturing)."""
    entries = []
    shapes = dict.fromkeys((r.op, r.M, r.K, r.N, r.dtype) for r in records)
    for op, m, k, n, dtype in shapes:
        mine = [r for r in records if (r.op, r.M, r.K, r.N, r.dtype) == (op, m, k, n, dtype)]
        seq = next(r for r in mine if r.variant == "sequential")
        ours = [r for r in mine if r.variant.startswith(("chunked/", "copy_engine/", "tile_signal/"))]
        best = min(ours, key=lambda r: r.time_us) if ours else seq
        if best.time_us > TUNE_MARGIN * seq.time_us:
            best = seq
        strategy, _, chunks = best.variant.partition("/")
        entries.append({"op": op, "dtype": dtype, "M": m, "K": k, "N": n, "graph": graph, "strategy": strategy,
                        "chunks": int(chunks or 1),
                        "note": f"{best.time_us:.1f} us, sequential {seq.time_us:.1f} us"})
    return {"meta": {k: meta[k] for k in ("world", "device", "date", "torch") if k in meta}, "entries": entries}
