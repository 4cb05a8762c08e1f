"""Runs a :class:`~collectives.algos._schedule.Schedule` with torch.distributed point-to-point ops.

Design note: each step posts all of its sends and receives in one ``batch_isend_irecv`` (NCCL
groups them into one launch; Gloo and MPI post them concurrently) and waits for them before
folding received data in. On CUDA the waits only order streams, so a whole schedule is enqueued
without blocking the host; on CPU they block. On CPU backends they go over the communicator's
private twin of its group (``Communicator.p2p_group``), so that a program's own point-to-point
messages on the group never match ours whatever their tags, and carry a per-call tag so that two
of our calls in flight never match each other's; NCCL ignores tags and orders by stream instead.
Each message's tag also carries its element count and dtype (:func:`message_tag`): where two
ranks disagree on a call's size, their messages do not match and both sides wait, for the watch
to name the difference (``collectives/_watch.py``), instead of Gloo aborting the receiving
process on a longer message than it posted, or filling part of a shorter one.

Tried and rejected: one ``isend``/``irecv`` pair per transfer with a wait per pair (twice the
latency per step on Gloo), and receiving reduced data straight into the destination (a step may
reduce several pieces, and a receive cannot accumulate).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ._schedule import Region, Schedule
from .._wait import wait

if TYPE_CHECKING:
    from ..communicator import Communicator

__all__ = ["execute", "message_tag", "REDUCERS"]

_TAG_SPACE = 1 << 30  # Communicator.next_tag's range
_DTYPE_CODES: dict[torch.dtype, int] = {}


def message_tag(tag: int, t: torch.Tensor) -> int:
    """The tag a message of ``t`` carries in the call tagged ``tag``: the call's tag with the
    message's element count and dtype folded in (the same on every rank: no hash seeded per
    process), so that a send matches only a receive of the same count and dtype.

    Measured with 3 Gloo ranks (torch 2.13, 2026-12-02), one rank's all-reduce 8 elements where
    the others' had 6: Gloo's receiving process died ("terminate called after throwing an
    instance of 'gloo::EnforceNotMet'") the moment the longer message arrived; a broadcast into
    a longer buffer returned with only part of it written. With the counts in the tags, both
    sides wait and the watch names the ranks and their shapes within seconds."""
    code = _DTYPE_CODES.get(t.dtype)
    if code is None:
        code = _DTYPE_CODES[t.dtype] = zlib.crc32(str(t.dtype).encode())
    return (tag + t.numel() * 0x9E3779B1 + code) % _TAG_SPACE


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
            sends.append(dist.P2POp(dist.isend, t, to_global[s.peer], group, message_tag(tag, t)))
        landing = []
        for rv in step.recvs:
            if not rv.lands_in_place:
                assert staging is not None
                t = staging[used:used + rv.count]
                used += rv.count
                landing.append((rv, t))
            else:
                t = view(rv.dst[0])
            p2p.append(dist.P2POp(dist.irecv, t, to_global[rv.peer], group, message_tag(tag, t)))
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
