"""On one CUDA GPU: the tile-signalled GEMM (``overlap/_tile_gemm.py``) against float64 products,
its counters, and copies that wait on them. Marker ``gpu``.

Shapes have row counts that are not whole tiles or whole groups, and column counts that are not
whole tiles; outputs land in memory poisoned with NaN, so a tile the kernel skipped fails. The
soak runs 1,000 back-to-back GEMMs with new operands, a side stream copying each group's rows as
soon as its counter says they are finished: a copy that ran early carries stale or NaN rows.
"""

from __future__ import annotations

import pytest
import torch

from collectives.errors import InvalidArgumentError
from collectives.peer import _launch
from overlap import _tile_gemm as T

pytestmark = pytest.mark.gpu

SHAPES = [(1000, 512, 776), (128, 64, 256), (4097, 1024, 2056), (300, 1000, 8), (1, 8, 8)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _operands(m: int, k: int, n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    return a, (torch.randn(k, n, generator=g, device="cuda") / k ** 0.5).to(dtype)


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group_rows", [128, 384])
def test_products_and_counters_match(dtype: torch.dtype, group_rows: int) -> None:
    for i, (m, k, n) in enumerate(SHAPES):
        a, b = _operands(m, k, n, dtype, 10 * i + group_rows)
        want = a.double() @ b.double()
        counts = T.tiles(m, n, group_rows)
        for first in sorted({0, len(counts) // 2, len(counts) - 1}):
            out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            counters = T.counters_for(m, group_rows, a.device)
            T.tile_mm(a, b, out, counters=counters, group_rows=group_rows, first=first)
            torch.cuda.synchronize()
            assert _rel(out, want) < (1e-2 if dtype == torch.bfloat16 else 2e-3), (m, k, n, first)
            assert counters.tolist()[:len(counts)] == counts, (m, n, group_rows, first)
        plain = T.tile_mm(a, b, group_rows=group_rows, config=(128, 8, 4))
        assert _rel(plain, want) < (1e-2 if dtype == torch.bfloat16 else 2e-3)
        weight = b.t().contiguous()  # a linear layer's [N, K]: b passed as its transpose, not copied
        assert _rel(T.tile_mm(a, weight.t(), group_rows=group_rows), want) < (1e-2 if dtype == torch.bfloat16 else 2e-3)


def test_copies_waiting_on_counters_see_whole_rows_1000_times() -> None:
    m, k, n, group_rows = 1024, 256, 512, 128
    counts = T.tiles(m, n, group_rows)
    side = torch.cuda.Stream()
    counters = T.counters_for(m, group_rows, torch.device("cuda"))
    ops = [_operands(m, k, n, torch.bfloat16, 500 + j) for j in range(8)]  # cycled; outputs checked every call
    wants = [a.double() @ b.double() for a, b in ops]
    outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    copies = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(1000)]
    start, row = torch.cuda.Event(), n * 2
    main = torch.cuda.current_stream()
    for j, dst in enumerate(copies):
        a, b = ops[j % len(ops)]
        c = outs[j % 2]
        counters.zero_()
        start.record(main)
        side.wait_event(start)
        T.tile_mm(a, b, c, counters=counters, group_rows=group_rows, first=j % len(counts))
        for g in range(len(counts)):
            _launch.wait_value(side.cuda_stream, counters.data_ptr() + 4 * g, counts[g])
            lo = g * group_rows
            _launch.copy_async(dst.data_ptr() + lo * row, c.data_ptr() + lo * row, group_rows * row, side.cuda_stream)
        main.wait_stream(side)  # the next GEMM into this c waits for its copies
    torch.cuda.synchronize()
    bad = [j for j, dst in enumerate(copies) if not _rel(dst, wants[j % len(ops)]) < 1e-2]
    assert not bad, f"{len(bad)} of 1000 copies wrong, first {bad[:5]}"


def test_refusals_name_the_argument() -> None:
    a, b = _operands(256, 64, 64, torch.bfloat16, 1)
    with pytest.raises(InvalidArgumentError, match="group_rows"):
        T.tiles(256, 64, 100)
    with pytest.raises(InvalidArgumentError, match="first"):
        T.tile_mm(a, b, group_rows=128, first=2)
    with pytest.raises(InvalidArgumentError, match="out"):
        T.tile_mm(a, b, torch.empty(256, 63, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(InvalidArgumentError, match="cannot take"):
        T.tile_mm(a.float(), b.float())
    with pytest.raises(InvalidArgumentError, match="counters"):
        T.tile_mm(a, b, counters=torch.zeros(1, dtype=torch.int64, device="cuda"))


def _meta(places: list[tuple[int, int]], srcs: list[torch.Tensor | None], flags: torch.Tensor,
          need: int) -> torch.Tensor:
    rows = [[sel, off, s.data_ptr() if s is not None else 0, flags.data_ptr() + 4 * g, need]
            for g, ((sel, off), s) in enumerate(zip(places, srcs))]
    return torch.tensor(rows, dtype=torch.int64, device="cuda")


def test_groups_placed_by_meta_add_their_sources_once_flagged() -> None:
    """Each group stored where its meta row says (groups 1 and 3 swapped between ``out`` and a
    staging buffer), adding rows whose flag a side stream sets only after the kernel has started
    (the host sleeps first): the tiles must have waited for it."""
    import time

    m, k, n, group_rows = 1024, 256, 520, 256
    a, b = _operands(m, k, n, torch.bfloat16, 77)
    groups, size = m // group_rows, group_rows * n
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    staging = torch.full((2 * group_rows, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    places = [(0, 0), (1, size), (0, 2 * size), (1, 0)]  # (0: out, 1: staging; element offset)
    srcs: list[torch.Tensor | None] = [torch.randn(group_rows, n, device="cuda").to(torch.bfloat16)
                                       for _ in range(groups)]
    srcs[1] = None  # a group without a source
    flags, err = torch.zeros(groups, dtype=torch.int32, device="cuda"), torch.zeros(4, dtype=torch.int32, device="cuda")
    counters = T.counters_for(m, group_rows, a.device)
    meta = _meta(places, srcs, flags, 3)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    T.tile_mm(a, b, out, counters=counters, group_rows=group_rows, first=2, meta=meta, staging=staging, err=err)
    time.sleep(0.05)
    for g in range(groups):
        _launch.write_value(side.cuda_stream, flags.data_ptr() + 4 * g, 3)
    torch.cuda.synchronize()
    want = a.double() @ b.double()
    for g, (sel, off) in enumerate(places):
        got = (out if sel == 0 else staging).view(-1)[off:off + size].view(group_rows, n)
        expect = want[g * group_rows:(g + 1) * group_rows] + (srcs[g].double() if srcs[g] is not None else 0)
        assert _rel(got, expect) < 1e-2, g
    assert out[group_rows:2 * group_rows].isnan().all() and out[3 * group_rows:].isnan().all()
    assert counters.tolist() == T.tiles(m, n, group_rows)


def test_a_wait_gives_up_when_the_error_word_is_set() -> None:
    import time

    m, k, n, group_rows = 256, 64, 256, 128
    a, b = _operands(m, k, n, torch.bfloat16, 78)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    src = torch.zeros(group_rows, n, dtype=torch.bfloat16, device="cuda")
    flags, err = torch.zeros(2, dtype=torch.int32, device="cuda"), torch.zeros(4, dtype=torch.int32, device="cuda")
    meta = _meta([(0, 0), (0, group_rows * n)], [src, src], flags, 1)  # never set
    torch.cuda.synchronize()
    T.tile_mm(a, b, out, group_rows=group_rows, meta=meta, err=err)
    time.sleep(0.05)
    _launch.write_value(torch.cuda.Stream().cuda_stream, err.data_ptr(), 1)
    t0 = time.monotonic()
    torch.cuda.synchronize()
    assert time.monotonic() - t0 < 10
