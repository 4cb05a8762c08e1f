"""``sequential``: the GEMM, then the collective through ``collectives`` (whose ``auto`` picks its
algorithm). The baseline, and what ``auto`` runs wherever overlap is not known to pay."""

from __future__ import annotations

from typing import Any

import torch

import collectives as C

from .base import OverlapStrategy

__all__ = ["Sequential"]


class Sequential(OverlapStrategy):
    name = "sequential"
    chunked = False

    def gemm_all_reduce(self, comm: C.Communicator, a: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
        out = torch.matmul(a, b)
        C.all_reduce(out, group=comm.group)
        return out

    def gemm_reduce_scatter(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor,
                            chunks: int) -> torch.Tensor:
        full = torch.matmul(rows, b)
        out = full.new_empty((rows.shape[0] // comm.size, b.shape[1]))
        C.reduce_scatter_single(out, full, group=comm.group)
        return out

    def all_gather_gemm(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor, chunks: int,
                        keep_gathered: bool) -> tuple[torch.Tensor, Any]:
        full = rows.new_empty((rows.shape[0] * comm.size, rows.shape[1]))
        C.all_gather_single(full, rows, group=comm.group)
        return torch.matmul(full, b), full
