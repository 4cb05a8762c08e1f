"""The tile-signalled GEMM (``overlap/_tile_gemm.py``) against cuBLAS, alone and with its result
moved by copy engines while it runs, on one GPU.

For one shape ``[M, K] @ [K, N]`` (bf16), timed in the same rounds
(``bench.harness.time_interleaved``, ratios paired by round):

* ``cublas``: ``torch.mm(a, b, out=c)``, the anchor;
* ``tile``: the Triton GEMM without counters, one ``CONFIG`` (``tile_<BN>_<warps>_<stages>``
  for each configuration measured); ``tile_loop``: ``CONFIG`` without the flattened loop (as the
  signalling kernels run); ``signal``: with its group counters (the cost of signalling);
* ``copy``: a copy engine moving ``c`` (``M N`` elements) to another buffer, the stand-in on one
  GPU for the transfer of a GEMM + collective (on two GPUs it would cross the link);
* ``cublas_then_copy``: the GEMM, then the copy: nothing hidden;
* ``chunked_beside_copy``: what the ``copy_engine`` strategy does today: ``groups`` cuBLAS
  calls over row chunks, each chunk copied on a side stream once its GEMM is done;
* ``signal_beside_copy``: one tile-signalled GEMM, the side stream waiting on each group's
  counter (a stream memory wait) and copying the group's rows as soon as it is finished.

``loss``: tile / cublas (what the kernel costs against cuBLAS); ``hides``: the share of ``copy``
that ``signal_beside_copy`` hides, ``(cublas + copy - signal_beside_copy) / copy``, and
``chunked_hides`` the same for ``chunked_beside_copy``. Every variant's ``c`` and copy are
checked against a float64 product first (``wrong``: elements outside 2e-2 of the largest).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

import collectives as C
from collectives.peer import _launch
from overlap import _tile_gemm as T

from .harness import paired_ratio, time_interleaved

__all__ = ["TileRecord", "measure_tile_gemm", "format_tile_gemm", "plot_tile_gemm", "CONFIGS"]

CONFIGS = ((256, 8, 3), (128, 8, 4), (256, 8, 4))  # (BN, warps, stages) of the tile variants
_TOL = 2e-2


@dataclass
class TileRecord:
    M: int
    K: int
    N: int
    graph: bool
    group_rows: int
    groups: int
    times_us: dict[str, float]
    loss: float                 # tile (CONFIG) / cublas, paired
    best_config: str            # the fastest tile variant
    best_loss: float
    signal_loss: float          # signal / cublas
    beside_vs_cublas: float     # signal_beside_copy / cublas
    hides: float
    chunked_hides: float
    signal_vs_chunked: float    # signal_beside_copy / chunked_beside_copy, paired
    wrong: int
    ratios: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _name(cfg: tuple[int, int, int]) -> str:
    return "tile_{}_{}_{}".format(*cfg)


def _variants(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, dst: torch.Tensor, group_rows: int,
              side: torch.cuda.Stream) -> dict[str, Callable[[], object]]:
    m, n, es = a.shape[0], b.shape[1], a.element_size()
    counts = T.tiles(m, n, group_rows)
    groups = len(counts)
    first = groups // 2  # as rank 0 of two ranks would: the peer's half of the rows first
    counters = T.counters_for(m, group_rows, a.device)
    start, done = torch.cuda.Event(), torch.cuda.Event()
    row_bytes = n * es

    # (group, first row, end row) in the kernel's walk order
    walk = [(g, g * group_rows, min(m, (g + 1) * group_rows)) for g in ((first + i) % groups for i in range(groups))]

    def signal_beside_copy() -> None:
        main = torch.cuda.current_stream()
        counters.zero_()
        start.record(main)
        side.wait_event(start)  # the counters are zero before the side stream looks at them
        T.tile_mm(a, b, c, counters=counters, group_rows=group_rows, first=first)
        raw = side.cuda_stream
        for g, lo, hi in walk:
            _launch.wait_value(raw, counters.data_ptr() + 4 * g, counts[g])
            _launch.copy_async(dst.data_ptr() + lo * row_bytes, c.data_ptr() + lo * row_bytes, (hi - lo) * row_bytes,
                               raw)
        done.record(side)
        main.wait_event(done)

    def chunked_beside_copy() -> None:
        main = torch.cuda.current_stream()
        start.record(main)
        side.wait_event(start)
        for _, lo, hi in walk:
            torch.mm(a[lo:hi], b, out=c[lo:hi])
            ev = torch.cuda.Event()
            ev.record(main)
            side.wait_event(ev)
            _launch.copy_async(dst.data_ptr() + lo * row_bytes, c.data_ptr() + lo * row_bytes, (hi - lo) * row_bytes,
                               side.cuda_stream)
        done.record(side)
        main.wait_event(done)

    def signal() -> None:
        counters.zero_()
        T.tile_mm(a, b, c, counters=counters, group_rows=group_rows, first=first)

    def copy() -> None:
        _launch.copy_async(dst.data_ptr(), c.data_ptr(), m * row_bytes, torch.cuda.current_stream().cuda_stream)

    def cublas_then_copy() -> None:
        torch.mm(a, b, out=c)
        copy()

    def tile(cfg: tuple[int, int, int]) -> Callable[[], object]:
        return lambda: T.tile_mm(a, b, c, group_rows=group_rows, first=first, config=cfg)

    fns: dict[str, Callable[[], object]] = {"cublas": lambda: torch.mm(a, b, out=c)}
    fns.update({_name(cfg): tile(cfg) for cfg in CONFIGS})
    fns["tile_loop"] = lambda: T.tile_mm(a, b, c, group_rows=group_rows, first=first, flat=False)
    fns.update({"signal": signal, "copy": copy, "cublas_then_copy": cublas_then_copy,
                "chunked_beside_copy": chunked_beside_copy, "signal_beside_copy": signal_beside_copy})
    return fns


def _wrong(fns: dict[str, Callable[[], object]], a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
           dst: torch.Tensor) -> int:
    want = a.double() @ b.double()
    bound = _TOL * float(want.abs().max())
    wrong = 0
    for name, fn in fns.items():
        if name == "copy":
            continue
        c.fill_(float("nan")), dst.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        wrong += int(((c.double() - want).abs() > bound).sum()) + int((c.double() - want).isnan().sum())
        if name.endswith("copy"):
            wrong += int((dst != c).sum())
    return wrong


def measure_tile_gemm(comm: C.Communicator, m: int, k: int, n: int, device: torch.device, *, group_rows: int,
                      iters: int = 10, reps: int = 5, graph: bool = False, seed: int = 0) -> TileRecord:
    g = torch.Generator(device=device).manual_seed(seed + m * 7 + k * 11 + n * 13)
    a = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    b = (torch.randn(k, n, generator=g, device=device) / k ** 0.5).to(torch.bfloat16)
    c, dst = a.new_empty((m, n)), a.new_empty((m, n))
    side = torch.cuda.Stream(device)
    fns = _variants(a, b, c, dst, group_rows, side)
    wrong = _wrong(fns, a, b, c, dst)
    rounds: dict[str, list[float]] = {}
    times = time_interleaved(fns, comm, device, iters, reps, graph=graph, rounds=rounds)
    ratios = {name: paired_ratio(rounds, name, "cublas") for name in fns if name != "cublas"}
    tiles = {name: ratios[name] for name in fns if name.startswith("tile_") and name != "tile_loop"}
    best = min(tiles, key=tiles.__getitem__)
    t_cublas, t_copy = times["cublas"], times["copy"]

    def hides(name: str) -> float:
        return (t_cublas + t_copy - times[name]) / t_copy if t_copy > 0 else 0.0

    return TileRecord(M=m, K=k, N=n, graph=graph, group_rows=group_rows, groups=len(T.tiles(m, n, group_rows)),
                      times_us=times, loss=ratios[_name(T.CONFIG)], best_config=best, best_loss=tiles[best],
                      signal_loss=ratios["signal"], beside_vs_cublas=ratios["signal_beside_copy"],
                      hides=hides("signal_beside_copy"), chunked_hides=hides("chunked_beside_copy"),
                      signal_vs_chunked=paired_ratio(rounds, "signal_beside_copy", "chunked_beside_copy"),
                      wrong=wrong, ratios=ratios)


def format_tile_gemm(records: list[TileRecord]) -> str:
    head = (f"{'shape':>18} {'mode':>5} {'groups':>6} {'cublas us':>10} {'tile/cub':>8} {'best':>16} {'sig/cub':>8} "
            f"{'copy us':>8} {'beside/cub':>10} {'hides':>6} {'chunked':>7} {'sig/chk':>7} {'wrong':>5}")
    rows = [head]
    for r in records:
        rows.append(f"{f'{r.M}x{r.K}x{r.N}':>18} {'graph' if r.graph else 'eager':>5} {r.groups:>6} "
                    f"{r.times_us['cublas']:>10.1f} {r.loss:>8.3f} {f'{r.best_config}={r.best_loss:.3f}':>16} "
                    f"{r.signal_loss:>8.3f} {r.times_us['copy']:>8.1f} {r.beside_vs_cublas:>10.3f} {r.hides:>6.2f} "
                    f"{r.chunked_hides:>7.2f} {r.signal_vs_chunked:>7.3f} {r.wrong:>5}")
    return "\n".join(rows)


def plot_tile_gemm(records: list[TileRecord], path: str, title: str = "") -> None:
    """PNG: per shape and mode, each variant's time over cuBLAS's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [_name(T.CONFIG), "tile_loop", "signal", "cublas_then_copy", "chunked_beside_copy",
             "signal_beside_copy"]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(names)
    xs = range(len(records))
    for i, name in enumerate(names):
        values: list[Any] = [r.ratios.get(name, float("nan")) for r in records]
        ax.bar([x + i * width for x in xs], values, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in xs],
                  [f"{r.M}x{r.K}x{r.N} {'graph' if r.graph else 'eager'}" for r in records], fontsize=7, rotation=20)
    ax.set_ylabel("time / cuBLAS GEMM (paired by round)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
