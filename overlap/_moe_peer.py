"""MoE dispatch and combine by SM kernels that read and write the peers' memory (``transport="peer"``).

Design note. Over ``all_to_all_single`` a dispatch costs three passes over every (token,
expert) row: a gather into per-destination order, the transfer, and a regroup by expert; and a
token bound for four experts of one rank crosses the link four times. Here each rank copies its
tokens once into its own peer buffer, and every rank *pulls* what it needs with one kernel
(``rows_gather`` in ``collectives/peer/kernels.cu``): each (source rank, token) it needs is read
once, over NVLink when the source is a peer, and written straight into every ``recv_x`` row that
wants it. Combine is the mirror image: the experts' rank sums, per (token, source rank), the
weighted rows of its own experts (``rows_partial``, the weights read from the token's rank),
and the token's rank reads one partial row per rank and adds them (``rows_sum``). So one row per
(token, destination rank) crosses the link each way, however many of that rank's experts the
token chose, and nothing is gathered or regrouped in a separate pass.

The routing is known to every rank: the ranks all-gather their ``topk_idx`` (a few hundred
kilobytes) instead of exchanging counts, so each rank plans, in numpy, both what it pulls and
where its partial rows go (``plan``), and applies the capacity limit of every source itself.

Each call (a dispatch or a combine) uses one half of this transport's own peer buffer, the
halves alternating; a call writes its half only after a barrier (``ce_fence``) of the previous
call, which every peer enters after it has finished reading that half two calls ago:

    dispatch:  x -> my half (X)  | fence | rows_gather: peers' X -> recv_x
    combine:   weights -> my half (W) | fence | rows_partial: rows -> my half (P) | fence | rows_sum: peers' P -> out

The barriers are bounded (``timeout_s``); after one gives up the kernels do nothing and the next
call raises ``CollectiveTimeout`` naming the peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from collectives.errors import InvalidArgumentError
from collectives.peer.memory import PACK_BYTES, PeerMemory

__all__ = ["PeerPlan", "plan", "build", "PeerRows", "layout_bytes"]

_WARPS_PER_BLOCK = 16  # 512 threads (kernels.cu's __launch_bounds__)
_MAX_GRID = 256


@dataclass
class PeerPlan:
    """One rank's part of one dispatch handle over the peer transport (index arrays on the device).

    Dispatch: ``items`` (source rank, source row) pairs this rank pulls, the ``recv_x`` rows of
    item i being ``dst[ptr[i]:ptr[i + 1]]``. Combine, on the experts' side: the same items, item i
    summed into partial row ``part[2i + 1]`` for rank ``part[2i]`` from entries (``recv_x`` row,
    the pair's index in that rank's weights); on the tokens' side: token t adds the partial rows
    ``sum_ent[sum_ptr[t]:sum_ptr[t + 1]]`` (rank, row) of the ranks it went to."""

    n_items: int
    n_tokens: int
    items: torch.Tensor
    ptr: torch.Tensor
    dst: torch.Tensor
    part: torch.Tensor
    part_ent: torch.Tensor
    sum_ptr: torch.Tensor
    sum_ent: torch.Tensor


def plan(rank: int, world: int, e_loc: int, k: int, max_tokens: int,
         sources: list[tuple[np.ndarray, np.ndarray, int]]) -> tuple[tuple[int, int], list[np.ndarray]]:
    """This rank's pulls and partial sums for one range, from every source's routing.

    ``sources[s]`` = (``ids``: source s's expert ids ``[tokens, k]``; ``kept``: the flat indices
    of its pairs that the capacity keeps; ``tokens``). ``recv_x``'s layout is that of the
    all-to-all path: by local expert, then source rank, then token. Returns the scalars (items,
    tokens) and the arrays ``build`` takes, in its order.

    Every step is linear in the pairs (one radix sort of small integers per source): this runs
    on the host on every dispatch.
    """
    lo_e = rank * e_loc
    picked, local = [], []
    cnt = np.zeros((e_loc, world), dtype=np.int64)  # [local expert, source] rows received
    for s, (ids, kept, _) in enumerate(sources):
        flat = ids.reshape(-1)
        ok = (flat >= lo_e) & (flat < lo_e + e_loc)
        if kept.size != flat.size:  # the capacity dropped some pairs
            keep = np.zeros(flat.size, dtype=bool)
            keep[kept] = True
            ok &= keep
        pos = np.flatnonzero(ok)  # token-major: grouped by token, so by item
        le = flat[pos] - lo_e
        picked.append(pos)
        local.append(le)
        cnt[:, s] = np.bincount(le, minlength=e_loc)
    base = (np.cumsum(cnt.reshape(-1)) - cnt.reshape(-1)).reshape(e_loc, world)  # first row of (expert, source)
    small = np.int16 if e_loc <= np.iinfo(np.int16).max else np.int64
    items, ptrs, dsts, parts, pairs = [], [], [], [], []
    n_items = pairs_so_far = 0
    for s, (pos, le) in enumerate(zip(picked, local)):
        # each entry's row: its (expert, source) block, then its rank among the block's tokens
        by_e = np.argsort(le.astype(small), kind="stable")
        starts = np.cumsum(cnt[:, s]) - cnt[:, s]
        occ = np.empty(pos.size, dtype=np.int64)
        occ[by_e] = np.arange(pos.size) - starts[le[by_e]]
        dsts.append(base[le, s] + occ)
        tok = pos // k
        per_tok = np.bincount(tok, minlength=sources[s][2])
        toks = np.flatnonzero(per_tok)  # this source's items: its tokens with a pair here, ascending
        items.append(np.stack([np.full(toks.size, s), toks], 1).reshape(-1))
        parts.append(np.stack([np.full(toks.size, s), s * max_tokens + np.arange(toks.size)], 1).reshape(-1))
        ptrs.append(np.cumsum(per_tok[toks]) + pairs_so_far)
        pairs_so_far += pos.size
        pairs.append(pos)
        n_items += toks.size
    ptr = np.concatenate([[0], *ptrs]).astype(np.int64)
    dst = np.concatenate(dsts).astype(np.int64)
    part_ent = np.stack([dst, np.concatenate(pairs).astype(np.int64)], 1).reshape(-1)
    # the tokens' side: token t's partial row at rank q is the index of t among this rank's tokens
    # with a pair on q (what q's plan numbers them), in q's region `rank`
    ids, kept, n_tok = sources[rank]
    flat = ids.reshape(-1)
    keep = None
    if kept.size != flat.size:
        keep = np.zeros(flat.size, dtype=bool)
        keep[kept] = True
    owner = flat // e_loc
    on = np.zeros((world, n_tok), dtype=bool)  # on[q, t]: token t has a kept pair on rank q
    for q in range(world):
        hit = owner == q
        if keep is not None:
            hit &= keep
        on[q] = hit.reshape(n_tok, k).any(1) if n_tok else on[q]
    j = np.cumsum(on, axis=1) - 1
    t_idx, q_idx = np.nonzero(on.T)  # token-major, ranks ascending: a fixed summation order
    sum_ptr = np.concatenate([[0], np.cumsum(on.sum(0))]).astype(np.int64)
    sum_ent = np.stack([q_idx, rank * max_tokens + j[q_idx, t_idx]], 1).reshape(-1).astype(np.int64)
    cat = [np.concatenate(v).astype(np.int64) if v else np.zeros(0, np.int64) for v in (items, parts)]
    return (int(n_items), int(n_tok)), [cat[0], ptr, dst, cat[1], part_ent, sum_ptr, sum_ent]


def build(scalars: tuple[int, int], views: list[torch.Tensor]) -> PeerPlan:
    return PeerPlan(scalars[0], scalars[1], *views)


def layout_bytes(world: int, max_tokens: int, max_pairs: int, row_bytes: int) -> tuple[int, int]:
    """(weights region, one half) in bytes: W = the weights of ``max_pairs`` pairs; then X (the
    tokens, dispatch) or P (``world`` regions of ``max_tokens`` partial rows, combine) after it."""
    wb = -(-max_pairs * 4 // 4096) * 4096
    half = -(-(wb + world * max_tokens * row_bytes) // 4096) * 4096
    return wb, half


class PeerRows:
    """The peer transport of one dispatcher: its own peer buffer (two halves of
    ``layout_bytes``) and the three row kernels. Built once, collective; ``close()`` is collective.

    Args:
        comm: the expert-parallel communicator (the GPUs of one node).
        max_tokens: the most tokens one dispatch takes on any rank.
        max_pairs: the most (token, expert) pairs one combine weighs on any rank.
        row_bytes: bytes of one row (hidden x element size).
    """

    def __init__(self, comm: Any, max_tokens: int, max_pairs: int, row_bytes: int,
                 timeout_s: float | None = None) -> None:
        self.max_tokens, self.max_pairs, self.row_bytes = max_tokens, max_pairs, row_bytes
        self.wb, self.half = layout_bytes(comm.size, max_tokens, max_pairs, row_bytes)
        self.pm = PeerMemory(comm, slot_bytes=max(1 << 20, 2 * self.half), timeout_s=timeout_s)
        self.calls = 0  # the same on every rank: every rank makes the same calls

    def _next_half(self) -> int:
        off = (self.calls % 2) * self.half
        self.calls += 1
        return off

    def _fence(self) -> None:
        self.pm.ce_open()  # a barrier of every rank on the current stream (bounded)

    def _grid(self, n: int) -> int:
        return max(1, min(_MAX_GRID, -(-n // _WARPS_PER_BLOCK)))

    def _vec(self, *ptrs: int) -> bool:
        return self.row_bytes % PACK_BYTES == 0 and all(p % PACK_BYTES == 0 for p in ptrs)

    def _check_tokens(self, n: int) -> None:
        if n > self.max_tokens:
            raise InvalidArgumentError("x", n, f"has {n} tokens; the peer transport was built for max_tokens="
                                       f"{self.max_tokens}", f"pass max_tokens>={n} to MoEDispatcher")

    def dispatch(self, p: PeerPlan, x: torch.Tensor, total: int) -> torch.Tensor:
        """``recv_x [total, hidden]`` (``x`` contiguous ``[tokens, hidden]``)."""
        from collectives.peer import _launch

        self._check_tokens(x.shape[0])
        if x.shape[1] * x.element_size() != self.row_bytes:
            raise InvalidArgumentError("x", x, f"has rows of {x.shape[1] * x.element_size()} B; the peer transport was "
                                       f"built for {self.row_bytes} B", "pass dtype= to MoEDispatcher and keep it")
        off = self._next_half()
        recv = x.new_empty((total, x.shape[1]))
        if x.shape[0]:
            self.pm.slot_view(off + self.wb, tuple(x.shape), x.dtype).copy_(x)
        self._fence()
        if p.n_items:
            k = self.pm._kernel("rows_gather", x.dtype, self._vec(recv.data_ptr()), 7)
            k(self._grid(p.n_items), _launch.current_stream(self.pm._index), p.items.data_ptr(), p.ptr.data_ptr(),
              p.dst.data_ptr(), recv.data_ptr(), p.n_items, x.shape[1], off + self.wb)
        return recv

    def combine(self, p: PeerPlan, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``out [tokens, hidden]``: each token's weighted sum of its rows (``rows`` in ``recv_x``'s
        layout, contiguous; ``weights`` this rank's ``[tokens, k]``)."""
        from collectives.peer import _launch

        n = p.n_tokens
        self._check_tokens(n)
        if weights.numel() > self.max_pairs:
            raise InvalidArgumentError("topk_weights", weights, f"has {weights.numel()} pairs; the peer transport was "
                                       f"built for {self.max_pairs}", "build the dispatcher with a larger max_tokens")
        off = self._next_half()
        stream = _launch.current_stream(self.pm._index)
        hidden = self.row_bytes // rows.element_size()
        if rows.dim() != 2 or rows.shape[1] != hidden:
            raise InvalidArgumentError("expert_out", rows, f"is not [rows, {hidden}] {rows.dtype} (the rows the peer "
                                       f"transport was built for: {self.row_bytes} B)", "pass rows in recv_x's layout")
        if weights.numel():
            self.pm.slot_view(off, (weights.numel(),), torch.float32).copy_(weights.reshape(-1))
        self._fence()
        if p.n_items:
            k = self.pm._kernel("rows_partial", rows.dtype, self._vec(rows.data_ptr()), 8)
            k(self._grid(p.n_items), stream, p.part.data_ptr(), p.ptr.data_ptr(), p.part_ent.data_ptr(),
              rows.data_ptr(), p.n_items, hidden, off + self.wb, off)
        self._fence()
        out = rows.new_empty((n, hidden))
        if n:
            k = self.pm._kernel("rows_sum", rows.dtype, self._vec(out.data_ptr()), 6)
            k(self._grid(n), stream, p.sum_ptr.data_ptr(), p.sum_ent.data_ptr(), out.data_ptr(), n, hidden,
              off + self.wb)
        return out

    def check(self) -> None:
        """Raise ``CollectiveTimeout`` if a barrier of this transport gave up waiting for a peer."""
        self.pm.check()

    def close(self) -> None:
        """Release the peer buffer (collective)."""
        self.pm.close()
