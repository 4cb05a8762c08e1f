"""A new overlap strategy is one module and one registry line: a strategy defined here (each
collective on its own, the GEMM's row blocks in reverse order, on the plain verbs), registered
with ``register_strategy``, runs all three operators and their autograd through
``overlap/ops.py`` unchanged, against the same float64 references as the shipped strategies."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import collectives as C
from overlap import ops
from overlap.strategies import REGISTRY, OverlapStrategy, register_strategy, unregister_strategy
from tests.test_overlap_ops import _case_all_gather, _case_all_reduce, _case_reduce_scatter


class _Backwards(OverlapStrategy):
    """Row blocks in reverse order, one blocking collective each (a strategy a test can tell apart)."""

    name = "backwards"

    def gemm_all_reduce(self, comm: C.Communicator, a: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
        out = a.new_empty((a.shape[0], b.shape[1]))
        for block in reversed(torch.arange(a.shape[0]).tensor_split(chunks)):
            if block.numel():
                part = a[block] @ b
                C.all_reduce(part, group=comm.group)
                out[block] = part
        return out

    def gemm_reduce_scatter(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor,
                            chunks: int) -> torch.Tensor:
        full = rows @ b
        out = full.new_empty((rows.shape[0] // comm.size, b.shape[1]))
        C.reduce_scatter_single(out, full.contiguous(), group=comm.group)
        return out

    def all_gather_gemm(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor, chunks: int,
                        keep_gathered: bool) -> tuple[torch.Tensor, Any]:
        full = rows.new_empty((rows.shape[0] * comm.size, rows.shape[1]))
        C.all_gather_single(full, rows.contiguous(), group=comm.group)
        return full @ b, full


def _with_strategy(rank: int, world: int, case: Any, *args: Any) -> float:
    register_strategy(_Backwards())
    try:
        err = case(rank, world, "backwards", *args)
        assert ops.last_choice().strategy == "backwards"  # type: ignore[union-attr]
        return err  # type: ignore[no-any-return]
    finally:
        unregister_strategy("backwards")


def test_the_shipped_strategies_are_registered() -> None:
    assert list(REGISTRY) == ["sequential", "chunked", "copy_engine", "tile_signal"] == list(ops.STRATEGIES)
    with pytest.raises(ValueError, match="taken"):
        register_strategy(REGISTRY["chunked"])


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_registered_strategy_runs_every_operator(worlds, world_size: int) -> None:  # noqa: ANN001
    w = worlds(world_size)
    errs = w.run(_with_strategy, _case_all_reduce, 3, (2, 7), 501)
    assert max(errs) < 1e-4, errs
    errs = w.run(_with_strategy, _case_reduce_scatter, 2, (3, 2 * world_size), 1, 502)
    assert max(errs) < 1e-4, errs
    errs = w.run(_with_strategy, _case_all_gather, 2, (3, 2), 1, 503)
    assert max(errs) < 1e-4, errs
