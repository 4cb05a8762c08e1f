"""The peer transport's plan and its buffer: what a host-planned dispatch pulls, and where each call's data lies.

Design note. With a capacity factor, every rank plans in numpy what it pulls from every source
and where its partial rows go (:func:`plan`, from every rank's routing), applying every source's
capacity limit itself; ``build`` puts the plan's arrays, already on the device, in a
``PeerPlan``. Dropless, the routing is laid out on the GPUs instead, and ``DeviceLayout`` holds
what the layout kernels worked out. The sizes here (``layout_bytes``, ``buffer_bytes``,
``ce_block``) are the peer buffer's map; the constants shared with ``rows.cu`` are checked
against it by ``tests/test_peer_constants.py``. Nothing here launches a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PeerPlan", "plan", "build", "DeviceLayout", "Region", "layout_bytes", "buffer_bytes", "ce_block",
           "ce_section_bytes", "dense_backward_fits", "errors_at", "totals_at", "IDS_HEADER", "MAX_BASE", "MAX_CHUNKS",
           "BAD_RANGE", "BAD_REPEAT"]


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
            kept_mask = np.zeros(flat.size, dtype=bool)
            kept_mask[kept] = True
            ok &= kept_mask
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


def buffer_bytes(world: int, max_tokens: int, top_k: int, row_bytes: int, copy_engine: bool = False) -> int:
    """The peer buffer ``PeerRows`` needs: two halves, which also hold the 2n regions of a
    pipelined forward of up to ``MAX_CHUNKS`` chunks (each region rounds its parts up to pages);
    with ``copy_engine``, also the copy-engine pipelines' sections, by token chunks or by source
    (one chunk of ``max_tokens``): about 1.5x as much at 2 ranks."""
    n_all = range(2, MAX_CHUNKS + 1)
    size = max([2 * layout_bytes(world, max_tokens, top_k, row_bytes)[2]]
               + [2 * n * layout_bytes(world, -(-max_tokens // n), top_k, row_bytes)[2] for n in n_all]
               + [ce_section_bytes(world, max_tokens, top_k, row_bytes, n) for n in (1, *n_all) if copy_engine])
    return max(1 << 20, size)


def _page(nbytes: int) -> int:
    return -(-nbytes // 4096) * 4096


def ce_block(world: int, t_cap: int, top_k: int, row_bytes: int) -> tuple[int, int, int, int, int]:
    """One chunk's block of the copy-engine pipeline (``PeerRows.pipelined_dense``), in bytes from
    its start: (X, WT, OUT, IN, size); the block opens with the ids (I, read by the peers). X and
    WT hold every rank's tokens and fp32 weights (rank s's at ``s * t_cap`` rows), OUT this rank's
    partial rows for each rank and IN each rank's partial rows for this one (rank q's at
    ``q * t_cap`` rows)."""
    rows = _page(world * t_cap * row_bytes)
    x = _page((IDS_HEADER + t_cap * top_k) * 4)
    wt = x + rows
    out = wt + _page(world * t_cap * top_k * 4)
    return x, wt, out, out + rows, out + 2 * rows


def ce_section_bytes(world: int, max_tokens: int, top_k: int, row_bytes: int, chunks: int) -> int:
    """The peer buffer the copy-engine pipeline of ``chunks`` chunks takes."""
    return chunks * ce_block(world, -(-max_tokens // chunks), top_k, row_bytes)[-1]


def dense_backward_fits(world: int, top_k: int, row_bytes: int) -> bool:
    """Whether a region's rows area holds a rank's gradient rows and the per-pair dot products
    (``PeerRows.combine_backward_dense``): ``t_max`` rows plus ``world * t_max * k`` floats."""
    return 4 * top_k * world <= (world - 1) * row_bytes


def build(scalars: tuple[int, int], views: list[torch.Tensor]) -> PeerPlan:
    return PeerPlan(scalars[0], scalars[1], *views)


def layout_bytes(world: int, max_tokens: int, top_k: int, row_bytes: int) -> tuple[int, int, int]:
    """(W, W + I, one half) in bytes. A half holds W: the weights of ``max_tokens * top_k`` pairs
    (fp32); I: a header and the expert ids (int32, the device-side layout); then X (the tokens,
    dispatch) or P (``world`` regions of ``max_tokens`` partial rows, combine)."""
    wb = _page(max_tokens * top_k * 4)
    ib = wb + _page((IDS_HEADER + max_tokens * top_k) * 4)
    half = ib + _page(world * max_tokens * row_bytes)
    return wb, ib, half


IDS_HEADER = 16  # ints before the ids in I (rows.cu)
MAX_BASE = 4096  # local experts x ranks the device-side layout serves (rows.cu)
BAD_RANGE, BAD_REPEAT = 0, 1  # error words after info's counts
MAX_CHUNKS = 8  # the most chunks of a pipelined forward over the device-side layout


def errors_at(world: int, e_loc: int) -> int:
    """Where info's two error words start (ints): after the counts, the tokens and the sends."""
    return world * e_loc + 2 * world


def totals_at(world: int, e_loc: int) -> int:
    """Where info's per-local-expert totals (int64) start, in ints (rows.cu's totals_at)."""
    return (errors_at(world, e_loc) + 2 + 1) // 2 * 2


@dataclass(frozen=True)
class Region:
    """Where one call's data lies in this rank's peer buffer (bytes): weights, ids, rows (X or P)."""

    w: int
    ids: int
    x: int
    t_max: int


@dataclass
class DeviceLayout:
    """The routing of one dispatch worked out on the device (``PeerRows.dispatch_dense``).

    ``ids_all [W, max_tokens, k]``: every rank's expert ids; ``ranks [W, max_tokens, E/W]``: the
    rank of each token among its source's tokens for each local expert (or -1); ``info``: the
    per-(source, local expert) counts, token counts and this rank's sends, on the device, and
    ``counts`` the same on the host (``None`` for the padded layout, which never waits for them)."""

    ids_all: torch.Tensor
    ranks: torch.Tensor
    info: torch.Tensor
    counts: np.ndarray | None
    tokens: int
    cap: int = 0  # padded recv_x: rows per local expert (0: compact)
    ends: torch.Tensor | None = None  # compact: int32 [E/W], where each local expert's rows end
