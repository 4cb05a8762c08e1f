"""Deterministic per-rank inputs, float64 expected outputs and tolerances for every collective.

Every rank can regenerate every other rank's input from ``(seed, rank)``, so the expected output
is computed locally, in float64, without extra communication (as nccl-tests does), and it never
comes from the code under test. Tolerances are a rounding-error bound: ``eps(dtype) * (world + 1)``
times the magnitude of the terms (sum of ``|x|`` for sums and averages, ``|result|`` for
products), zero for max, min, integers and data movement.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["rank_data", "split_matrix", "expected", "tolerance", "count_wrong"]


def _generator(seed: int, rank: int, device: torch.device | str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed * 100_003 + rank * 7_919 + 1)
    return g


def rank_data(rank: int, numel: int, dtype: torch.dtype, seed: int, device: torch.device | str = "cpu",
              reduce_op: str = "sum") -> torch.Tensor:
    """Rank ``rank``'s input: fresh random values (never zeros), exactly representable in ``dtype``."""
    g = _generator(seed, rank, device)
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g, device=device, dtype=torch.float32)
        if reduce_op == "prod":  # keep products of a few ranks far from under/overflow
            x = x.sign() * (0.5 + x.abs().clamp(max=1.5))
        return x.to(dtype)
    hi = 4 if reduce_op == "prod" else 50
    return torch.randint(-hi + 1, hi, (numel,), generator=g, device=device, dtype=torch.int64).to(dtype)


def split_matrix(world: int, seed: int, pattern: str, rows_per_rank: int) -> list[list[int]]:
    """``m[src][dst]``: rows rank ``src`` sends to ``dst`` in an all-to-all.

    Patterns: ``even``; ``uneven`` (random, with zero-length parts); ``one_hot`` (every rank sends
    all of its rows to rank 0).
    """
    if pattern == "even":
        return [[rows_per_rank] * world for _ in range(world)]
    if pattern == "one_hot":
        return [[rows_per_rank * world if d == 0 else 0 for d in range(world)] for _ in range(world)]
    if pattern == "uneven":
        g = torch.Generator().manual_seed(seed)
        m = torch.randint(0, 2 * rows_per_rank + 1, (world, world), generator=g)
        m[torch.rand(world, world, generator=g) < 0.3] = 0
        return m.tolist()
    raise ValueError(pattern)


def expected(op: str, inputs: Sequence[torch.Tensor], rank: int, reduce_op: str = "sum", root: int = 0,
             splits: Sequence[Sequence[int]] | None = None, row: int = 1) -> torch.Tensor:
    """Float64 expected output of ``rank`` given every rank's (flat) input.

    ``all_to_all`` takes ``splits[src][dst]`` in rows of ``row`` elements; ``broadcast``/``reduce``
    take ``root`` as a group rank (``reduce`` returns the root's expected tensor on every rank).
    """
    xs = [x.to(torch.float64) for x in inputs]
    world = len(xs)
    if op in ("all_reduce", "reduce", "reduce_scatter"):
        stack = torch.stack(xs)
        if reduce_op in ("sum", "avg"):
            full = stack.sum(0) / (world if reduce_op == "avg" else 1)
        elif reduce_op == "prod":
            full = stack.prod(0)
        elif reduce_op == "max":
            full = stack.max(0).values
        else:
            full = stack.min(0).values
        if op == "reduce_scatter":
            n = full.numel() // world
            return full[rank * n:(rank + 1) * n]
        return full
    if op == "all_gather":
        return torch.cat(xs)
    if op == "broadcast":
        return xs[root]
    if op == "all_to_all":
        assert splits is not None
        parts = []
        for src in range(world):
            start = sum(splits[src][:rank]) * row
            parts.append(xs[src][start:start + splits[src][rank] * row])
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    raise ValueError(op)


def tolerance(op: str, inputs: Sequence[torch.Tensor], rank: int, dtype: torch.dtype, reduce_op: str = "sum",
              root: int = 0) -> torch.Tensor | float:
    """Per-element bound on ``|out - expected|`` for a correct implementation."""
    if not dtype.is_floating_point or op not in ("all_reduce", "reduce", "reduce_scatter") or reduce_op in ("max", "min"):
        return 0.0
    world = len(inputs)
    fi = torch.finfo(dtype)
    eps = fi.eps * (world + 1)
    if reduce_op == "prod":
        mag = expected(op, inputs, rank, "prod", root).abs()
    else:
        mag = expected(op, [x.abs() for x in inputs], rank, "sum", root)
        if reduce_op == "avg":
            mag = mag / world
    return eps * mag + fi.smallest_normal * world


def count_wrong(out: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor | float) -> int:
    """nccl-tests' ``#wrong``: elements farther than ``tol`` from ``ref`` (NaN is always wrong)."""
    diff = (out.reshape(-1).to(torch.float64) - ref.reshape(-1).to(torch.float64)).abs()
    ok = diff <= tol
    return int(ok.numel() - int(ok.sum()))
