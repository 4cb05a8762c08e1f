"""The contract of an overlap strategy: how one GEMM + collective operator runs.

Each operator of ``overlap/ops.py`` validates its operands, flattens them to rows and asks its
strategy for the result; the strategy owns everything between (the GEMM's chunks, the
collectives, their streams). Shapes here are 2-D: ``a``/``rows`` ``[M, K]``, ``b`` ``[K, N]``.
Every method is collective over ``comm``'s group; every rank calls it with the same strategy,
the same ``chunks`` and operands of the same shape, and every method returns new tensors
(its inputs are never written).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

import collectives as C

__all__ = ["OverlapStrategy"]


class OverlapStrategy:
    """One way of running ``gemm_all_reduce``, ``gemm_reduce_scatter`` and ``all_gather_gemm``."""

    name: ClassVar[str]
    # whether ``chunks`` applies (the sequence runs one piece whatever is asked)
    chunked: ClassVar[bool] = True

    def unavailable(self, comm: C.Communicator, device: torch.device, dtype: torch.dtype) -> str:
        """Why this strategy cannot run on ``comm`` for tensors of ``device``/``dtype``, or ``""``."""
        return ""

    def ready(self, comm: C.Communicator) -> bool:
        """Whether it can run inside a CUDA graph capture now (its buffers, if any, exist)."""
        return True

    def prepare(self, comm: C.Communicator) -> None:
        """Build what a later capture needs (collective: every rank calls it), or nothing."""

    def refuses(self, comm: C.Communicator, op: str, a: torch.Tensor, b: torch.Tensor, chunks: int) -> str:
        """Why this strategy cannot take ``op`` at this shape (beyond ``unavailable``), or ``""``:
        ``auto`` then runs the sequence instead of a table's entry measured at another shape."""
        return ""

    def ready_for(self, comm: C.Communicator, op: str, a: torch.Tensor, b: torch.Tensor, chunks: int) -> bool:
        """``ready``, for a strategy whose capture also needs something per shape (``a`` the rows
        the operator would pass, ``b`` its second operand)."""
        return self.ready(comm)

    def prepare_for(self, comm: C.Communicator, op: str, a: torch.Tensor, b: torch.Tensor, chunks: int) -> None:
        """``prepare``, and what a later capture of ``op`` at this shape needs (collective)."""
        self.prepare(comm)

    def gemm_all_reduce(self, comm: C.Communicator, a: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
        """``a @ b`` summed over the ranks: ``[M, N]``, the same on every rank."""
        raise NotImplementedError

    def gemm_reduce_scatter(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor,
                            chunks: int) -> torch.Tensor:
        """This rank's block of rows of ``rows @ b`` summed over the ranks: ``[M / W, N]``."""
        raise NotImplementedError

    def all_gather_gemm(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor, chunks: int,
                        keep_gathered: bool) -> tuple[torch.Tensor, Any]:
        """Every rank's ``rows`` (``[m, K]`` each, gathered in rank order) times ``b``: ``[W * m, N]``,
        and with ``keep_gathered`` the gathered operand ``[W * m, K]`` (else None)."""
        raise NotImplementedError
