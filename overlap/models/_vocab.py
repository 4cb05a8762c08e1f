"""The vocabulary-parallel embedding: rank r keeps rows ``r * V/p ... (r+1) * V/p - 1`` of the table.

Forward: each rank looks up the ids in its rows (the others give zeros) and the ranks' partial
embeddings are summed (an all-reduce); backward: the gradient of the summed embedding reaches
each rank's rows unchanged (the tensor-parallel convention: every rank holds the same replicated
activations and counts their loss once). Megatron's ``VocabParallelEmbedding`` is the model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import collectives as C
from collectives.errors import InvalidArgumentError

__all__ = ["VocabParallelEmbedding", "reduce_from_group"]


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: the sum over the group's ranks (a new tensor); backward: the gradient as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        y = x.contiguous().clone()
        C.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g, None


def reduce_from_group(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    """``all_reduce(x)`` (sum) as a new tensor whose backward passes the gradient through: for a
    partial result of each rank whose sum every rank then uses alike (``_ReduceFromGroup``)."""
    return _ReduceFromGroup.apply(x, group)  # type: ignore[no-any-return]


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` of ``num_embeddings`` rows split evenly over the group's ranks.

    Args:
        num_embeddings: the vocabulary, divisible by the group's size.
        embedding_dim: the width of a row.
        group: the tensor-parallel group (default: world).
        padding_idx: as ``nn.Embedding``'s (its row's gradient stays zero), or None.

    Input ``[...]`` integer ids, the same on every rank; output ``[..., embedding_dim]``, the same on
    every rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group: Any = None, padding_idx: int | None = None,
                 dtype: torch.dtype | None = None, device: Any = None) -> None:
        super().__init__()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if num_embeddings % world:
            raise InvalidArgumentError("num_embeddings", num_embeddings,
                                       f"is not divisible by the tensor-parallel size {world}",
                                       f"pad the vocabulary to a multiple of {world} (resize_token_embeddings)")
        self.group, self.num_embeddings, self.embedding_dim = group, num_embeddings, embedding_dim
        self.per_rank = num_embeddings // world
        self.start = rank * self.per_rank
        self.padding_idx = padding_idx
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim, dtype=dtype, device=device))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: Any = None) -> VocabParallelEmbedding:
        """This rank's rows of ``emb`` (the same table on every rank)."""
        layer = cls(emb.num_embeddings, emb.embedding_dim, group=group, padding_idx=emb.padding_idx,
                    dtype=emb.weight.dtype, device=emb.weight.device)
        with torch.no_grad():
            layer.weight.copy_(emb.weight[layer.start:layer.start + layer.per_rank])
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        rows = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.padding_idx is not None and self.start <= self.padding_idx < self.start + self.per_rank:
            # nn.Embedding's padding row: no gradient (its value is the checkpoint's)
            pad = ids == self.padding_idx
            rows = torch.where(pad.unsqueeze(-1), rows.detach(), rows)
        return reduce_from_group(rows, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.start}..{self.start + self.per_rank - 1} "
                f"here), padding_idx={self.padding_idx}")
