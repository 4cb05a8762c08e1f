"""The overlap operators against their plain sequences and against float64 autograd, on Gloo.

Every rank regenerates every rank's operands from (seed, rank), so each expected value and
gradient is computed locally in float64 from the whole (unsharded) computation: a sum of the
ranks' products for the all-reduce, its slices for the reduce-scatter, the concatenated shards
times each rank's ``b`` for the all-gather. Odd row counts and uneven chunks included.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

import collectives as C
from overlap import ops
from tests._compiled import compile_checked
from tests.mp import messages

K, N = 5, 7


def _operands(q: int, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + q)
    a = torch.randn(*shape, K, generator=g, dtype=torch.float64)
    b = torch.randn(K, N, generator=g, dtype=torch.float64)
    return a, b, torch.randn(N, generator=g, dtype=torch.float64)


def _grad_out(shape: tuple[int, ...], seed: int, q: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed * 7 + 99 + q), dtype=torch.float64)


def _same_layout(out: torch.Tensor, ref: torch.Tensor) -> None:
    """What a caller can tell apart besides the values: shape, dtype and strides."""
    assert (out.shape, out.dtype, out.stride()) == (ref.shape, ref.dtype, ref.stride()), \
        (out.shape, out.dtype, out.stride(), ref.shape, ref.dtype, ref.stride())


def _call(op: Any, backend: str | None, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``op(*args, **kwargs)``, eagerly or (``backend``) compiled with fullgraph, traced to its torch.ops op."""
    if backend is None:
        return op(*args, **kwargs)  # type: ignore[no-any-return]
    compiled, traced = compile_checked(op, backend, *args, **kwargs)
    assert f"commops.{op.__name__}" in traced, traced
    return compiled(*args, **kwargs)  # type: ignore[no-any-return]


def _case_all_reduce(rank: int, world: int, strategy: str, chunks: int, shape: tuple[int, ...], seed: int,
                     backend: str | None = None) -> float:
    mine = _operands(rank, shape, seed)
    a, b = (t.float().requires_grad_() for t in mine[:2])
    bias = _operands(0, shape, seed)[2].float().requires_grad_()  # one bias, the same on every rank
    out = _call(ops.gemm_all_reduce, backend, a, b, bias=bias, strategy=strategy, chunks=chunks)
    ref = ops.reference_gemm_all_reduce(a.detach(), b.detach(), bias=bias.detach())
    _same_layout(out, ref)
    G = _grad_out(tuple(out.shape), seed)  # the same on every rank: a replicated output's loss, counted once
    (out * G.float()).sum().backward()
    # float64 autograd of the unsharded computation
    every = [[t.clone().requires_grad_() for t in _operands(q, shape, seed)] for q in range(world)]
    full = sum(aq @ bq for aq, bq, _ in every) + every[0][2]
    (full * G).sum().backward()
    want_ga, want_gb = every[rank][0].grad, every[rank][1].grad
    err = max((out.double() - full.detach()).abs().max().item(), (ref.double() - full.detach()).abs().max().item(),
              (a.grad.double() - want_ga).abs().max().item(), (b.grad.double() - want_gb).abs().max().item(),
              (bias.grad.double() - every[0][2].grad).abs().max().item())
    assert ops.last_choice().strategy == ("sequential" if strategy == "auto" else strategy)
    return err


def _case_reduce_scatter(rank: int, world: int, strategy: str, chunks: int, shape: tuple[int, ...], dim: int,
                         seed: int, backend: str | None = None) -> float:
    a, b, _ = (t.float().requires_grad_() for t in _operands(rank, shape, seed))
    out = _call(ops.gemm_reduce_scatter, backend, a, b, scatter_dim=dim, strategy=strategy, chunks=chunks)
    ref = ops.reference_gemm_reduce_scatter(a.detach(), b.detach(), scatter_dim=dim)
    _same_layout(out, ref)
    Gs = [_grad_out(tuple(out.shape), seed, q) for q in range(world)]  # each rank's slice feeds its own loss
    (out * Gs[rank].float()).sum().backward()
    every = [[t.clone().requires_grad_() for t in _operands(q, shape, seed)[:2]] for q in range(world)]
    full = sum(aq @ bq for aq, bq in every)
    slices = full.chunk(world, dim=dim)
    sum((s * Gq).sum() for s, Gq in zip(slices, Gs)).backward()
    err = max((out.double() - slices[rank].detach()).abs().max().item(),
              (ref.double() - slices[rank].detach()).abs().max().item(),
              (a.grad.double() - every[rank][0].grad).abs().max().item(),
              (b.grad.double() - every[rank][1].grad).abs().max().item())
    return err


def _case_all_gather(rank: int, world: int, strategy: str, chunks: int, shape: tuple[int, ...], dim: int,
                     seed: int, backend: str | None = None) -> float:
    a, b, _ = (t.float().requires_grad_() for t in _operands(rank, shape, seed))
    out = _call(ops.all_gather_gemm, backend, a, b, gather_dim=dim, strategy=strategy, chunks=chunks)
    ref = ops.reference_all_gather_gemm(a.detach(), b.detach(), gather_dim=dim)
    _same_layout(out, ref)
    Gs = [_grad_out(tuple(out.shape), seed, q) for q in range(world)]
    (out * Gs[rank].float()).sum().backward()
    every = [[t.clone().requires_grad_() for t in _operands(q, shape, seed)[:2]] for q in range(world)]
    whole = torch.cat([e[0] for e in every], dim=dim)
    outs = [whole @ e[1] for e in every]  # every rank multiplies the gathered operand by its own b
    sum((o * Gq).sum() for o, Gq in zip(outs, Gs)).backward()
    err = max((out.double() - outs[rank].detach()).abs().max().item(),
              (ref.double() - outs[rank].detach()).abs().max().item(),
              (a.grad.double() - every[rank][0].grad).abs().max().item(),
              (b.grad.double() - every[rank][1].grad).abs().max().item())
    return err


CASES = [("auto", 1), ("sequential", 1), ("chunked", 1), ("chunked", 3), ("chunked", 4)]


@pytest.mark.parametrize("world_size", [2, 3])
def test_operators_equal_the_plain_sequences_and_float64_autograd(worlds, world_size: int) -> None:  # noqa: ANN001
    w = worlds(world_size)
    seed = 0
    for strategy, chunks in CASES:
        for shape in [(13,), (2, 7)]:
            seed += 1
            errs = w.run(_case_all_reduce, strategy, chunks, shape, seed)
            assert max(errs) < 1e-4, (strategy, chunks, shape, errs)
        for shape, dim in [((3 * world_size,), 0), ((2 * world_size, 5), 0), ((3, 2 * world_size), 1)]:
            seed += 1
            errs = w.run(_case_reduce_scatter, strategy, chunks, shape, dim, seed)
            assert max(errs) < 1e-4, ("reduce_scatter", strategy, chunks, shape, dim, errs)
        for shape, dim in [((5,), 0), ((3, 2), 1), ((2, 3), 0)]:
            seed += 1
            errs = w.run(_case_all_gather, strategy, chunks, shape, dim, seed)
            assert max(errs) < 1e-4, ("all_gather", strategy, chunks, shape, dim, errs)


def _bad(rank: int, world: int) -> list[str]:
    a, b = torch.randn(6, 4), torch.randn(4, 3)
    calls = [
        lambda: ops.gemm_all_reduce(a, torch.randn(5, 3)),                          # inner dimensions
        lambda: ops.gemm_all_reduce(a, b.double()),                                 # dtypes
        lambda: ops.gemm_reduce_scatter(torch.randn(5, 4), b),                      # 5 rows, 2 ranks
        lambda: ops.gemm_reduce_scatter(a, b, scatter_dim=1),                       # the last dimension
        lambda: ops.all_gather_gemm(a, b, strategy="fastest"),                      # no such strategy
        lambda: ops.all_gather_gemm(a, b, strategy="chunked", chunks=0),
        lambda: ops.gemm_all_reduce([1.0], b),                                      # not a tensor
        lambda: ops.gemm_reduce_scatter(a, b, strategy="copy_engine"),              # needs GPUs
    ]
    return messages(calls)


def test_bad_arguments_raise_before_anything_is_sent(worlds) -> None:  # noqa: ANN001
    for msgs in worlds(2).run(_bad):
        assert all("Fix:" in m for m in msgs), msgs
        assert "inner dimension 4" in msgs[0] and "dtype" in msgs[1]
        assert "do not divide" in msgs[2] and "scatter_dim" in msgs[3]
        assert "fastest" in msgs[4] and "chunks" in msgs[5] and "not a torch.Tensor" in msgs[6]
        assert "copy_engine" in msgs[7] and "GPUs of one node" in msgs[7]


def _auto_reason(rank: int, world: int) -> tuple[str, str]:
    ops.gemm_all_reduce(torch.randn(4, 3), torch.randn(3, 2))
    ch = ops.last_choice()
    assert ch is not None
    return ch.strategy, ch.reason


def test_auto_says_why(worlds) -> None:  # noqa: ANN001
    for strategy, reason in worlds(2).run(_auto_reason):
        assert strategy == "sequential" and "no overlap measurement" in reason


def _bench_smoke(rank: int, world: int) -> list[tuple[str, str, int | None, float]]:
    from bench.gemm_collective import measure_shape

    out = []
    for op in ("gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm"):
        for r in measure_shape(C.get_communicator(), op, 8, 16, 12, torch.float32, torch.device("cpu"),
                               chunk_counts=(2, 4), iters=1, reps=1):
            out.append((op, r.variant, r.wrong, r.vs_sequential))
            # one round: the paired ratio is that round's ratio, i.e. the ratio of the medians
            assert r.variant in ("gemm", "collective") or r.vs_sequential_paired == pytest.approx(r.vs_sequential)
            # and the share of the smaller term hidden is that round's, from the medians' figures
            if r.variant not in ("gemm", "collective"):
                small = min(r.gemm_us, r.comm_us)
                assert r.hidden_small_pct == pytest.approx(100 * (r.sequential_us - r.time_us) / small)
    return out


def test_overlap_benchmark_smoke(worlds) -> None:  # noqa: ANN001
    rows = worlds(2).run(_bench_smoke)[0]
    for op in ("gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm"):
        variants = [v for o, v, _, _ in rows if o == op]
        assert variants == ["gemm", "collective", "sequential", "chunked/2", "chunked/4", "auto"], variants
    assert all(w in (None, 0) for _, _, w, _ in rows)
    assert all(ratio > 0 for *_, ratio in rows)


def _auto_follows_table(rank: int, world: int) -> tuple[str, int, bool, str, float]:
    ops.set_tuned({"meta": {"world": world}, "entries": [
        {"op": "gemm_all_reduce", "dtype": "float32", "M": 16, "K": 3, "N": 2, "strategy": "chunked", "chunks": 3},
        {"op": "gemm_all_reduce", "dtype": "float32", "M": 4096, "K": 3, "N": 2, "strategy": "sequential"}]})
    try:
        g = torch.Generator().manual_seed(rank)
        a, b = torch.randn(13, 3, generator=g), torch.randn(3, 2, generator=g)
        out = ops.gemm_all_reduce(a, b)  # M=13: nearest measured M is 16
        first = ops.last_choice()
        ops.gemm_all_reduce(torch.randn(13, 4), torch.randn(4, 2))  # no entry for K=4
        second = ops.last_choice()
        assert first is not None and second is not None
        err = (out - ops.reference_gemm_all_reduce(a, b)).abs().max().item()
        return first.strategy, first.chunks, "tuned table" in first.reason, second.strategy, err
    finally:
        ops.set_tuned(None)


def test_auto_follows_a_tuned_table(worlds) -> None:  # noqa: ANN001
    for strategy, chunks, from_table, other, err in worlds(2).run(_auto_follows_table):
        assert (strategy, chunks, from_table, other) == ("chunked", 3, True, "sequential")
        assert err < 1e-5


def test_tuned_table_keeps_the_sequence_unless_clearly_beaten() -> None:
    from bench.gemm_collective import TUNE_MARGIN, OverlapRecord, tuned_overlap_table

    def rec(variant: str, t: float, m: int) -> OverlapRecord:
        return OverlapRecord("gemm_all_reduce", m, 8, 8, "bfloat16", 2, "cuda:0", variant, t, 1.0, 1.0, 100.0, 1.0,
                             0.0, t / 100.0, 0)

    records = [rec("sequential", 100.0, 64), rec("chunked/4", 100.0 * TUNE_MARGIN + 0.5, 64),
               rec("sequential", 100.0, 4096), rec("chunked/2", 80.0, 4096), rec("chunked/8", 70.0, 4096),
               rec("sequential", 100.0, 8192), rec("copy_engine/4", 80.0, 8192), rec("tile_signal/8", 75.0, 8192),
               rec("auto", 60.0, 8192)]  # auto is never a table's entry
    table = tuned_overlap_table(records, {"world": 2})
    got = {(e["M"], e["strategy"], e["chunks"]) for e in table["entries"]}
    assert got == {(64, "sequential", 1), (4096, "chunked", 8), (8192, "tile_signal", 8)}
    assert not any(e["graph"] for e in table["entries"])
    assert all(e["graph"] for e in tuned_overlap_table(records, {"world": 2}, graph=True)["entries"])


def test_auto_follows_the_entries_of_its_mode() -> None:
    # N=16: eager runs the sequence at M=4096 (host cost), graph replay copy_engine/2; N=32 has
    # only an eager entry, which graph capture falls back to
    def entry(m: int, n: int, graph: bool, strategy: str, chunks: int) -> dict[str, object]:
        return {"op": "gemm_all_reduce", "dtype": "bfloat16", "M": m, "K": 8, "N": n, "graph": graph,
                "strategy": strategy, "chunks": chunks}

    table = {"meta": {"world": 2}, "entries": [entry(4096, 16, False, "sequential", 1),
                                               entry(4096, 16, True, "copy_engine", 2),
                                               entry(64, 32, False, "chunked", 3)]}
    comm = SimpleNamespace(size=2)
    ops.set_tuned(table)
    try:
        def pick(m: int, n: int, graph: bool) -> Any:
            return ops._from_table("gemm_all_reduce", comm, torch.bfloat16, m, 8, n, graph)  # type: ignore[arg-type]

        assert (pick(4096, 16, False).strategy, pick(4096, 16, True).strategy) == ("sequential", "copy_engine")
        assert pick(4000, 16, True).chunks == 2 and "(graph)" in pick(4000, 16, True).reason
        assert (pick(64, 32, True).strategy, pick(64, 32, True).chunks) == ("chunked", 3)
        assert pick(64, 48, True) is None  # nothing measured at this N
    finally:
        ops.set_tuned(None)
