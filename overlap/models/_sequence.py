"""Sequence parallelism for a ``transformers`` model: the residual stream split along the sequence.

Hugging Face's activations are ``[batch, seq, hidden]`` and its attention sizes its views from the
shape of its input, so the split is at module boundaries, along dimension 1, and only in a forward
whose sequence divides the group (a prefill or training step; a decode step of one token runs
as without it, the same modules unsplit):

- the embedding's output (whole on every rank: the model builds its mask and positions from it) is
  sliced at the first decoder layer's input; each rank's layers then carry ``seq / p`` positions:
  the norms and the residual adds run on that rank's positions alone;
- the attention and the MLP gather their input along the sequence (forward all-gather); their
  column-parallel layers all-reduce the input gradient, which is then whole on every rank, and the
  gather's backward keeps this rank's positions of it;
- o and down are ``SequenceRowParallelLinear``: ``gemm_reduce_scatter`` along the sequence (the
  partial sums reduced and split in one overlapped operation) instead of ``gemm_all_reduce``;
- a MoE block's output (whole on every rank) is sliced like the embedding's;
- the final norm's output is gathered, so the LM head, the loss and ``generate()`` see every position.

What it saves is activation memory: the norms' and residuals' activations are ``1/p``. It moves
more, not less: forward, an all-gather before each block and a reduce-scatter after it (together
an all-reduce's bytes); backward, the reduce-scatter's all-gather on top of the column layers'
all-reduce of the input gradient, where Megatron-LM reduce-scatters that gradient instead (half
its bytes): about 1.5x the unsplit layers' backward traffic. Not yet: that reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import collectives as C
from collectives import functional as F

from ..layers import RowParallelLinear, _SumGradOverRanks
from ..ops import gemm_reduce_scatter

__all__ = ["SequenceRowParallelLinear", "SequenceSplit", "split_sequence"]


class SequenceSplit:
    """Whether the forward under way runs sequence-parallel over ``group`` (``active``, set at the
    first layer), and whether the backward under way is one of such a forward (``summing``: set by
    the final norm's gather, the first split operation a backward meets, and cleared by the first
    layer's slice, the last; read by the norms' gradient hooks). The backward's own flag, not the
    forward's, so that forwards in between (an evaluation, a decode step) change nothing."""

    def __init__(self, group: Any) -> None:
        self.group, self.world, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.active = False
        self.summing = False


class _Slice(torch.autograd.Function):
    """Forward: this rank's positions of a whole ``[b, s, ...]``; backward: the ranks' gradients gathered."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: SequenceSplit, last: bool = False) -> torch.Tensor:
        ctx.split, ctx.last = split, last
        n = x.shape[1] // split.world
        return x[:, split.rank * n:(split.rank + 1) * n].contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        if ctx.last:  # the first layer's input: this backward's split operations are done
            ctx.split.summing = False
        with torch.no_grad():
            return F.all_gather_tensor(g.contiguous(), 1, ctx.split.group), None, None


class _Gather(torch.autograd.Function):
    """Forward: the ranks' positions gathered into the whole; backward: this rank's positions of a
    gradient that is whole and the same on every rank already (after q, k, v or gate and up, summed
    by the column layers' all-reduce; after a MoE block, computed the same on every rank from the
    gathered gradient of its sliced output; after the final norm, the LM head's all-reduce)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split: SequenceSplit, first: bool = False) -> torch.Tensor:
        ctx.split, ctx.n, ctx.first = split, x.shape[1], first
        with torch.no_grad():
            return F.all_gather_tensor(x.contiguous(), 1, split.group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        if ctx.first:  # the final norm's output: a backward of a split forward begins
            ctx.split.summing = True
        r, n = ctx.split.rank, ctx.n
        return g[:, r * n:(r + 1) * n].contiguous(), None, None


def _first(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, bool]:
    if args:
        return args[0], True
    return kwargs["hidden_states"], False


def _with_first(args: tuple[Any, ...], kwargs: dict[str, Any], x: torch.Tensor, positional: bool) -> Any:
    if positional:
        return (x, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": x}


def _enter(split: SequenceSplit) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x, positional = _first(args, kwargs)
        split.active = x.shape[1] % split.world == 0
        return _with_first(args, kwargs, _Slice.apply(x, split, True), positional) if split.active else None
    return hook


def _gather_input(split: SequenceSplit) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not split.active:
            return None
        x, positional = _first(args, kwargs)
        return _with_first(args, kwargs, _Gather.apply(x, split), positional)
    return hook


def _gather_output(split: SequenceSplit) -> Any:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> Any:
        return _Gather.apply(out, split, True) if split.active else None
    return hook


def _slice_output(split: SequenceSplit) -> Any:
    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        if not split.active:
            return None
        if isinstance(out, tuple):  # a block that returns (hidden, router logits)
            return (_Slice.apply(out[0], split), *out[1:])
        return _Slice.apply(out, split)
    return hook


class SequenceRowParallelLinear(RowParallelLinear):
    """A row-parallel layer whose output, in a sequence-parallel forward, is reduce-scattered along
    the sequence (dimension 1 of ``[b, s, in]``); otherwise all-reduced, as ``RowParallelLinear``."""

    split: SequenceSplit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.split.active:
            return super().forward(x)
        y = gemm_reduce_scatter(x, self.weight.t(), self.group, scatter_dim=1, strategy=self.strategy,
                                chunks=self.chunks)
        return y if self.bias is None else y + _SumGradOverRanks.apply(self.bias, self.group)


def summed_over(group: Any, when: Callable[[], bool] | None = None) -> Any:
    """A gradient hook: the sum of the ranks' gradients over ``group`` (each rank's is the part
    its heads or positions gave); with ``when``, only while ``when()`` holds, else the gradient as
    it is (every rank saw every position)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if when is not None and not when():
            return grad
        total = grad.contiguous().clone()
        C.all_reduce(total, group=group)
        return total
    return hook


def split_sequence(model: Any, family: Any, split: SequenceSplit) -> None:
    """Put the hooks above on a tensor-parallel ``model`` whose row-parallel layers are
    ``SequenceRowParallelLinear`` of ``split`` (see the module docstring). The parameters that
    see a rank's positions alone (the layers' norms, the final norm) get their gradients summed
    over the group in the backward of a sequence-parallel forward (``SequenceSplit.summing``)."""
    layers = family.layers(model)
    layers[0].register_forward_pre_hook(_enter(split), with_kwargs=True)
    inside = (f"{family.attention}.", f"{family.mlp}.")
    positional = [p for layer in layers for n, p in layer.named_parameters() if not n.startswith(inside)]
    for p in (*positional, *model.get_submodule(family.final_norm).parameters()):
        p.register_hook(summed_over(split.group, lambda: split.summing))
    for layer in layers:
        family.module(layer, family.attention).register_forward_pre_hook(_gather_input(split), with_kwargs=True)
        mlp = family.module(layer, family.mlp)
        mlp.register_forward_pre_hook(_gather_input(split), with_kwargs=True)
        if family.moe_block(layer) is not None:
            mlp.register_forward_hook(_slice_output(split))
    model.get_submodule(family.final_norm).register_forward_hook(_gather_output(split))
