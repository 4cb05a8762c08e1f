"""``tile_signal`` (the GPUs of one node, Triton): GEMM + reduce-scatter and GEMM + all-reduce as
one persistent GEMM whose finished row groups copy engines move while it runs, the peers' partial
sums added in its tiles (``overlap/_tile_signal.py``). ``all_gather_gemm`` runs as
``copy_engine``'s: there the GEMM consumes what arrives, and one cuBLAS call per arrival already
keeps it whole. Counted and recorded like a collective, as ``copy_engine`` is."""

from __future__ import annotations

from typing import Any

import torch

import collectives as C
from collectives.errors import UnsupportedError
from collectives.peer import has_peer_memory, peer_memory

from .. import _copy_engine, _tile_signal
from .base import OverlapStrategy
from .copy_engine import CopyEngine, _recorded

__all__ = ["TileSignal"]

_OPS = {"gemm_all_reduce": "ar", "gemm_reduce_scatter": "rs"}  # the layouts' names of the operators


def _rows(a: torch.Tensor) -> torch.Tensor:
    return a.reshape(-1, a.shape[-1])


class TileSignal(OverlapStrategy):
    name = "tile_signal"

    def unavailable(self, comm: C.Communicator, device: torch.device, dtype: torch.dtype) -> str:
        return _tile_signal.unavailable(comm, device, dtype)

    def ready(self, comm: C.Communicator) -> bool:
        return _copy_engine.ready(comm)

    def prepare(self, comm: C.Communicator) -> None:
        _copy_engine.prepare(comm)

    def refuses(self, comm: C.Communicator, op: str, a: torch.Tensor, b: torch.Tensor, chunks: int) -> str:
        if op not in _OPS:
            return ""
        why = self.unavailable(comm, a.device, a.dtype)
        if why:
            return why
        # peer memory built where it is not yet: auto's first call at a shape is collective
        return _tile_signal.refusal(peer_memory(comm), _OPS[op], _rows(a), b, chunks)

    def ready_for(self, comm: C.Communicator, op: str, a: torch.Tensor, b: torch.Tensor, chunks: int) -> bool:
        if op not in _OPS:
            return _copy_engine.ready(comm)
        return has_peer_memory(comm) and _tile_signal.has_layout(peer_memory(comm), _OPS[op], _rows(a), b, chunks)

    def prepare_for(self, comm: C.Communicator, op: str, a: torch.Tensor, b: torch.Tensor, chunks: int) -> None:
        self.prepare(comm)
        if op in _OPS and not self.refuses(comm, op, a, b, chunks):
            _tile_signal.layout(peer_memory(comm), _OPS[op], _rows(a).contiguous(), _tile_signal._operand(b), chunks)

    def _take(self, comm: C.Communicator, op: str, a: torch.Tensor, b: torch.Tensor, chunks: int) -> None:
        """Refuse a shape before the call is recorded and anything is sent (the group stays usable)."""
        pm = peer_memory(comm)
        if _tile_signal.has_layout(pm, _OPS[op], a, b, chunks):
            return
        why = _tile_signal.refusal(pm, _OPS[op], a, b, chunks)
        if not why and _tile_signal._capturing():
            why = "its layout for this shape (a copy to the GPU, a compile) cannot be built while capturing"
        if why:
            raise UnsupportedError("strategy", "tile_signal", f"cannot run {op} at {tuple(a.shape)} x "
                                   f"{tuple(b.shape)}: {why}", "use 'auto', or call it once eagerly before capturing")

    def gemm_all_reduce(self, comm: C.Communicator, a: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
        self._take(comm, "gemm_all_reduce", a, b, chunks)
        with _recorded(comm, "gemm_all_reduce", a, (a.shape[0], b.shape[1])):
            return _tile_signal.gemm_all_reduce(peer_memory(comm), a, b, chunks)

    def gemm_reduce_scatter(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor,
                            chunks: int) -> torch.Tensor:
        self._take(comm, "gemm_reduce_scatter", rows, b, chunks)
        with _recorded(comm, "gemm_reduce_scatter", rows, (rows.shape[0] // comm.size, b.shape[1])):
            return _tile_signal.gemm_reduce_scatter(peer_memory(comm), rows, b, chunks)

    def all_gather_gemm(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor, chunks: int,
                        keep_gathered: bool) -> tuple[torch.Tensor, Any]:
        return CopyEngine().all_gather_gemm(comm, rows, b, chunks, keep_gathered)
