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

Every rank learns every rank's routing, in one of two ways. Dropless (the usual case), the
routing is laid out on the GPUs (``dispatch_dense``, below). With a capacity factor, the ranks
all-gather their ``topk_idx`` (a few hundred kilobytes) instead of exchanging counts, and each
rank plans in numpy what it pulls and where its partial rows go (``plan``), applying every
source's capacity limit itself.

Each call (a dispatch or a combine) uses one half of this transport's own peer buffer, the
halves alternating; a call writes its half only after a barrier (``ce_fence``) of the previous
call, which every peer enters after it has finished reading that half two calls ago:

    dispatch:  x -> my half (X) | fence | rows_gather: peers' X -> recv_x
    combine:   weights -> my half (W) | fence | rows_partial: rows -> my half (P) | fence
               | rows_sum: peers' P -> out

Laid out on the GPUs (``dispatch_dense``), each rank copies its ids into its own buffer,
kernels rank every token per local expert, and the host learns only the counts (the ``_dense``
kernels). Autograd then runs on the same kernels: dispatch's backward is a combine with unit
weights; combine's backward reads each token's output gradient once per rank, writes it scaled
into every row of that rank's pairs, and takes each pair's weight gradient as a dot product where
the rows are (one float per pair goes back).

A pipelined forward (``pipelined_dense``) runs these kernels chunk by chunk on a side stream,
or, asked for, moves every byte by copy engines into each rank's place in the peers' buffers and
runs the same kernels on local memory (``_pipelined_ce``): a kernel's context can name, as "rank
q's buffer", a place in this rank's own (``PeerMemory._kernel``'s ``bases``), so no kernel needed
a second version. On 2xH200 neither pipeline beat the plain sequence (bench/results/README.md).

The barriers are bounded (``timeout_s``); after one gives up the kernels do nothing and the next
call raises ``CollectiveTimeout`` naming the peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from collectives.errors import InvalidArgumentError
from collectives.peer.memory import CE_PUSHED, CE_REDUCED, PACK_BYTES, PeerMemory

from .experts import grouped_mm_works
from .routing import bad_routing

__all__ = ["PeerPlan", "plan", "build", "PeerRows", "layout_bytes", "buffer_bytes", "dense_backward_fits",
           "ce_block", "ce_section_bytes"]

_WARPS_PER_BLOCK = 16  # 512 threads (kernels.cu's __launch_bounds__)
_THREADS = 32 * _WARPS_PER_BLOCK
_MAX_GRID = 256
# the dense kernels split an item's row over up to this many warps when items are few (decode)
_ROW_SLICES = 8


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


IDS_HEADER = 16  # ints before the ids in I (kernels.cu)
LAYOUT_TILE = 512  # tokens per block of rows_ids and rows_layout (kernels.cu)
MAX_BASE = 4096  # local experts x ranks the device-side layout serves (kernels.cu)
_BAD_RANGE, _BAD_REPEAT = 0, 1  # error words after info's counts
MAX_CHUNKS = 8  # the most chunks of a pipelined forward over the device-side layout


def _errors_at(world: int, e_loc: int) -> int:
    """Where info's two error words start (ints): after the counts, the tokens and the sends."""
    return world * e_loc + 2 * world


def _totals_at(world: int, e_loc: int) -> int:
    """Where info's per-local-expert totals (int64) start, in ints (kernels.cu's totals_at)."""
    return (_errors_at(world, e_loc) + 2 + 1) // 2 * 2


@dataclass(frozen=True)
class _Region:
    """Where one call's data lies in this rank's peer buffer (bytes): weights, ids, rows (X or P)."""

    w: int
    ids: int
    x: int
    t_max: int


class _Streams:
    """The pipelined section's two streams: the caller's (main: the experts) and the transport's
    side stream (the exchanges), ordered by events; a tensor used on the other stream is recorded
    there (the caching allocator then keeps it until that stream is done with it)."""

    def __init__(self, rows: Any, device: torch.device) -> None:
        self.main = torch.cuda.current_stream(device)
        self.side = rows._side_stream()
        self.side.wait_stream(self.main)
        self.copies = rows.pm.copy_streams

    def on_side(self) -> Any:
        return torch.cuda.stream(self.side)

    def side_mark(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.side)
        return ev

    def main_mark(self) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.main)
        return ev

    def main_waits(self, ev: Any, *used: torch.Tensor) -> None:
        self.main.wait_event(ev)
        for t in used:
            t.record_stream(self.main)

    def side_waits(self, ev: Any, *used: torch.Tensor) -> None:
        self.side.wait_event(ev)
        for t in used:
            t.record_stream(self.side)

    def copy_stream(self, i: int) -> int:
        """The handle of copy stream ``i`` of the peer memory (0: dispatch rows, 1: partial rows),
        made to wait for the caller's stream's work so far (what it copies lies in the peer buffer,
        which the allocator does not manage: nothing to record)."""
        s = self.copies[i]
        s.wait_stream(self.main)
        return s.cuda_stream

    def to_host_beside(self, t: torch.Tensor, pinned: torch.Tensor, after: Any = None) -> Any:
        """Copy ``t`` (its work so far on the caller's stream, or up to the event ``after``
        recorded there) to ``pinned`` from the side stream, so that what the caller's stream runs
        next does not delay it; returns a wait for it."""
        if after is None:
            self.side.wait_stream(self.main)
        else:
            self.side.wait_event(after)
        with torch.cuda.stream(self.side):
            pinned.copy_(t, non_blocking=True)
            t.record_stream(self.side)
        ev = torch.cuda.Event()
        ev.record(self.side)
        return ev.synchronize

    def join(self, *used: torch.Tensor) -> None:
        self.main.wait_stream(self.side)
        for s in self.copies:
            self.main.wait_stream(s)
        for t in used:
            t.record_stream(self.main)


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


class PeerRows:
    """The peer transport of one dispatcher: its own peer buffer (two halves of
    ``layout_bytes``) and the three row kernels. Built once, collective; ``close()`` is collective.

    Args:
        comm: the expert-parallel communicator (the GPUs of one node).
        max_tokens: the most tokens one dispatch takes on any rank.
        top_k: the k of every routing.
        row_bytes: bytes of one row (hidden x element size).
        num_experts: ``E`` (the device-side layout checks the ids against it).
        timeout_s: how long a barrier waits for a peer (``PeerMemory``'s).
        memory: use this ``PeerMemory`` instead of building one (at least ``buffer_bytes``).
        pipeline_transfers: "auto", "sm" or "copy_engine" (``pipelined_dense``); "copy_engine"
            sizes the buffer for that pipeline too.
    """

    def __init__(self, comm: Any, max_tokens: int, top_k: int, row_bytes: int, num_experts: int,
                 timeout_s: float | None = None, memory: Any = None, pipeline_transfers: str = "auto") -> None:
        self.max_tokens, self.top_k, self.row_bytes = max_tokens, top_k, row_bytes
        self.world, self.rank = comm.size, comm.rank
        self.e_loc = num_experts // comm.size
        self.half = layout_bytes(comm.size, max_tokens, top_k, row_bytes)[2]
        self.slot_bytes_needed = buffer_bytes(comm.size, max_tokens, top_k, row_bytes,
                                              copy_engine=pipeline_transfers == "copy_engine")
        self.pm = memory if memory is not None else PeerMemory(comm, slot_bytes=self.slot_bytes_needed,
                                                               timeout_s=timeout_s)
        self.calls = 0  # the same on every rank: every rank makes the same calls
        # how a pipelined forward moves its rows: "auto" (SM kernels: _pipeline_mode), "sm" or
        # "copy_engine" (the buffer must have been sized for it); last_pipeline says what the last
        # one did and why
        self.pipeline_transfers = pipeline_transfers
        self.last_pipeline: tuple[str, str] | None = None
        self._side: torch.cuda.Stream | None = None  # the pipelined section's stream
        self._pinned: torch.Tensor | None = None  # the pipeline by source's counts, on the host
        # a list: pipelined_sources appends (step, CUDA event on the caller's stream) after each of
        # its steps, for a timeline of one call (events cost the stream nothing measurable)
        self.trace: list[tuple[str, Any]] | None = None

    def _next_half(self) -> int:
        off = (self.calls % 2) * self.half
        self.calls += 1
        return off

    def _fence(self) -> None:
        self.pm.barrier()  # a barrier of every rank on the current stream (bounded)

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

        self._check_rows(x)
        g = self._region(self._next_half(), self.max_tokens)
        recv = x.new_empty((total, x.shape[1]))
        if x.shape[0]:
            self.pm.slot_view(g.x, tuple(x.shape), x.dtype).copy_(x)
        self._fence()
        if p.n_items:
            k = self.pm._kernel("rows_gather", x.dtype, self._vec(recv.data_ptr()), 7)
            k(self._grid(p.n_items), _launch.current_stream(self.pm._index), p.items.data_ptr(), p.ptr.data_ptr(),
              p.dst.data_ptr(), recv.data_ptr(), p.n_items, x.shape[1], g.x)
        return recv

    def combine(self, p: PeerPlan, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``out [tokens, hidden]``: each token's weighted sum of its rows (``rows`` in ``recv_x``'s
        layout, contiguous; ``weights`` this rank's ``[tokens, k]``)."""
        from collectives.peer import _launch

        n = p.n_tokens
        self._check_tokens(n)
        hidden = self._check_weights(rows, weights, n)
        g = self._region(self._next_half(), self.max_tokens)
        stream = _launch.current_stream(self.pm._index)
        self._post_weights(g, weights)
        self._fence()
        if p.n_items:
            k = self.pm._kernel("rows_partial", rows.dtype, self._vec(rows.data_ptr()), 8)
            k(self._grid(p.n_items), stream, p.part.data_ptr(), p.ptr.data_ptr(), p.part_ent.data_ptr(),
              rows.data_ptr(), p.n_items, hidden, g.x, g.w)
        self._fence()
        out = rows.new_empty((n, hidden))
        if n:
            k = self.pm._kernel("rows_sum", rows.dtype, self._vec(out.data_ptr()), 6)
            k(self._grid(n), stream, p.sum_ptr.data_ptr(), p.sum_ent.data_ptr(), out.data_ptr(), n, hidden, g.x)
        return out

    def _post_weights(self, g: _Region, weights: torch.Tensor) -> None:
        """This rank's ``[tokens, k]`` weights, as fp32, into its region's W (where peers read them)."""
        if weights.numel():
            self.pm.slot_view(g.w, (weights.numel(),), torch.float32).copy_(weights.reshape(-1))

    # -- the device-side layout (dropless, no autograd): no host plan, one small copy to the host
    def _region(self, off: int, t_max: int) -> _Region:
        wb, ib, _ = layout_bytes(self.world, t_max, self.top_k, self.row_bytes)
        return _Region(off, off + wb, off + ib, t_max)

    def _post(self, g: _Region, x: torch.Tensor, topk_idx: torch.Tensor, info: torch.Tensor | None = None) -> None:
        """This rank's tokens (X) and token count and ids (I) into its region ``g`` (``x``
        contiguous), and ``info`` zeroed: one kernel (``rows_post``)."""
        from collectives.peer import _launch

        T, k = topk_idx.shape
        ids = topk_idx if topk_idx.dtype == torch.int64 else topk_idx.to(torch.int64)
        ids = ids.contiguous()
        nbytes = x.numel() * x.element_size()
        n_info = 0 if info is None else info.numel()
        blocks = max(1, min(2 * _MAX_GRID, -(-nbytes // (16 * _THREADS))))  # a pack per thread
        self.pm._kernel("rows_post", None, False, 9)(
            blocks, _launch.current_stream(self.pm._index), g.x, g.ids, x.data_ptr(), nbytes, ids.data_ptr(), T * k, T,
            0 if info is None else info.data_ptr(), n_info)

    def _layout(self, g: _Region, info: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After the barrier: every rank's ids, and the ranks of the tokens per local expert (``info``
        gets the counts; its last two words must be zero)."""
        from collectives.peer import _launch

        W, e_loc, k = self.world, self.e_loc, self.top_k
        ids_all = torch.empty(W * g.t_max * k, dtype=torch.int32, device=info.device)
        ranks = torch.empty(W * g.t_max * e_loc, dtype=torch.int32, device=info.device)
        n_tiles = -(-g.t_max // LAYOUT_TILE)
        tiles = torch.empty(W * n_tiles * e_loc, dtype=torch.int32, device=info.device)  # each tile's pairs per expert
        stream = _launch.current_stream(self.pm._index)
        ke = self._geo()
        self.pm._kernel("rows_ids", None, False, 6)(W * n_tiles, stream, g.ids, g.t_max, ke, info.data_ptr(),
                                                     ids_all.data_ptr(), tiles.data_ptr())
        self.pm._kernel("rows_layout", None, False, 6)(W * e_loc * n_tiles, stream, g.t_max, ke, ranks.data_ptr(),
                                                        info.data_ptr(), ids_all.data_ptr(), tiles.data_ptr())
        return ids_all, ranks

    def _refuse_bad(self, counts: np.ndarray, topk_idx: torch.Tensor) -> None:
        self.check()
        bad = counts[_errors_at(self.world, self.e_loc):][:2]
        if bad.any():
            s = int(bad[_BAD_RANGE] or bad[_BAD_REPEAT]) - 1
            raise bad_routing("topk_idx" if s == self.rank else f"topk_idx of rank {s}", topk_idx,
                             self.world * self.e_loc, repeated=not bad[_BAD_RANGE])

    def _geo(self, cap: int = 0, only: int | None = None, by_source: bool = False) -> int:
        """The kernels' layout word (kernels.cu): k, the local experts, a source filter (``only``:
        source rank ``only``'s tokens alone, for the kernels that take one), the compact layout's
        order (``by_source``: each source's rows together, grouped by expert) and ``cap`` (0: compact)."""
        return (self.top_k | (self.e_loc << 8) | ((0 if only is None else only + 1) << 24) | (int(by_source) << 31)
                | (cap << 32))

    def _gather(self, g: _Region, layout: DeviceLayout, x: torch.Tensor, bases: tuple[int, ...] | None = None
                ) -> torch.Tensor:
        """``recv_x``: compact (``layout.cap`` 0, its rows counted on the host) or padded; rank s's
        tokens read at ``g.x`` in its buffer (``bases``: in this one, see ``PeerMemory._kernel``)."""
        from collectives.peer import _launch

        if layout.cap:
            total = self.e_loc * layout.cap
        else:
            assert layout.counts is not None  # the compact layout's counts are on the host
            total = int(layout.counts[:self.world * self.e_loc].sum())
        recv = x.new_empty((total, x.shape[1]))
        if total:
            kern = self.pm._kernel("rows_gather_dense", x.dtype, self._vec(recv.data_ptr()), 8, bases)
            kern(self._grid(self.world * g.t_max * _ROW_SLICES), _launch.current_stream(self.pm._index), g.x,
                 layout.ranks.data_ptr(), layout.info.data_ptr(), layout.ids_all.data_ptr(), recv.data_ptr(), g.t_max,
                 x.shape[1], self._geo(layout.cap))
        return recv

    def _combine(self, g: _Region, layout: DeviceLayout, rows: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor) -> None:
        """Weights into W, barrier, partial rows into P, barrier, each token's sum into ``out``."""
        self._post_weights(g, weights)
        self._fence()
        self._partial(g.x, g.w, g.t_max, layout, rows)
        self._fence()
        self._sum(g.x, g.t_max, layout, out)

    def _partial(self, p_off: int, w_off: int, t_max: int, layout: DeviceLayout, rows: torch.Tensor,
                 bases: tuple[int, ...] | None = None, only: int | None = None, by_source: bool = False,
                 first_row: int = 0) -> None:
        """P rows (this rank's buffer at ``p_off``) from the expert rows; the weights read at ``w_off``
        (``only``: source rank ``only``'s tokens alone; ``by_source``: the rows in that layout;
        ``first_row``: ``rows`` holds the layout's rows from that one on)."""
        from collectives.peer import _launch

        if rows.shape[0]:
            ptr = rows.data_ptr() - first_row * rows.shape[1] * rows.element_size()
            kern = self.pm._kernel("rows_partial_dense", rows.dtype, self._vec(ptr), 9, bases)
            kern(self._grid(self.world * t_max * _ROW_SLICES), _launch.current_stream(self.pm._index), p_off, w_off,
                 layout.ranks.data_ptr(), layout.info.data_ptr(), layout.ids_all.data_ptr(), ptr, t_max,
                 rows.shape[1], self._geo(layout.cap, only, by_source))

    def _sum(self, p_off: int, t_max: int, layout: DeviceLayout, out: torch.Tensor,
             bases: tuple[int, ...] | None = None) -> None:
        """``out`` = each token's sum of the P rows (at ``p_off``) of the ranks it went to."""
        from collectives.peer import _launch

        if layout.tokens:
            kern = self.pm._kernel("rows_sum_dense", out.dtype, self._vec(out.data_ptr()), 7, bases)
            kern(self._grid(layout.tokens * _ROW_SLICES), _launch.current_stream(self.pm._index), p_off,
                 layout.ids_all.data_ptr(), out.data_ptr(), t_max, out.shape[1], self._geo(layout.cap), layout.tokens)

    def _check_rows(self, x: torch.Tensor) -> None:
        self._check_tokens(x.shape[0])
        if x.shape[1] * x.element_size() != self.row_bytes:
            raise InvalidArgumentError("x", x, f"has rows of {x.shape[1] * x.element_size()} B; the peer transport was "
                                       f"built for {self.row_bytes} B", "pass dtype= to MoEDispatcher and keep it")

    def _check_weights(self, rows: torch.Tensor, weights: torch.Tensor, tokens: int) -> int:
        hidden = self.row_bytes // rows.element_size()
        if rows.dim() != 2 or rows.shape[1] != hidden:
            raise InvalidArgumentError("expert_out", rows, f"is not [rows, {hidden}] {rows.dtype} (the rows the peer "
                                       f"transport was built for: {self.row_bytes} B)", "pass rows in recv_x's layout")
        if tuple(weights.shape) != (tokens, self.top_k):
            raise InvalidArgumentError("topk_weights", weights, f"is not [{tokens}, {self.top_k}] (the dispatch's "
                                       "tokens and k)", "pass the weights of the dispatched tokens")
        return hidden

    def _new_info(self, n: int, device: torch.device, zeroed: bool = True) -> torch.Tensor:
        """``[n, size]`` int32: per (source, local expert) counts, tokens and sends per rank, two
        error words, then the rows per local expert as int64 (``rows_layout``)."""
        size = _totals_at(self.world, self.e_loc) + 2 * self.e_loc
        return (torch.zeros if zeroed else torch.empty)((n, size), dtype=torch.int32, device=device)

    def _lay_out(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[_Region, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor]:
        """A dispatch's first half: this rank's tokens and ids posted, the barrier, every rank's ids
        ranked per local expert. Returns the region, ``info`` and the two tables."""
        self._check_rows(x)
        g = self._region(self._next_half(), self.max_tokens)
        info = self._new_info(1, x.device, zeroed=False)[0]
        self._post(g, x, topk_idx, info)
        self._fence()
        ids_all, ranks = self._layout(g, info)
        return g, info, ids_all, ranks

    def dispatch_dense(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, DeviceLayout]:
        """``recv_x`` and the layout, from ``x [tokens, hidden]`` (contiguous) and ``topk_idx``.

        Every rank's ids are checked on every rank (range, repeats) after the barrier, from the
        same copy: a bad routing raises the same ``InvalidArgumentError`` everywhere, naming the
        rank, and nothing has reached another rank's ``recv_x``.
        """
        g, info, ids_all, ranks = self._lay_out(x, topk_idx)
        # the experts' row ends, from the per-expert totals, issued while the host would only wait:
        # after the wait it need not copy them to the device (GroupedSwiGLU(..., ends=))
        at = _totals_at(self.world, self.e_loc)
        ends = torch.cumsum(info[at:at + 2 * self.e_loc].view(torch.int64), 0, dtype=torch.int32)
        counts = info.cpu().numpy()  # the one wait: the host learns how many rows arrive
        self._refuse_bad(counts, topk_idx)
        layout = DeviceLayout(ids_all, ranks, info, counts, topk_idx.shape[0], ends=ends)
        return self._gather(g, layout, x), layout

    def combine_dense(self, layout: DeviceLayout, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``out [tokens, hidden]`` for a ``dispatch_dense`` layout."""
        hidden = self._check_weights(rows, weights, layout.tokens)
        g = self._region(self._next_half(), self.max_tokens)
        out = rows.new_empty((layout.tokens, hidden))
        self._combine(g, layout, rows, weights, out)
        return out

    # -- the padded layout (low latency): nothing waits for the host, so a dispatch and its
    # combine can be captured in one CUDA graph (an even number of calls, so that replays keep
    # alternating the halves)
    def dispatch_padded(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 DeviceLayout]:
        """``recv_x [E/W, cap, hidden]`` (local expert e's rows first in its block, in source then
        token order; the rest of the block undefined), the rows per local expert (``[E/W]`` on the
        device) and the layout; ``cap`` = world x max_tokens, which no routing exceeds. The ids
        are not checked here (that needs the host): ``check_padded`` does, waiting."""
        g, info, ids_all, ranks = self._lay_out(x, topk_idx)
        cap = self.world * self.max_tokens
        layout = DeviceLayout(ids_all, ranks, info, None, topk_idx.shape[0], cap)
        recv = self._gather(g, layout, x).view(self.e_loc, cap, x.shape[1])
        at = _totals_at(self.world, self.e_loc)
        counts = info[at:at + 2 * self.e_loc].view(torch.int64)  # summed by rows_layout
        return recv, counts, layout

    def combine_padded(self, layout: DeviceLayout, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``out [tokens, hidden]`` from ``rows [E/W, cap, hidden]`` in ``dispatch_padded``'s layout."""
        hidden = self.row_bytes // rows.element_size()
        if tuple(rows.shape) != (self.e_loc, layout.cap, hidden):
            raise InvalidArgumentError("expert_out", rows, f"is not [{self.e_loc}, {layout.cap}, {hidden}] (the padded "
                                       "layout of the dispatch)", "pass the experts' output in recv_x's layout")
        flat = rows.contiguous().view(self.e_loc * layout.cap, hidden)
        self._check_weights(flat, weights, layout.tokens)
        g = self._region(self._next_half(), self.max_tokens)
        out = rows.new_empty((layout.tokens, hidden))
        self._combine(g, layout, flat, weights, out)
        return out

    def check_padded(self, layout: DeviceLayout, topk_idx: torch.Tensor) -> None:
        """Raise what ``dispatch_dense`` would have raised for this dispatch's ids (waits for it)."""
        self._refuse_bad(layout.info.cpu().numpy(), topk_idx)

    def combine_backward_dense(self, layout: DeviceLayout, grad_out: torch.Tensor, rows: torch.Tensor,
                               weights: torch.Tensor, weights_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Combine's backward over the device layout: ``grad_rows[row of (t, j)] = weights[t, j] *
        grad_out[t]`` (each token's gradient read once per rank) and, with ``weights_grad``, the
        weights' gradient ``<grad_out[t], rows[row of (t, j)]>`` (taken where the rows are, one float
        back per pair). Every rank passes the same ``weights_grad``."""
        from collectives.peer import _launch

        hidden = self._check_weights(rows, weights, layout.tokens)
        W, k, T, t_max = self.world, self.top_k, layout.tokens, self.max_tokens
        g = self._region(self._next_half(), t_max)
        d_off = g.x + t_max * self.row_bytes  # D after this rank's gradient rows (dense_backward_fits)
        stream = _launch.current_stream(self.pm._index)
        ke = self._geo(layout.cap)
        if T:
            self.pm.slot_view(g.x, (T, hidden), grad_out.dtype).copy_(grad_out)
        self._post_weights(g, weights)
        self._fence()
        grad_rows = torch.empty_like(rows)
        if rows.shape[0]:
            kern = self.pm._kernel("rows_grad_dense", rows.dtype, self._vec(rows.data_ptr(), grad_rows.data_ptr()), 12)
            kern(self._grid(W * t_max), stream, g.x, g.w, d_off, layout.ranks.data_ptr(), layout.info.data_ptr(),
                 layout.ids_all.data_ptr(), rows.data_ptr(), grad_rows.data_ptr(), t_max, hidden, ke, int(weights_grad))
        if not weights_grad:
            return grad_rows, None
        self._fence()
        gw = torch.empty(T * k, dtype=torch.float32, device=rows.device)
        if T:
            self.pm._kernel("rows_dots_dense", None, False, 6)(max(1, min(_MAX_GRID, -(-T * k // 512))), stream, d_off,
                                                                layout.ids_all.data_ptr(), gw.data_ptr(), t_max, ke, T)
        return grad_rows, gw

    def pipelined_dense(self, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                        experts: Any, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """dispatch -> experts -> combine over the token ranges ``bounds`` (``len(bounds)`` the same
        on every rank), chunk c+1's rows arriving while the experts compute chunk c, and chunk c's
        results returning while chunk c+1 is computed. The rows move by SM kernels on a side
        stream (``_pipelined_sm``) or, with ``pipeline_transfers="copy_engine"``, by copy engines
        (``_pipelined_ce``); ``last_pipeline`` records which and why."""
        n = len(bounds)
        if n > MAX_CHUNKS:
            raise InvalidArgumentError("chunks", n, f"exceeds the {MAX_CHUNKS} chunks the peer buffer is cut for",
                                       f"use at most {MAX_CHUNKS} chunks")
        t_cap = -(-self.max_tokens // n)
        for lo, hi in bounds:
            if hi - lo > t_cap:
                raise InvalidArgumentError("chunks", n, f"makes a chunk of {hi - lo} tokens; regions hold {t_cap}",
                                           "split the tokens evenly")
        self._check_rows(x)
        mode, why = self._pipeline_mode(n)
        self.last_pipeline = (mode, why)
        if mode == "copy_engine":
            return self._pipelined_ce(x, topk_idx, weights, experts, bounds)
        return self._pipelined_sm(x, topk_idx, weights, experts, bounds)

    def _pipeline_mode(self, n: int) -> tuple[str, str]:
        """How a pipelined forward of ``n`` chunks moves its rows (the same answer on every rank:
        it depends on the settings and the buffer only)."""
        if self.pipeline_transfers == "copy_engine":
            need = ce_section_bytes(self.world, self.max_tokens, self.top_k, self.row_bytes, n)
            if need > self.pm.slot_bytes:
                raise InvalidArgumentError("pipeline_transfers", "copy_engine", f"needs {need} B of peer buffer for "
                                           f"{n} chunks; it has {self.pm.slot_bytes} B",
                                           "build the transport with pipeline_transfers='copy_engine' (which sizes "
                                           "it by buffer_bytes(copy_engine=True)) or use 'sm'")
            return "copy_engine", "pipeline_transfers='copy_engine' was set"
        if self.pipeline_transfers == "sm":
            return "sm", "pipeline_transfers='sm' was set"
        # 2xH200 (bench/results/gpu_2xh200_moe_pipeline.json): the copy engines were ahead of the
        # SM kernels in 3 of 10 (configuration, chunks) cases, by at most 3.5%, and behind by up
        # to 12.5% in the others: the row kernels left on the experts' stream (gather, partial
        # sums, sums) cost about as much as the link time the copies hide
        return "sm", "the copy-engine pipeline measured no gain over SM kernels on 2xH200"

    def _push_posted(self, stream: int, slot: int, b: int, t_cap: int, n: int) -> None:
        """On copy stream ``stream``: this rank's ``n`` posted tokens and weights (at its place in
        the copy-engine block at ``b``, ``ce_block``) to the same place in every peer's buffer,
        then flag ``slot`` PUSHED at each peer."""
        pm, W, r, k, row = self.pm, self.world, self.rank, self.top_k, self.row_bytes
        X, WT = ce_block(W, t_cap, k, row)[:2]
        own, x_at, w_at = pm.slot_pointers[r], b + X + r * t_cap * row, b + WT + r * t_cap * k * 4
        for q in ((r + d) % W for d in range(1, W)):
            if n:
                pm.ce_push(stream, q, x_at, own + x_at, n * row)
                pm.ce_push(stream, q, w_at, own + w_at, n * k * 4)
            pm.ce_signal(stream, q, slot, CE_PUSHED, 1)

    def _refuse_bad_in_section(self, st: _Streams, counts: np.ndarray, topk_idx: torch.Tensor) -> None:
        """After a copy-engine section's counts: if any chunk's routing is bad (the same on every
        rank), a barrier that zeroes this rank's flags, then the error; else the device's own check."""
        bad = [c for c in range(counts.shape[0]) if counts[c][_errors_at(self.world, self.e_loc):][:2].any()]
        if bad:
            st.join()
            self.pm.barrier(clear=True)
            self.calls += 2
            self._refuse_bad(counts[bad[0]], topk_idx)
        self.check()

    def _pipelined_ce(self, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                      experts: Any, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """The pipeline with every byte between GPUs moved by copy engines, and every kernel,
        the experts' included, on the caller's stream.

        Chunk c has a block of the buffer (``ce_block``). Each rank posts its tokens and weights
        at its own place in the block (X, WT) and its ids in I, where the peers read them; the
        copy engines then copy the tokens and weights to the same place in every peer's buffer.
        The row kernels run on what lies in this rank's buffer (their context's "rank s" is
        rank s's place here: ``PeerMemory._kernel``'s ``bases``): the gather reads X, the
        partial sums write OUT (rank q's rows at q's place), whose blocks the copy engines copy
        into the peers' IN, and the sums read IN (and OUT for this rank's own part). A copy's
        arrival is a copy-engine flag that the peer sets after it (slot c; PUSHED for the tokens,
        REDUCED for the partial rows), waited for by a bounded kernel just before its reader.

            copy stream 0:  X,WT 0 -> peers | X,WT 1 -> peers | ...
            caller's:       post 0..n-1 | fence | layout 0..n-1 | wait X 0, gather 0 | experts 0 | partial 0 |
                            wait X 1, gather 1 | experts 1 | partial 1 | wait P 0, sum 0 | ...
            copy stream 1:                                      OUT 0 -> peers |       OUT 1 -> peers | ...
        """
        from collectives.peer import _launch

        pm, n, W, r, k, row = self.pm, len(bounds), self.world, self.rank, self.top_k, self.row_bytes
        t_cap = -(-self.max_tokens // n)
        X, WT, OUT, IN, size = ce_block(W, t_cap, k, row)
        rb, wb = t_cap * row, t_cap * k * 4  # one rank's place in X, OUT and IN; in WT
        own = pm.slot_pointers[r]
        peers = [(r + d) % W for d in range(1, W)]
        gather_at = tuple(s * rb for s in range(W))
        partial_at = tuple(s * wb for s in range(W))  # weights at s's place; P written at OUT - r * wb + ...
        sum_at = tuple((OUT - IN) if q == r else (q - r) * rb for q in range(W))
        st = _Streams(self, x.device)
        main = _launch.current_stream(pm._index)
        self._fence()  # every peer is done with what it read before this section
        info = self._new_info(n, x.device)
        for c, (lo, hi) in enumerate(bounds):
            b = c * size
            mine = _Region(b + WT + r * wb, b, b + X + r * rb, t_cap)
            self._post(mine, x[lo:hi], topk_idx[lo:hi], info[c])
            self._post_weights(mine, weights[lo:hi])
        ps = st.copy_stream(0)
        for c, (lo, hi) in enumerate(bounds):
            self._push_posted(ps, c, c * size, t_cap, hi - lo)
        self._fence()  # the ids are posted
        layouts = [self._layout(_Region(0, c * size, 0, t_cap), info[c]) for c in range(n)]
        counts = info.cpu().numpy()  # the one wait, for every chunk
        self._refuse_bad_in_section(st, counts, topk_idx)
        out = x.new_empty((x.shape[0], x.shape[1]))
        lays = [DeviceLayout(*layouts[c], info[c], counts[c], hi - lo) for c, (lo, hi) in enumerate(bounds)]

        def summed(c: int) -> None:
            pm.ce_wait(main, c, CE_REDUCED, 1, kernel=True)
            lo, hi = bounds[c]
            self._sum(c * size + IN, t_cap, lays[c], out[lo:hi], sum_at)

        for c, (lo, hi) in enumerate(bounds):
            b = c * size
            pm.ce_wait(main, c, CE_PUSHED, 1, kernel=True)
            recv = self._gather(_Region(0, 0, b + X, t_cap), lays[c], x, gather_at)
            per_expert = counts[c][:W * self.e_loc].reshape(W, self.e_loc).sum(0).tolist()
            y = experts(recv, per_expert).contiguous()
            self._partial(b + OUT - r * wb, b + WT, t_cap, lays[c], y, partial_at)
            ls = st.copy_stream(1)
            for q in peers:
                t_q = int(counts[c][W * self.e_loc + q])
                if t_q:
                    pm.ce_push(ls, q, b + IN + r * rb, own + b + OUT + q * rb, t_q * row)
                pm.ce_signal(ls, q, c, CE_REDUCED, 1)
            if c:
                summed(c - 1)
        summed(n - 1)
        st.join(out)  # every copy and signal of this rank issued before the closing barrier
        pm.barrier(clear=True)  # every rank has what it waited for; this rank's flags back to zero
        self.calls += 2
        return out

    def _mark(self, step: str) -> None:
        if self.trace is not None:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.trace.append((step, ev))

    def timeline(self) -> list[tuple[str, float]]:
        """The traced call's steps (``trace``), each with the microseconds from the first step to
        the end of it on the caller's stream; waits for the last event."""
        if not self.trace:
            return []
        self.trace[-1][1].synchronize()
        t0 = self.trace[0][1]
        return [(step, round(t0.elapsed_time(ev) * 1e3, 1)) for step, ev in self.trace]

    def pipelined_sources(self, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                          experts: Any) -> torch.Tensor:
        """dispatch -> experts -> combine pipelined by source rank, ``experts`` a ``GroupedSwiGLU``
        (its weights go to ``overlap/_grouped_gemm.py``'s kernels).

        A token chunk shrinks every expert's GEMM, and its gather, partial sums and sums run
        beside the link time they hide (bench/results/README.md, gpu_2xh200_moe_pipeline). Here
        the unit is a source rank: this rank's own tokens need no transfer, so their gate and up
        products run while the copy engines carry every rank's tokens (and fp32 weights) to
        every peer, at the sender's place in one block (``ce_block``, one chunk of ``max_tokens``).
        The pairs are laid out by source (each source's rows together, grouped by local expert:
        ``_geo(by_source=True)``), and the gate/up kernel reads each pair's token from that table
        by index (``rows_index_dense``), so no ``recv_x`` is gathered. Then each peer's rows run
        the gate/up and down products (the down product by torch's grouped GEMM on the source's
        contiguous rows, or Triton's at few rows per expert or where torch has none), its partial
        rows (``rows_partial_dense`` for that source alone) go back by copy engine, and the next
        source computes while they travel; this rank's own down products and partial rows come
        last, beside the last return. On one H200 (a scratch probe, 2026-12-01, not kept) the
        experts' part of this for two sources (gathered gate/up and torch's down product, per
        source) took 1.01-1.06x the time of a gather and ``GroupedSwiGLU.forward`` at four prefill
        shapes and 1.20x at top-1 h4096 f1024 (827 against 688 us): halving each expert's rows
        costs the gate/up kernel waves.

            copy stream 0:  X, WT -> peers
            caller's:       post | fence | layout, index | gate/up (own) | wait X (s) | gate/up (s), down (s),
                            partial (s) | ... | down (own), partial (own) | wait P | sum
            side stream:                          counts -> host (the host's one wait)
            copy stream 1:                                                         P (s) -> s | ...

        Each rank pushes to r + 1 first, then r + 2, ...; so rank r computes rank r - 1's pairs
        first, then r - 2's, ..., the order in which their tokens should land."""
        from collectives.peer import _launch

        from . import _grouped_gemm

        pm, W, r, k, row, e_loc = self.pm, self.world, self.rank, self.top_k, self.row_bytes, self.e_loc
        self._check_rows(x)
        t_cap = self.max_tokens
        X, WT, OUT, IN, size = ce_block(W, t_cap, k, row)
        if size > pm.slot_bytes:
            raise InvalidArgumentError("pipeline_transfers", self.pipeline_transfers, f"leaves a peer buffer of "
                                       f"{pm.slot_bytes} B; the pipeline by source needs {size} B",
                                       "build the dispatcher with pipeline_transfers='copy_engine'")
        self.last_pipeline = ("copy_engine", "by source rank: the experts read the tokens the copy engines carry")
        rb, wb = t_cap * row, t_cap * k * 4
        own = pm.slot_pointers[r]
        peers = [(r + d) % W for d in range(1, W)]
        partial_at = tuple(s * wb for s in range(W))
        sum_at = tuple((OUT - IN) if q == r else (q - r) * rb for q in range(W))
        st = _Streams(self, x.device)
        main = _launch.current_stream(pm._index)
        n = x.shape[0]
        self._mark("start")
        self._fence()  # every peer is done with what it read before this section
        info = self._new_info(1, x.device)
        mine = _Region(WT + r * wb, 0, X + r * rb, t_cap)
        self._post(mine, x, topk_idx, info[0])
        self._post_weights(mine, weights)
        self._push_posted(st.copy_stream(0), 0, 0, t_cap, n)
        self._mark("post")
        self._fence()  # the ids are posted
        ids_all, ranks = self._layout(_Region(0, 0, 0, t_cap), info[0])
        # The rows laid out by source (each source's rows together, grouped by local expert), this
        # rank's own first (``_geo(by_source=True)``), so that torch's grouped GEMM can take a
        # source's down product. The segments are worked out on the device, and this rank's own
        # gate/up product is issued before the host waits for the counts: the GPU goes from the
        # layout to the experts without waiting for the host. Its rows are at most n * min(k, E/W).
        ring = [(r + i) % W for i in range(W)]  # the layout's order of sources
        # [first row, rows, end within the source's rows, first row after the own rows] of each
        # (source, local expert), written by the index kernel (no torch operations to issue)
        seg = torch.empty((4, W, e_loc), dtype=torch.int32, device=x.device)
        most = W * t_cap * min(k, e_loc)  # pairs at most: the counts are not on the host yet
        index = torch.empty(most, dtype=torch.int32, device=x.device)  # read within the segments only
        pm._kernel("rows_index_dense", None, False, 7)(self._grid(W * t_cap), main, ranks.data_ptr(),
                                                        info[0].data_ptr(), ids_all.data_ptr(), index.data_ptr(),
                                                        t_cap, self._geo(by_source=True), seg.data_ptr())
        table = pm.slot_view(X, (W * t_cap, x.shape[1]), x.dtype)
        own_act = x.new_empty((n * min(k, e_loc), experts.w1.shape[2]))
        laid_out = st.main_mark()
        self._mark("layout")
        if n:
            _grouped_gemm.grouped_swiglu_segments(table, experts.w1, experts.w3, seg[0, r], seg[1, r],
                                                  own_act, index=index[:own_act.shape[0]])
        self._mark(f"gate/up {r}")
        # The counts go to the host from the side stream, after the layout but not after the
        # gate/up product: issued only now, so that the GPU starts the product without waiting
        # for the host to issue the copy first.
        if self._pinned is None or self._pinned.shape != info.shape:
            self._pinned = torch.empty(info.shape, dtype=info.dtype, pin_memory=x.is_cuda)
        arrived = st.to_host_beside(info, self._pinned, after=laid_out)
        out = x.new_empty((n, x.shape[1]))
        arrived()  # the one wait: for the counts, not for the gate/up product issued before them
        counts = self._pinned.numpy().copy()
        self._refuse_bad_in_section(st, counts, topk_idx)
        lay = DeviceLayout(ids_all, ranks, info[0], counts[0], n)
        cnt = counts[0][:W * e_loc].reshape(W, e_loc).astype(np.int64)  # [source, local expert]
        first = np.zeros(W + 1, dtype=np.int64)  # first[s]: source s's first row; first[W]: the rows
        for i, s_ in enumerate(ring[1:], 1):
            first[s_] = first[ring[i - 1]] + cnt[ring[i - 1]].sum()
        first[W] = cnt.sum()
        own_rows = int(cnt[r].sum())  # this rank's own rows (the first); the peers' follow, in act
        act = x.new_empty((int(first[W]) - own_rows, experts.w1.shape[2]))  # the peers' rows (seg[3]: their starts)
        torch_down = grouped_mm_works(x.device, x.dtype)

        def down(s: int) -> None:
            lo, rows = int(first[s]), int(cnt[s].sum())
            if not rows:
                return
            a = own_act[:rows] if s == r else act[lo - own_rows:lo - own_rows + rows]
            if torch_down and not _grouped_gemm.few_rows(rows, e_loc):
                y = torch._grouped_mm(a, experts.w2, offs=seg[2, s])
            else:  # few rows per expert (a decode step), or no grouped GEMM of torch's here
                y = _grouped_gemm.grouped_mm(a, experts.w2, seg[2, s])
            self._mark(f"down {s}")
            self._partial(OUT - r * wb, WT, t_cap, lay, y, partial_at, only=s, by_source=True, first_row=lo)
            self._mark(f"partial {s}")

        for s in reversed(peers):  # rank r - 1 pushes to this rank first, r - 2 second, ...
            pm.ce_wait(main, 0, CE_PUSHED, 1, kernel=True, source=s)
            self._mark(f"tokens of {s}")
            if cnt[s].any():
                _grouped_gemm.grouped_swiglu_segments(table, experts.w1, experts.w3, seg[3, s], seg[1, s], act,
                                                      index=index[own_rows:int(first[W])])
            self._mark(f"gate/up {s}")
            down(s)
            ls = st.copy_stream(1)
            t_s = int(counts[0][W * e_loc + s])
            if t_s:
                pm.ce_push(ls, s, IN + r * rb, own + OUT + s * rb, t_s * row)
            pm.ce_signal(ls, s, 0, CE_REDUCED, 1)
        down(r)
        if peers:
            pm.ce_wait(main, 0, CE_REDUCED, 1, kernel=True)
        self._mark("partial rows back")
        self._sum(IN, t_cap, lay, out, sum_at)
        self._mark("sum")
        st.join(out, own_act, act, index, seg)  # every copy and signal issued before the closing barrier
        pm.barrier(clear=True)  # every rank has what it waited for; this rank's flags back to zero
        self.calls += 2
        return out

    def _pipelined_sm(self, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                      experts: Any, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """The pipeline over SM kernels. The peer buffer's two halves are cut into ``2 n`` regions
        of ``ceil(max_tokens / n)`` tokens, one per call of the section (n dispatches, then n
        combines), so that no region is written while a peer may still read it; barriers bracket
        the section.

            side stream:  post+layout 0..n-1 | gather 0 | gather 1 | ... | combine 0 | combine 1 | ...
            host:                        counts (one wait)
            main stream:                         | experts 0 | experts 1 | ...
        """
        n = len(bounds)
        t_cap = -(-self.max_tokens // n)
        reg = layout_bytes(self.world, t_cap, self.top_k, self.row_bytes)[2]
        if 2 * n * reg > self.pm.slot_bytes:
            raise InvalidArgumentError("chunks", n, f"needs {2 * n} regions of {reg} B; the peer buffer has "
                                       f"{self.pm.slot_bytes} B", "use fewer chunks")
        st = _Streams(self, x.device)
        regions = [self._region(r * reg, t_cap) for r in range(2 * n)]
        with st.on_side():
            self._fence()  # every peer is done with what it read before this section
            info = self._new_info(n, x.device)
            layouts = []
            for c, (lo, hi) in enumerate(bounds):
                self._post(regions[c], x[lo:hi], topk_idx[lo:hi])
                self._fence()
                layouts.append(self._layout(regions[c], info[c]))
            counts = info.cpu().numpy()  # the one wait, for every chunk
            for c in range(n):
                self._refuse_bad(counts[c], topk_idx)
            got = []
            for c, (lo, hi) in enumerate(bounds):
                lay = DeviceLayout(*layouts[c], info[c], counts[c], hi - lo)
                recv = self._gather(regions[c], lay, x)
                got.append((lay, recv, st.side_mark()))
            out = x.new_empty((x.shape[0], x.shape[1]))
        w, e_loc = self.world, self.e_loc
        for c, (lo, hi) in enumerate(bounds):
            lay, recv, arrived = got[c]
            st.main_waits(arrived, recv)
            per_expert = counts[c][:w * e_loc].reshape(w, e_loc).sum(0).tolist()
            y = experts(recv, per_expert).contiguous()
            computed = st.main_mark()
            with st.on_side():
                st.side_waits(computed, y)
                self._combine(regions[n + c], lay, y, weights[lo:hi], out[lo:hi])
        with st.on_side():
            self._fence()  # every peer has read this section's regions
        st.join(out)
        self.calls += 2  # the next call starts a fresh pair of halves (after the closing barrier)
        return out

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.pm.device)
        return self._side

    def check(self) -> None:
        """Raise ``CollectiveTimeout`` if a barrier of this transport gave up waiting for a peer."""
        self.pm.check()

    def close(self) -> None:
        """Release the peer buffer (collective)."""
        self.pm.close()

