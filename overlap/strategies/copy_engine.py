"""``copy_engine`` (the GPUs of one node): the data moves by copy engines through peer memory
while the GEMM chunks run, and reductions ride in the GEMM's epilogue (``overlap/_copy_engine.py``).
It communicates outside the verbs, so each call is counted and recorded like a collective
(``collectives.dispatch.recorded``), its result described by a meta tensor."""

from __future__ import annotations

from typing import Any

import torch

import collectives as C
from collectives.dispatch import recorded
from collectives.peer import peer_memory

from .. import _copy_engine
from .base import OverlapStrategy

__all__ = ["CopyEngine"]


def _recorded(comm: C.Communicator, op: str, a: torch.Tensor, out_shape: tuple[int, ...]) -> Any:
    return recorded(comm, op, "copy_engine", torch.empty(out_shape, dtype=a.dtype, device="meta"), a)


class CopyEngine(OverlapStrategy):
    name = "copy_engine"

    def unavailable(self, comm: C.Communicator, device: torch.device, dtype: torch.dtype) -> str:
        return _copy_engine.unavailable(comm, device, dtype)

    def ready(self, comm: C.Communicator) -> bool:
        return _copy_engine.ready(comm)

    def prepare(self, comm: C.Communicator) -> None:
        _copy_engine.prepare(comm)

    def gemm_all_reduce(self, comm: C.Communicator, a: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
        a = a.contiguous()
        with _recorded(comm, "gemm_all_reduce", a, (a.shape[0], b.shape[1])):
            return _copy_engine.gemm_all_reduce(peer_memory(comm), a, b, chunks)

    def gemm_reduce_scatter(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor,
                            chunks: int) -> torch.Tensor:
        with _recorded(comm, "gemm_reduce_scatter", rows, (rows.shape[0] // comm.size, b.shape[1])):
            return _copy_engine.gemm_reduce_scatter(peer_memory(comm), rows.contiguous(), b, chunks)

    def all_gather_gemm(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor, chunks: int,
                        keep_gathered: bool) -> tuple[torch.Tensor, Any]:
        m = rows.shape[0]
        with _recorded(comm, "all_gather_gemm", rows, (m * comm.size, b.shape[1])):
            out, kept = _copy_engine.all_gather_gemm(peer_memory(comm), rows, b, chunks, keep_gathered)
        return out, None if kept is None else kept.view(m * comm.size, -1)
