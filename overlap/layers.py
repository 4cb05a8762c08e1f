"""Tensor-parallel linear layers with Megatron-LM's semantics, built on the overlap operators.

``ColumnParallelLinear`` keeps rows ``r * out/p ... (r+1) * out/p - 1`` of the full weight
(``[out, in]``) on rank r and produces that slice of the output features; ``RowParallelLinear``
keeps columns ``r * in/p ...`` and sums the ranks' partial products. With
``sequence_parallel=True`` activations outside the pair are split along the sequence dimension
(dimension 0, Megatron's ``[s, b, h]`` layout): the column layer all-gathers its input
(``all_gather_gemm``) and the row layer reduce-scatters its output (``gemm_reduce_scatter``),
each overlapped with its GEMM and, in the backward pass, with the gradient's GEMM. Without it,
the row layer all-reduces (``gemm_all_reduce``) and the column layer's backward all-reduces the
input gradient while the weight gradient is computed.

``strategy`` is passed to the operators ("auto", "sequential", "chunked", "copy_engine"). Gradients follow the
tensor-parallel convention: a replicated output's loss is counted once; the bias of a row layer
under sequence parallelism gets its gradient summed over ranks here (Megatron leaves that to
the trainer), so that the layer pair's gradients equal the unsharded module's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import collectives as C
from collectives.errors import InvalidArgumentError

from .moe.layer import MoELayer
from .norm import fused_all_reduce_rmsnorm
from .ops import DEFAULT_CHUNKS, all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "MoELayer"]


def _divide(name: str, n: int, world: int) -> int:
    if n % world:
        raise InvalidArgumentError(name, n, f"is not divisible by the tensor-parallel size {world}",
                                   f"use a multiple of {world}")
    return n // world


class _LinearAllReduceGrad(torch.autograd.Function):
    """``x @ w.T + b`` whose backward all-reduces the input gradient while the weight gradient is computed."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, group: Any) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.group, ctx.has_bias = group, b is not None
        y = torch.matmul(x, w.t())
        return y if b is None else y + b

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        gx = torch.matmul(g, w)
        work = C.all_reduce(gx, group=ctx.group, async_op=True)
        g2 = g.reshape(-1, g.shape[-1])
        gw = g2.t() @ x.reshape(-1, x.shape[-1])
        gb = g2.sum(0) if ctx.has_bias else None
        if work is not None:
            work.wait()
        return gx, gw, gb, None


class _ScatterLastDim(torch.autograd.Function):
    """Forward: this rank's slice of the last dimension; backward: all-gather of the slices."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        # torch.distributed's rank queries, not the communicator's: torch.compile reads them as constants
        rank, ctx.world = dist.get_rank(group), dist.get_world_size(group)
        ctx.group = group
        n = x.shape[-1] // ctx.world
        return x[..., rank * n:(rank + 1) * n].contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        parts = g.movedim(-1, 0).contiguous()
        full = parts.new_empty((parts.shape[0] * ctx.world, *parts.shape[1:]))
        C.all_gather_single(full, parts, group=ctx.group)
        return full.movedim(0, -1), None


class _GatherLastDim(torch.autograd.Function):
    """Forward: all-gather of the ranks' slices of the last dimension; backward: this rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank, ctx.n = dist.get_rank(group), x.shape[-1]
        parts = x.movedim(-1, 0).contiguous()
        full = parts.new_empty((parts.shape[0] * dist.get_world_size(group), *parts.shape[1:]))
        C.all_gather_single(full, parts, group=group)
        return full.movedim(0, -1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g[..., ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient (a parameter used on every rank's slice)."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        g = g.contiguous()
        C.all_reduce(g, group=ctx.group)
        return g, None


class ColumnParallelLinear(nn.Module):
    """``Y = X W^T + b`` with ``W``'s rows (output features) split across the group's ranks.

    The weight is initialised like ``nn.Linear``'s full weight and sliced: the ranks' slices form
    one layer when every rank seeds its generator alike (or use ``from_linear``).

    Args:
        in_features, out_features: the full layer's sizes; ``out_features`` divisible by the group's size.
        bias: keep this rank's slice of a bias.
        group: the tensor-parallel group (default: world).
        gather_output: all-gather the output features, so every rank gets ``[..., out_features]``;
            otherwise the output is this rank's ``[..., out_features / p]`` (for a ``RowParallelLinear``).
        sequence_parallel: the input is this rank's slice of dimension 0 (sequence) and is
            all-gathered, overlapped with the GEMM.
        strategy, chunks: passed to the overlap operators.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group: Any = None,
                 gather_output: bool = False, sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: Any = None, strategy: str = "auto", chunks: int = DEFAULT_CHUNKS,
                 _skip_init: bool = False) -> None:
        super().__init__()
        comm = C.get_communicator(group)
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.out_per_rank = _divide("out_features", out_features, comm.size)
        self.gather_output, self.sequence_parallel = gather_output, sequence_parallel
        self.strategy, self.chunks = strategy, chunks
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(self.out_per_rank, dtype=dtype, device=device)) if bias else None
        if not _skip_init:  # (from_linear copies the weights in: no full random matrix to make and slice)
            self._init(comm)

    def _init(self, comm: C.Communicator) -> None:
        # nn.Linear's initialisation of the full layer, then this rank's rows (equal on every
        # rank count for the same seed).
        bound = 1 / math.sqrt(self.in_features)
        full = torch.empty(self.out_features, self.in_features, dtype=self.weight.dtype, device=self.weight.device)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        rows = slice(comm.rank * self.out_per_rank, (comm.rank + 1) * self.out_per_rank)
        with torch.no_grad():
            self.weight.copy_(full[rows])
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None, **options: Any) -> ColumnParallelLinear:
        """This rank's shard of ``linear`` (same on every rank): its rows of the weight and bias."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    dtype=linear.weight.dtype, device=linear.weight.device, _skip_init=True, **options)
        r, n = C.get_communicator(group).rank, layer.out_per_rank
        with torch.no_grad():
            layer.weight.copy_(linear.weight[r * n:(r + 1) * n])
            if layer.bias is not None and linear.bias is not None:
                layer.bias.copy_(linear.bias[r * n:(r + 1) * n])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = all_gather_gemm(x, self.weight.t(), self.group, gather_dim=0, strategy=self.strategy,
                                chunks=self.chunks)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = _LinearAllReduceGrad.apply(x, self.weight, self.bias, self.group)
        return _GatherLastDim.apply(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} ({self.out_per_rank} here), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}, strategy={self.strategy!r}")


class RowParallelLinear(nn.Module):
    """``Y = X W^T + b`` with ``W``'s columns (input features) split across the group's ranks.

    Args:
        in_features, out_features: the full layer's sizes; ``in_features`` divisible by the group's size.
        bias: a full bias, added once after the ranks' partial products are summed.
        group: the tensor-parallel group (default: world).
        input_is_parallel: the input is this rank's ``[..., in_features / p]`` (a
            ``ColumnParallelLinear``'s output); otherwise the full input, sliced here.
        sequence_parallel: reduce-scatter the output along dimension 0 (sequence) instead of
            all-reducing it, overlapped with the GEMM.
        strategy, chunks: passed to the overlap operators.

    Construction is collective: the bias is initialised on rank 0 and broadcast.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group: Any = None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: Any = None, strategy: str = "auto", chunks: int = DEFAULT_CHUNKS,
                 _skip_init: bool = False) -> None:
        super().__init__()
        comm = C.get_communicator(group)
        self.group, self.in_features, self.out_features = group, in_features, out_features
        self.in_per_rank = _divide("in_features", in_features, comm.size)
        self.input_is_parallel, self.sequence_parallel = input_is_parallel, sequence_parallel
        self.strategy, self.chunks = strategy, chunks
        # True: forward returns this rank's partial product, unreduced and without the bias, for a
        # caller that reduces it itself (the decoder layers' fused norm, overlap/models/_decode.py)
        self.deferred = False
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        if not _skip_init:  # (from_linear copies the weights in: no full matrix, no bias broadcast)
            self._init(comm)

    def _init(self, comm: C.Communicator) -> None:
        in_features = self.in_features
        bound = 1 / math.sqrt(in_features)
        full = torch.empty(self.out_features, in_features, dtype=self.weight.dtype, device=self.weight.device)
        nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        with torch.no_grad():
            self.weight.copy_(full[:, comm.rank * self.in_per_rank:(comm.rank + 1) * self.in_per_rank])
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)
                if dist.get_world_size(self.group) > 1:  # one bias for all ranks: rank 0's
                    C.broadcast(self.bias.data, group=self.group, group_src=0)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Any = None, **options: Any) -> RowParallelLinear:
        """This rank's shard of ``linear`` (same on every rank): its columns of the weight, the whole bias."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                    dtype=linear.weight.dtype, device=linear.weight.device, _skip_init=True, **options)
        r, n = C.get_communicator(group).rank, layer.in_per_rank
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, r * n:(r + 1) * n])
            if layer.bias is not None and linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = _ScatterLastDim.apply(x, self.group)
        if self.deferred:
            return torch.nn.functional.linear(x, self.weight)
        if self.sequence_parallel:
            y = gemm_reduce_scatter(x, self.weight.t(), self.group, scatter_dim=0, strategy=self.strategy,
                                    chunks=self.chunks)
            return y if self.bias is None else y + _SumGradOverRanks.apply(self.bias, self.group)
        return gemm_all_reduce(x, self.weight.t(), self.group, bias=self.bias, strategy=self.strategy,
                               chunks=self.chunks)

    def forward_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        """``r = self(x) + residual`` and ``y = rms_norm(r) * norm_weight``, returned as ``(y, r)``:
        a pre-norm block's output projection, residual add and the next norm. Without sequence
        parallelism the partial products, the bias and the residual go into one
        ``fused_all_reduce_rmsnorm`` (``strategy="auto"``: one kernel at decode sizes on the GPUs of
        one node; ``overlap.last_choice`` says which ran); with it, the reduce-scatter and then
        torch's add and ``rms_norm`` on this rank's positions."""
        if self.sequence_parallel:
            r = self(x) + residual
            return torch.nn.functional.rms_norm(r, (r.shape[-1],), norm_weight, eps), r
        if not self.input_is_parallel:
            x = _ScatterLastDim.apply(x, self.group)
        return self.reduce_rmsnorm(torch.nn.functional.linear(x, self.weight), residual, norm_weight, eps)

    def reduce_rmsnorm(self, partial: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                       eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_rmsnorm``'s second half, from this rank's partial products (what ``forward``
        returns while ``deferred``): their all-reduce, the bias and the residual added, normed."""
        if self.bias is not None:  # added once, after the reduction: into the residual
            residual = residual + self.bias
        return fused_all_reduce_rmsnorm(partial, residual, norm_weight, eps, self.group)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} here), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}, strategy={self.strategy!r}")
