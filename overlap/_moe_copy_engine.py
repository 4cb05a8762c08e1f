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

import numpy as np
import torch

from collectives.errors import UnsupportedError
from collectives.peer.memory import CE_PULLED, CE_PUSHED, CE_RING, PeerMemory

from . import _copy_engine as _ce

__all__ = ["Plan", "plan", "dispatch", "combine"]


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


def _cut(n: int, pieces: int, c: int) -> tuple[int, int]:
    return n * c // pieces, n * (c + 1) // pieces


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
    w, r, hidden, es = pm.world, pm.rank, x.shape[1], x.element_size()
    recv_x = x.new_empty((total, hidden))
    st = _ce._Streams(pm)
    pm.ce_open()
    staged = []
    for c in range(p.pieces):
        s, u = c % p.ring, c // p.ring
        rows = x.index_select(0, p.send_tok[c])
        st.after_main(st.push)
        if u:
            pm.ce_wait(st.ps, s, CE_PULLED, u)  # every peer has put away what this slot held
        for q, at, n in p.send_seg[c]:
            if n:
                pm.ce_push(st.ps, q, (s * w + r) * p.region, rows[at].data_ptr(), n * hidden * es)
            pm.ce_signal(st.ps, q, s, CE_PUSHED, u + 1)
        staged.append(rows)
    if p.local_dest.numel():
        recv_x.index_copy_(0, p.local_dest, x.index_select(0, p.local_tok))
    for c in range(p.pieces):
        s, u = c % p.ring, c // p.ring
        pm.ce_wait(st.ms, s, CE_PUSHED, u + 1)
        for src, at, n in p.recv_seg[c]:
            if n:
                got = pm.slot_view((s * w + src) * p.region, (n, hidden), x.dtype)
                recv_x.index_copy_(0, p.recv_dest[c][at:at + n], got)
            pm.ce_signal(st.ms, src, s, CE_PULLED, u + 1)
    st.join(st.push)  # the staged rows are read by the push stream
    del staged
    pm.ce_close()
    return recv_x


def combine(pm: PeerMemory, p: Plan, y: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``out [num_tokens, hidden]``: each token's returned rows (``y`` in ``recv_x``'s layout),
    weighted by ``weights`` (``[num_tokens, k]``) and summed."""
    w, r, hidden, es = pm.world, pm.rank, y.shape[1], y.element_size()
    out = y.new_zeros((num_tokens, hidden))
    flat_w = weights.reshape(-1)
    st = _ce._Streams(pm)
    pm.ce_open()
    staged = []
    for c in range(p.pieces):
        s, u = c % p.ring, c // p.ring
        rows = y.index_select(0, p.recv_dest[c])
        st.after_main(st.push)
        if u:
            pm.ce_wait(st.ps, s, CE_PULLED, u)
        for q, at, n in p.recv_seg[c]:
            if n:
                pm.ce_push(st.ps, q, (s * w + r) * p.region, rows[at].data_ptr(), n * hidden * es)
            pm.ce_signal(st.ps, q, s, CE_PUSHED, u + 1)
        staged.append(rows)
    if p.local_dest.numel():
        mine = y.index_select(0, p.local_dest) * flat_w.index_select(0, p.local_pair).to(y.dtype).unsqueeze(-1)
        out.index_add_(0, p.local_tok, mine)
    for c in range(p.pieces):
        s, u = c % p.ring, c // p.ring
        pm.ce_wait(st.ms, s, CE_PUSHED, u + 1)
        for src, at, n in p.send_seg[c]:
            if n:
                got = pm.slot_view((s * w + src) * p.region, (n, hidden), y.dtype)
                wts = flat_w.index_select(0, p.send_pair[c][at:at + n]).to(y.dtype).unsqueeze(-1)
                out.index_add_(0, p.send_tok[c][at:at + n], got * wts)
            pm.ce_signal(st.ms, src, s, CE_PULLED, u + 1)
    st.join(st.push)
    del staged
    pm.ce_close()
    return out
