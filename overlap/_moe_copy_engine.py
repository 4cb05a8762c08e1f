"""MoE dispatch and combine whose rows travel between the GPUs of one node by copy engines.

Design note. NCCL's ``all_to_all_single`` needs each destination's rows contiguous, so a
dispatch over it costs a gather before the transfer and a regroup after it, two passes over
every row that add to the transfer's time. Here the gather is cut into pieces and each piece is
pushed (``cudaMemcpyAsync``, no SMs) into the destination's peer buffer as soon as it is
gathered, while the destination puts each arrived piece straight into its place in ``recv_x``
(``index_copy_``); the rows a rank keeps go from ``x`` to ``recv_x`` without travelling. The
passes then overlap the transfer instead of following it. Combine runs the same plan backwards
and sums the returned rows, weighted, into each token's output.

The plan (``plan``) is numpy on the host, from the counts of every rank (an all-gather of the
per-expert counts, so that every rank sizes the slot regions and the piece count the same way).
Piece c carries part c of every rank's rows for every other rank; ring slot ``c % ring`` of the
receiver holds it, one region per source, and is reused once the receiver has consumed it
(``CE_PULLED``). The streams, barriers and flags are those of ``overlap/_copy_engine.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from collectives.errors import UnsupportedError
from collectives.peer.memory import CE_PULLED, CE_PUSHED, CE_RING, PeerMemory

from . import _copy_engine as _ce
from .moe import _cut

__all__ = ["Plan", "plan", "build", "dispatch", "combine", "pipelined"]


@dataclass
class Plan:
    """One rank's copy-engine exchange for one dispatch handle (index arrays on the device).

    ``send_*[c]``: this rank's rows of piece c for the other ranks, destinations in ascending
    order: the pairs' tokens and flat pair indices, and ``send_seg[c]`` = (rank, first row, rows)
    of each destination's segment. ``recv_dest[c]``: where the rows of piece c from the other
    ranks go in ``recv_x``, sources in ascending order, segments in ``recv_seg[c]``. ``local_*``:
    the rows this rank keeps. ``region`` bytes per source in a ring slot, ``ring`` slots."""

    pieces: int
    ring: int
    region: int
    send_tok: list[torch.Tensor]
    send_pair: list[torch.Tensor]
    send_seg: list[list[tuple[int, int, int]]]
    recv_dest: list[torch.Tensor]
    recv_seg: list[list[tuple[int, int, int]]]
    local_tok: torch.Tensor
    local_pair: torch.Tensor
    local_dest: torch.Tensor


def plan(rank: int, world: int, pieces: int, order: np.ndarray, k: int, send: list[int], recv: list[int],
         regroup: np.ndarray, between: np.ndarray, row_bytes: int, slot_bytes: int) -> tuple[dict[str, object], list[np.ndarray]]:
    """The host side of a :class:`Plan`: its scalars and segments, and the index arrays (in the
    order ``Plan``'s tensors take them) for the caller to move to the device in one copy.

    ``between[s, q]``: rows rank s sends rank q (every rank's, the same on every rank), which
    sizes the regions; ``pieces`` grows until two ring slots fit ``slot_bytes``."""
    off_diag = [int(between[s, q]) for s in range(world) for q in range(world) if s != q]
    most = max(off_diag, default=0)
    fit = slot_bytes // (2 * world) // _ce._ALIGN * _ce._ALIGN // max(1, row_bytes)
    if most and fit < 1:
        raise UnsupportedError("hidden", row_bytes, f"rows of {row_bytes} B do not fit {world} x 2 slots of "
                               f"{slot_bytes} B of peer memory", "raise COMMOPS_PEER_BYTES")
    pieces = max(pieces, -(-most // fit) if most else 1)
    region = _ce._region(-(-most // pieces) if most else 0, 1, row_bytes)
    ring = min(CE_RING, slot_bytes // (world * region)) if region else CE_RING
    s_start = np.concatenate([[0], np.cumsum(send)]).astype(np.int64)
    r_start = np.concatenate([[0], np.cumsum(recv)]).astype(np.int64)
    inverse = np.empty_like(regroup)
    inverse[regroup] = np.arange(regroup.size)  # by-source row -> its place in recv_x
    others = [q for q in range(world) if q != rank]
    arrays: list[np.ndarray] = []
    send_seg, recv_seg = [], []
    for c in range(pieces):
        pos, segs, at = [], [], 0
        for q in others:
            lo, hi = _cut(send[q], pieces, c)
            pos.append(np.arange(s_start[q] + lo, s_start[q] + hi))
            segs.append((q, at, hi - lo))
            at += hi - lo
        pairs = order[np.concatenate(pos)] if pos else np.zeros(0, dtype=np.int64)
        arrays += [pairs // k, pairs]
        send_seg.append(segs)
        got, segs, at = [], [], 0
        for s in others:
            lo, hi = _cut(recv[s], pieces, c)
            got.append(np.arange(r_start[s] + lo, r_start[s] + hi))
            segs.append((s, at, hi - lo))
            at += hi - lo
        arrays.append(inverse[np.concatenate(got)] if got else np.zeros(0, dtype=np.int64))
        recv_seg.append(segs)
    mine = order[s_start[rank]:s_start[rank + 1]]
    arrays += [mine // k, mine, inverse[np.arange(r_start[rank], r_start[rank + 1])]]
    return {"pieces": pieces, "ring": ring, "region": region, "send_seg": send_seg, "recv_seg": recv_seg}, arrays


def build(scalars: dict[str, object], views: list[torch.Tensor]) -> Plan:
    """A :class:`Plan` from ``plan``'s scalars and its arrays, now on the device."""
    n = int(scalars["pieces"])  # type: ignore[call-overload]
    return Plan(n, int(scalars["ring"]), int(scalars["region"]),  # type: ignore[call-overload]
                views[0:3 * n:3], views[1:3 * n:3], scalars["send_seg"], views[2:3 * n:3],  # type: ignore[arg-type]
                scalars["recv_seg"], views[3 * n], views[3 * n + 1], views[3 * n + 2])  # type: ignore[arg-type]


def dispatch(pm: PeerMemory, p: Plan, x: torch.Tensor, total: int) -> torch.Tensor:
    """``recv_x [total, hidden]``: every rank's rows for this rank's experts, grouped by expert."""
    hidden = x.shape[1]
    recv_x = x.new_empty((total, hidden))
    ch = _Channel(pm, [p])
    pm.ce_open()
    used = ch.issue(p.send_tok, p.send_seg, x)
    if p.local_dest.numel():  # the rows this rank keeps, placed while the others travel
        recv_x.index_copy_(0, p.local_dest, x.index_select(0, p.local_tok))
    ch.land(used, p.recv_seg, hidden, x.dtype, lambda c, at, n, got: recv_x.index_copy_(0, p.recv_dest[c][at:at + n], got))
    ch.close()
    return recv_x


def combine(pm: PeerMemory, p: Plan, y: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``out [num_tokens, hidden]``: each token's returned rows (``y`` in ``recv_x``'s layout),
    weighted by ``weights`` (``[num_tokens, k]``) and summed."""
    hidden = y.shape[1]
    out = y.new_zeros((num_tokens, hidden))
    flat_w = weights.reshape(-1)
    ch = _Channel(pm, [p])
    pm.ce_open()
    used = ch.issue(p.recv_dest, p.recv_seg, y)
    _add_local(out, y, p, flat_w)
    ch.land(used, p.send_seg, hidden, y.dtype, _weighted_add(out, p, flat_w))
    ch.close()
    return out


def _add_local(out: torch.Tensor, y: torch.Tensor, p: Plan, flat_w: torch.Tensor) -> None:
    """This rank's own pairs' rows, weighted, into ``out`` (they need no travel)."""
    if p.local_dest.numel():
        wts = flat_w.index_select(0, p.local_pair).to(y.dtype).unsqueeze(-1)
        out.index_add_(0, p.local_tok, y.index_select(0, p.local_dest) * wts)


def _weighted_add(out: torch.Tensor, p: Plan, flat_w: torch.Tensor) -> Any:
    """``put`` for ``_Channel.land``: returned rows of piece c, weighted, into ``out``."""
    def put(c: int, at: int, n: int, got: torch.Tensor) -> None:
        wts = flat_w.index_select(0, p.send_pair[c][at:at + n]).to(got.dtype).unsqueeze(-1)
        out.index_add_(0, p.send_tok[c][at:at + n], got * wts)

    return put


class _Channel:
    """One copy-engine section shared by many exchanges: every piece of every exchange takes the
    next ring slot (the same sequence on every rank), in regions of the largest plan's size."""

    def __init__(self, pm: PeerMemory, plans: list[Plan]) -> None:
        self.pm, self.next = pm, 0
        self.region = max((p.region for p in plans), default=0)
        self.ring = min(CE_RING, pm.slot_bytes // (pm.world * self.region)) if self.region else CE_RING
        self.st = _ce._Streams(pm)
        self.staged: list[torch.Tensor] = []  # read by the push stream: alive until it is joined

    def issue(self, rows_of: list[torch.Tensor], segs: list[list[tuple[int, int, int]]],
              src: torch.Tensor) -> list[tuple[int, int]]:
        """Gather each piece's rows of ``src`` and push them (copy stream); the slots used."""
        pm, st = self.pm, self.st
        w, r, row = pm.world, pm.rank, src.shape[1] * src.element_size()
        used = []
        for idx, seg in zip(rows_of, segs):
            s, u = self.next % self.ring, self.next // self.ring
            self.next += 1
            rows = src.index_select(0, idx)
            st.after_main(st.push)
            if u:
                pm.ce_wait(st.ps, s, CE_PULLED, u)
            for q, at, n in seg:
                if n:
                    pm.ce_push(st.ps, q, (s * w + r) * self.region, rows[at].data_ptr(), n * row)
                pm.ce_signal(st.ps, q, s, CE_PUSHED, u + 1)
            used.append((s, u))
            self.staged.append(rows)
        return used

    def close(self) -> None:
        """Join the push stream (the staged rows may go) and close the section."""
        self.st.join(self.st.push)
        self.staged.clear()
        self.pm.ce_close()

    def land(self, used: list[tuple[int, int]], segs: list[list[tuple[int, int, int]]], hidden: int,
             dtype: torch.dtype, put: Any) -> None:
        """For each piece c: wait (compute stream) until it has landed, ``put(c, first, rows,
        tensor in the slot)`` for each source's segment, then free the slot for that source."""
        pm, st = self.pm, self.st
        for c, ((s, u), seg) in enumerate(zip(used, segs)):
            pm.ce_wait(st.ms, s, CE_PUSHED, u + 1)
            for src, at, n in seg:
                if n:
                    put(c, at, n, pm.slot_view((s * pm.world + src) * self.region, (n, hidden), dtype))
                pm.ce_signal(st.ms, src, s, CE_PULLED, u + 1)


def pipelined(pm: PeerMemory, plans: list[Plan], x: torch.Tensor, weights: torch.Tensor, k: int,
              bounds: list[tuple[int, int]], totals: list[int], experts: Any,
              tokens_per_expert: list[list[int]]) -> torch.Tensor:
    """The MoE layer's forward in token chunks, without autograd: chunk i+1's rows travel (copy
    engines) while the experts compute chunk i, and chunk i's results travel back while chunk
    i+1 is computed. ``plans[i]``, ``bounds[i]``, ``totals[i]`` (rows received) and
    ``tokens_per_expert[i]`` describe chunk i; every rank passes the same number of chunks.

        compute:  gather 0, place 0 | gather 1 | experts 0 | gather y0 | place 1 | experts 1 | land y0 | ...
        copy:                       | push 1 -------------> | push y0 ---------------------->|
    """
    hidden = x.shape[1]
    out = x.new_zeros((x.shape[0], hidden))
    ch = _Channel(pm, plans)
    pm.ce_open()

    def issue_dispatch(i: int) -> list[tuple[int, int]]:
        lo, hi = bounds[i]
        return ch.issue(plans[i].send_tok, plans[i].send_seg, x[lo:hi])

    def land_dispatch(i: int, used: list[tuple[int, int]]) -> torch.Tensor:
        p, (lo, hi) = plans[i], bounds[i]
        recv = x.new_empty((totals[i], hidden))
        if p.local_dest.numel():
            recv.index_copy_(0, p.local_dest, x[lo:hi].index_select(0, p.local_tok))
        ch.land(used, p.recv_seg, hidden, x.dtype,
                lambda c, at, n, got: recv.index_copy_(0, p.recv_dest[c][at:at + n], got))
        return recv

    def issue_combine(i: int, y: torch.Tensor) -> list[tuple[int, int]]:
        p, (lo, hi) = plans[i], bounds[i]
        used = ch.issue(p.recv_dest, p.recv_seg, y)
        _add_local(out[lo:hi], y, p, weights[lo:hi].reshape(-1))
        return used

    def land_combine(i: int, used: list[tuple[int, int]]) -> None:
        p, (lo, hi) = plans[i], bounds[i]
        ch.land(used, p.send_seg, hidden, x.dtype, _weighted_add(out[lo:hi], p, weights[lo:hi].reshape(-1)))

    n = len(plans)
    recv = land_dispatch(0, issue_dispatch(0))
    pending_d: list[tuple[int, int]] = []
    pending_c: list[tuple[int, int]] | None = None
    for i in range(n):
        if i + 1 < n:
            pending_d = issue_dispatch(i + 1)
        y = experts(recv, tokens_per_expert[i])
        this_c = issue_combine(i, y)
        if pending_c is not None:
            land_combine(i - 1, pending_c)
        pending_c = this_c
        if i + 1 < n:
            recv = land_dispatch(i + 1, pending_d)
    if pending_c is not None:
        land_combine(n - 1, pending_c)
    ch.close()
    return out
