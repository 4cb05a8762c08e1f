"""k and v projections when the KV heads are fewer than the tensor-parallel ranks.

With ``p`` ranks and ``kv`` KV heads, ``kv < p`` and ``p % kv == 0``: rank r holds query heads
``r*H/p ... (r+1)*H/p - 1``, which all read KV head ``r // (p/kv)``, so each KV head is replicated
on ``p/kv`` consecutive ranks. ``replicated_kv_linear`` builds that rank's projection as a
``ColumnParallelLinear`` of the weight with each head's rows repeated ``p/kv`` times (rank r's
rows of it are its KV head's), so the forward and its backward's input-gradient all-reduce are the
column-parallel layer's own. Each of the ranks that share a head computes that head's weight
gradient from its own query heads alone; a hook sums them: each rank writes its gradient into its
head's slot of a ``[kv, ...]`` buffer of zeros, the buffer is all-reduced over the group, and the
rank keeps its slot (the group's ranks share no smaller group to reduce over).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import collectives as C

from ..layers import ColumnParallelLinear

__all__ = ["replicated_kv_linear"]


def _summed_with_sharers(group: Any, slot: int, heads: int) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        slots = grad.new_zeros((heads, *grad.shape))
        slots[slot] = grad
        C.all_reduce(slots, group=group)
        return slots[slot]
    return hook


def replicated_kv_linear(linear: nn.Linear, group: Any, kv_heads: int, **options: Any) -> ColumnParallelLinear:
    """This rank's KV head of ``linear`` (k_proj or v_proj, ``kv_heads`` heads, the same on every rank)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    share = world // kv_heads
    head_dim = linear.out_features // kv_heads
    repeated = nn.Linear(linear.in_features, head_dim * world, bias=linear.bias is not None,
                         dtype=linear.weight.dtype, device=linear.weight.device)
    with torch.no_grad():
        repeated.weight.copy_(linear.weight.view(kv_heads, head_dim, -1).repeat_interleave(share, 0).flatten(0, 1))
        if linear.bias is not None:
            repeated.bias.copy_(linear.bias.view(kv_heads, head_dim).repeat_interleave(share, 0).flatten())
    layer = ColumnParallelLinear.from_linear(repeated, group, **options)
    for p in layer.parameters():
        p.register_hook(_summed_with_sharers(group, rank // share, kv_heads))
    return layer
