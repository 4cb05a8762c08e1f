"""``chunked``: the GEMM in chunks, each chunk's collective issued asynchronously as soon as the
chunk is computed, so that it runs while the next chunk is computed: on CUDA NCCL's collective
on NCCL's own stream, on CPU asynchronous Gloo work. The chunking keeps each collective's input
contiguous: all-reduce chunks rows of ``a``, reduce-scatter chunks columns of ``b``, all-gather
chunks the rows of every rank's shard."""

from __future__ import annotations

from typing import Any

import torch

import collectives as C

from .base import OverlapStrategy

__all__ = ["Chunked", "bounds"]


class _Side:
    """Runs each collective asynchronously after the work queued so far: NCCL on its own stream
    (ordered after the current stream's work by the backend), Gloo on its threads.

    ``run`` returns a handle whose ``wait()`` makes the caller's later work wait for that
    collective only (on CUDA by ordering the current stream, not by blocking the host); ``join``
    waits for all of them.
    """

    def __init__(self, device: torch.device) -> None:
        self.works: list[Any] = []
        # Collectives that run beside a GEMM must leave it the SMs: NCCL's kernels take a few
        # blocks, while our peer-memory kernels take up to 128 and spin while they wait for a
        # peer; chunked with auto's peer-memory algorithms measured 3-10x slower than the plain
        # sequence on 2xH200 (launch/bench_overlap.py, 2026-11-30). So on CUDA: NCCL, started
        # asynchronously, which costs the host one call and no stream switching.
        self.algorithm = "native" if device.type == "cuda" else "auto"

    def run(self, fn: Any) -> Any:
        work = fn(True)
        self.works.append(work)
        return work

    def join(self) -> None:
        for w in self.works:
            if w is not None:
                w.wait()
        self.works.clear()


def bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """At most ``chunks`` [lo, hi) ranges of ``n`` items, of ceil(n / chunks) each but the last; none empty."""
    step = max(1, -(-n // chunks))
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


class Chunked(OverlapStrategy):
    name = "chunked"

    def gemm_all_reduce(self, comm: C.Communicator, a: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
        out = a.new_empty((a.shape[0], b.shape[1]))
        side = _Side(a.device)
        for lo, hi in bounds(a.shape[0], chunks):
            part = out[lo:hi]
            torch.matmul(a[lo:hi], b, out=part)
            side.run(lambda asy, p=part: C.all_reduce(p, group=comm.group, async_op=asy, algorithm=side.algorithm))
        side.join()
        return out

    def gemm_reduce_scatter(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor,
                            chunks: int) -> torch.Tensor:
        m, n, w = rows.shape[0], b.shape[1], comm.size
        out = rows.new_empty((m // w, n))
        side = _Side(rows.device)
        parts = []
        for lo, hi in bounds(n, chunks):
            full = torch.matmul(rows, b[:, lo:hi])
            shard = full.new_empty((m // w, hi - lo))
            side.run(lambda asy, s=shard, f=full: C.reduce_scatter_single(s, f, group=comm.group, async_op=asy,
                                                                          algorithm=side.algorithm))
            parts.append((lo, hi, shard))
        side.join()
        for lo, hi, shard in parts:
            out[:, lo:hi] = shard
        return out

    def all_gather_gemm(self, comm: C.Communicator, rows: torch.Tensor, b: torch.Tensor, chunks: int,
                        keep_gathered: bool) -> tuple[torch.Tensor, Any]:
        m, n, w = rows.shape[0], b.shape[1], comm.size
        full = rows.new_empty((w, m, rows.shape[1])) if keep_gathered else None
        out = rows.new_empty((m * w, n))
        by_rank = out.view(w, m, n)
        side = _Side(rows.device)
        gathered = []
        for lo, hi in bounds(m, chunks):
            g = rows.new_empty((w, hi - lo, rows.shape[1]))
            part = rows[lo:hi].contiguous()
            handle = side.run(lambda asy, g=g, p=part: C.all_gather_single(g.view(-1, p.shape[1]), p, group=comm.group,
                                                                           async_op=asy, algorithm=side.algorithm))
            gathered.append((lo, hi, g, handle))
        for lo, hi, g, handle in gathered:  # each chunk's GEMM waits for its own gather only
            if handle is not None:
                handle.wait()
            by_rank[:, lo:hi] = torch.matmul(g, b)
            if full is not None:
                full[:, lo:hi] = g
        side.join()
        return out, None if full is None else full.view(m * w, -1)
