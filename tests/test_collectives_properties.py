"""Property-based cases: random sizes and all-to-all splits, every algorithm, at world size 3."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import collectives as C
from bench.reference import expected, rank_data
from collectives.algos import REGISTRY, for_op

WORLD = 3


def body_sizes(rank: int, world: int, n: int, seed: int) -> list[str]:
    fails = []
    xs = [rank_data(q, n, torch.float64, seed) for q in range(world)]
    for algo in for_op("all_reduce", backend="gloo"):
        x = xs[rank].clone()
        C.all_reduce(x, algorithm=algo)
        if not torch.allclose(x, expected("all_reduce", xs, rank), rtol=1e-12, atol=1e-12):
            fails.append(f"all_reduce {algo} n={n}")
    for algo in for_op("all_gather", backend="gloo"):
        out = torch.full((n * world,), float("nan"), dtype=torch.float64)
        C.all_gather_single(out, xs[rank], algorithm=algo)
        if not torch.equal(out, expected("all_gather", xs, rank)):
            fails.append(f"all_gather {algo} n={n}")
    ys = [rank_data(q, n * world, torch.float64, seed + 1) for q in range(world)]
    for algo in for_op("reduce_scatter", backend="gloo"):
        out = torch.full((n,), float("nan"), dtype=torch.float64)
        C.reduce_scatter_single(out, ys[rank].clone(), algorithm=algo)
        if not torch.allclose(out, expected("reduce_scatter", ys, rank), rtol=1e-12, atol=1e-12):
            fails.append(f"reduce_scatter {algo} n={n}")
    return fails


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(n=st.integers(0, 3000), seed=st.integers(0, 10_000))
def test_any_size(n: int, seed: int) -> None:
    from tests.conftest import get_world

    for fails in get_world(WORLD).run(body_sizes, n, seed):
        assert not fails, fails


def body_splits(rank: int, world: int, m: list[list[int]], row: int, seed: int) -> list[str]:
    fails = []
    xs = [rank_data(q, sum(m[q]) * row, torch.float32, seed) for q in range(world)]
    ref = expected("all_to_all", xs, rank, splits=m, row=row)
    out_rows = [m[q][rank] for q in range(world)]
    for algo in for_op("all_to_all", backend="gloo"):
        uneven = len({v for r in m for v in r}) > 1
        if REGISTRY[algo].equal_splits_only and uneven:
            continue
        out = torch.full((sum(out_rows), row), float("nan"))
        C.all_to_all_single(out, xs[rank].view(-1, row), out_rows, m[rank], algorithm=algo)
        if not torch.equal(out.view(-1).double(), ref):
            fails.append(f"{algo} splits={m}")
    return fails


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(m=st.lists(st.lists(st.integers(0, 9), min_size=WORLD, max_size=WORLD), min_size=WORLD, max_size=WORLD),
       row=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_any_splits(m: list[list[int]], row: int, seed: int) -> None:
    from tests.conftest import get_world

    for fails in get_world(WORLD).run(body_splits, m, row, seed):
        assert not fails, fails
