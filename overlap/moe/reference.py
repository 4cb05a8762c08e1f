"""The single-process definition of a mixture of experts, which every MoE path is checked against.

Design note. Plain loops over the chosen experts, one ``index_add`` per (slot, expert): slow and
obviously right, in whatever dtype the caller passes (the tests pass float64).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["reference_moe"]


def reference_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                  expert: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The single-process definition: ``out[t] = sum_j topk_weights[t, j] * expert(topk_idx[t, j], x[t])``."""
    out = torch.zeros_like(x)
    for j in range(topk_idx.shape[1]):
        for e in topk_idx[:, j].unique().tolist():
            rows = (topk_idx[:, j] == e).nonzero().squeeze(1)
            out = out.index_add(0, rows, topk_weights[rows, j:j + 1].to(x.dtype) * expert(int(e), x[rows]))
    return out
