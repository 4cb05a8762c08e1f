"""Functional collectives: each returns a new tensor and leaves its input alone, and is differentiable.

The names, argument order and meaning are ``torch.distributed._functional_collectives``'s
(``group`` may be left out for the default group; ``algorithm=`` is ours)::

    from collectives import functional as F
    y = F.all_reduce(x, "sum", group)                       # x is unchanged
    shard = F.reduce_scatter_tensor(x, "sum", 0, group)     # dim 0 divided by the group size
    full = F.all_gather_tensor(shard, 0, group)             # dim 0 multiplied by it
    rows = F.all_to_all_single(x, out_splits, in_splits, group)
    z = F.broadcast(x, 0, group)                            # from group rank 0

Each is the op ``torch.ops.commops.<name>`` (``collectives/_ops.py`` says how gradients flow),
which ``torch.compile`` keeps in its graph; eagerly, a call that autograd need not record runs
the op's implementation directly, without the dispatcher's round trip. Unlike torch's, the
result is complete when returned (on GPUs: ordered on the current stream), not a tensor to wait on.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _ops, _traced
from ._traced import group_name, group_size

__all__ = ["all_reduce", "reduce_scatter_tensor", "all_gather_tensor", "all_to_all_single", "broadcast"]

_compiling = torch.compiler.is_compiling


def _direct(t: torch.Tensor) -> bool:
    """Whether to run the implementation without the op: eager, and nothing for autograd to record."""
    return not _compiling() and not (t.requires_grad and torch.is_grad_enabled())


def _name(op: Any) -> str:
    return _traced._op_name(op)


def all_reduce(input: torch.Tensor, op: Any = "sum", group: Any = None, *, algorithm: str = "auto") -> torch.Tensor:
    """A new tensor, ``input`` reduced across the group's ranks (same shape and dtype on every rank).

    Differentiable for "sum" (the gradient is all-reduced) and "avg" (averaged)."""
    if _direct(input):
        return _ops._all_reduce(input, _name(op), group_name(group), algorithm)
    return torch.ops.commops.all_reduce(input, _name(op), group_name(group), algorithm)


def reduce_scatter_tensor(input: torch.Tensor, op: Any = "sum", scatter_dim: int = 0, group: Any = None, *,
                          algorithm: str = "auto") -> torch.Tensor:
    """This rank's block of ``input`` reduced across ranks: dimension ``scatter_dim`` (a multiple
    of the group's size) divided by the group's size, group rank r taking the r-th block.

    Differentiable for "sum" and "avg" (the gradient is all-gathered)."""
    args = (input, _name(op), scatter_dim, group_size(group), group_name(group), algorithm)
    if _direct(input):
        return _ops._reduce_scatter_tensor(*args)
    return torch.ops.commops.reduce_scatter_tensor(*args)


def all_gather_tensor(input: torch.Tensor, gather_dim: int = 0, group: Any = None, *,
                      algorithm: str = "auto") -> torch.Tensor:
    """Every rank's ``input`` joined along ``gather_dim`` in group-rank order (that dimension
    multiplied by the group's size). Differentiable (the gradient is reduce-scattered)."""
    args = (input, gather_dim, group_size(group), group_name(group), algorithm)
    if _direct(input):
        return _ops._all_gather_tensor(*args)
    return torch.ops.commops.all_gather_tensor(*args)


def all_to_all_single(input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: Any = None, *,
                      algorithm: str = "auto") -> torch.Tensor:
    """Rows of ``input`` (dim 0) exchanged: ``input_split_sizes[q]`` go to group rank q,
    ``output_split_sizes[q]`` arrive from it, in rank order (None: dim 0 split evenly).
    Differentiable (the gradient goes back with the splits swapped)."""
    out_splits = None if output_split_sizes is None else list(output_split_sizes)
    in_splits = None if input_split_sizes is None else list(input_split_sizes)
    if _direct(input):
        return _ops._all_to_all_single(input, out_splits, in_splits, group_name(group), algorithm)
    return torch.ops.commops.all_to_all_single(input, out_splits, in_splits, group_name(group), algorithm)


def broadcast(input: torch.Tensor, src: int, group: Any = None, *, algorithm: str = "auto") -> torch.Tensor:
    """A new tensor holding group rank ``src``'s ``input`` on every rank (``src`` counts in
    ``group``, as in torch's functional broadcast). Differentiable (the source's gradient is
    the sum of every rank's; the others' is zero)."""
    if _direct(input):
        return _ops._broadcast(input, src, group_name(group), algorithm)
    return torch.ops.commops.broadcast(input, src, group_name(group), algorithm)
