"""Runs a :class:`~collectives.algos._schedule.Schedule` with torch.distributed point-to-point ops.

Design note: each step posts all of its sends and receives in one ``batch_isend_irecv`` (NCCL
groups them into one launch; Gloo and MPI post them concurrently) and waits for them before
folding received data in. On CUDA the waits only order streams, so a whole schedule is enqueued
without blocking the host; on CPU they block. On CPU backends they go over the communicator's
private twin of its group (``Communicator.p2p_group``), so that a program's own point-to-point
messages on the group never match ours whatever their tags, and carry a per-call tag so that two
of our calls in flight never match each other's; NCCL ignores tags and orders by stream instead.

Tried and rejected: one ``isend``/``irecv`` pair per transfer with a wait per pair (twice the
latency per step on Gloo), and receiving reduced data straight into the destination (a step may
reduce several pieces, and a receive cannot accumulate).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ._schedule import Region, Schedule
from .._wait import wait

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["execute", "REDUCERS"]


def _sum(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.add_(src)


def _prod(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.mul_(src)


def _max(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.maximum(dst, src, out=dst)


def _min(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.minimum(dst, src, out=dst)


# "avg" reduces as a sum; the algorithm divides once at the end.
REDUCERS: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
    "sum": _sum, "avg": _sum, "prod": _prod, "max": _max, "min": _min,
}


def execute(
    schedule: Schedule,
    buffers: dict[str, torch.Tensor],
    comm: Communicator,
    reduce_op: str = "sum",
    tag: int = 0,
) -> None:
    """Run ``schedule`` on flat ``buffers`` ("in", "out" and, when needed, "tmp" is added here)."""
    ref = buffers["out"]
    buffers["tmp"] = comm._workspace("tmp", ref.dtype, ref.device, schedule.scratch)
    staging = comm._workspace("staging", ref.dtype, ref.device, schedule.staging) if schedule.staging else None
    reducer = REDUCERS[reduce_op]
    group = comm.p2p_group(ref.is_cuda)
    to_global = comm.global_ranks

    def view(r: Region) -> torch.Tensor:
        return buffers[r.buf][r.offset:r.end]

    for step in schedule.steps:
        for c in step.copies:
            view(c.dst).copy_(view(c.src))
        if not (step.sends or step.recvs):
            continue
        # Receives are posted before sends: with Gloo over TCP, an exchange whose send was posted
        # first ran at half the link rate in about half the runs (both directions took turns);
        # receive-first ran at the full rate every time (emulated 400 Mbit/s link, 2026-11-30).
        p2p: list[dist.P2POp] = []
        sends: list[dist.P2POp] = []
        used = 0
        for s in step.sends:
            if len(s.src) == 1:
                t = view(s.src[0])
            else:
                assert staging is not None
                t = staging[used:used + s.count]
                used += s.count
                torch.cat([view(r) for r in s.src], out=t)
            sends.append(dist.P2POp(dist.isend, t, to_global[s.peer], group, tag))
        landing = []
        for rv in step.recvs:
            if not rv.lands_in_place:
                assert staging is not None
                t = staging[used:used + rv.count]
                used += rv.count
                landing.append((rv, t))
            else:
                t = view(rv.dst[0])
            p2p.append(dist.P2POp(dist.irecv, t, to_global[rv.peer], group, tag))
        p2p += sends
        for work in dist.batch_isend_irecv(p2p):
            wait(work)
        for rv, t in landing:
            at = 0
            for r in rv.dst:
                piece = t[at:at + r.count]
                at += r.count
                if rv.reduce:
                    reducer(view(r), piece)
                else:
                    view(r).copy_(piece)
