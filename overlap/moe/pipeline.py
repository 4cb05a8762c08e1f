"""The peer transport's pipelined forwards: over token chunks (SM kernels or copy engines) and by source rank.

Design note. A pipelined forward (``TokenPipelines.pipelined_dense``) runs the row kernels
chunk by chunk on a side stream, or, asked for, moves every byte by copy engines into each
rank's place in the peers' buffers and runs the same kernels on local memory
(``_pipelined_ce``): a kernel's context can name, as "rank q's buffer", a place in this rank's
own (``PeerMemory.kernel``'s ``bases``), so no kernel needed a second version. On 2xH200 neither
beat the plain sequence (bench/results/README.md). The pipeline by source rank
(``SourcePipeline.pipelined_sources``) takes a source rank as its unit instead of a token chunk;
its docstring has the timeline. ``_Streams`` orders the caller's stream, the side stream and
the copy streams by events.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from collectives.errors import InvalidArgumentError
from collectives.peer import CE_PUSHED, CE_REDUCED

from . import _grouped_gemm
from .experts import grouped_mm_works
from .peer_kernels import ROWS_SOURCE, RowKernels
from .peer_plan import MAX_CHUNKS, DeviceLayout, Region, ce_block, ce_section_bytes, errors_at, layout_bytes

__all__ = ["TokenPipelines", "SourcePipeline"]


class _Streams:
    """The pipelined section's two streams: the caller's (main: the experts) and the transport's
    side stream (the exchanges), ordered by events; a tensor used on the other stream is recorded
    there (the caching allocator then keeps it until that stream is done with it)."""

    def __init__(self, rows: Any, device: torch.device) -> None:
        self.main = torch.cuda.current_stream(device)
        self.side = rows._side_stream()
        self.side.wait_stream(self.main)
        self.copies = rows.pm.copy_engines.streams

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


class TokenPipelines(RowKernels):
    """The pipelined forwards over token chunks (``pipelined_dense``), and the trace of a call."""

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

    def _pipelined_ce(self, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                      experts: Any, bounds: list[tuple[int, int]]) -> torch.Tensor:
        """The pipeline with every byte between GPUs moved by copy engines, and every kernel,
        the experts' included, on the caller's stream.

        Chunk c has a block of the buffer (``ce_block``). Each rank posts its tokens and weights
        at its own place in the block (X, WT) and its ids in I, where the peers read them; the
        copy engines then copy the tokens and weights to the same place in every peer's buffer.
        The row kernels run on what lies in this rank's buffer (their context's "rank s" is
        rank s's place here: ``PeerMemory.kernel``'s ``bases``): the gather reads X, the
        partial sums write OUT (rank q's rows at q's place), whose blocks the copy engines copy
        into the peers' IN, and the sums read IN (and OUT for this rank's own part). A copy's
        arrival is a copy-engine flag that the peer sets after it (slot c; PUSHED for the tokens,
        REDUCED for the partial rows), waited for by a bounded kernel just before its reader.

            copy stream 0:  X,WT 0 -> peers | X,WT 1 -> peers | ...
            caller's:       post 0..n-1 | fence | layout 0..n-1 | wait X 0, gather 0 | experts 0 | partial 0 |
                            wait X 1, gather 1 | experts 1 | partial 1 | wait P 0, sum 0 | ...
            copy stream 1:                                      OUT 0 -> peers |       OUT 1 -> peers | ...
        """
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
        main = pm.stream()
        self._fence()  # every peer is done with what it read before this section
        info = self._new_info(n, x.device)
        for c, (lo, hi) in enumerate(bounds):
            b = c * size
            mine = Region(b + WT + r * wb, b, b + X + r * rb, t_cap)
            self._post(mine, x[lo:hi], topk_idx[lo:hi], info[c])
            self._post_weights(mine, weights[lo:hi])
        ps = st.copy_stream(0)
        for c, (lo, hi) in enumerate(bounds):
            self._push_posted(ps, c, c * size, t_cap, hi - lo)
        self._fence()  # the ids are posted
        layouts = [self._layout(Region(0, c * size, 0, t_cap), info[c]) for c in range(n)]
        counts = info.cpu().numpy()  # the one wait, for every chunk
        self._refuse_bad_in_section(st, counts, topk_idx)
        out = x.new_empty((x.shape[0], x.shape[1]))
        lays = [DeviceLayout(*layouts[c], info[c], counts[c], hi - lo) for c, (lo, hi) in enumerate(bounds)]

        def summed(c: int) -> None:
            pm.copy_engines.wait(main, c, CE_REDUCED, 1, kernel=True)
            lo, hi = bounds[c]
            self._sum(c * size + IN, t_cap, lays[c], out[lo:hi], sum_at)

        for c, (lo, hi) in enumerate(bounds):
            b = c * size
            pm.copy_engines.wait(main, c, CE_PUSHED, 1, kernel=True)
            recv = self._gather(Region(0, 0, b + X, t_cap), lays[c], x, gather_at)
            per_expert = counts[c][:W * self.e_loc].reshape(W, self.e_loc).sum(0).tolist()
            y = experts(recv, per_expert).contiguous()
            self._partial(b + OUT - r * wb, b + WT, t_cap, lays[c], y, partial_at)
            ls = st.copy_stream(1)
            for q in peers:
                t_q = int(counts[c][W * self.e_loc + q])
                if t_q:
                    pm.copy_engines.push(ls, q, b + IN + r * rb, own + b + OUT + q * rb, t_q * row)
                pm.copy_engines.signal(ls, q, c, CE_REDUCED, 1)
            if c:
                summed(c - 1)
        summed(n - 1)
        st.join(out)  # every copy and signal of this rank issued before the closing barrier
        pm.barrier(clear=True)  # every rank has what it waited for; this rank's flags back to zero
        self.calls += 2
        return out

    def _push_posted(self, stream: int, slot: int, b: int, t_cap: int, n: int) -> None:
        """On copy stream ``stream``: this rank's ``n`` posted tokens and weights (at its place in
        the copy-engine block at ``b``, ``ce_block``) to the same place in every peer's buffer,
        then flag ``slot`` PUSHED at each peer."""
        pm, W, r, k, row = self.pm, self.world, self.rank, self.top_k, self.row_bytes
        X, WT = ce_block(W, t_cap, k, row)[:2]
        own, x_at, w_at = pm.slot_pointers[r], b + X + r * t_cap * row, b + WT + r * t_cap * k * 4
        for q in ((r + d) % W for d in range(1, W)):
            if n:
                pm.copy_engines.push(stream, q, x_at, own + x_at, n * row)
                pm.copy_engines.push(stream, q, w_at, own + w_at, n * k * 4)
            pm.copy_engines.signal(stream, q, slot, CE_PUSHED, 1)

    def _refuse_bad_in_section(self, st: _Streams, counts: np.ndarray, topk_idx: torch.Tensor) -> None:
        """After a copy-engine section's counts: if any chunk's routing is bad (the same on every
        rank), a barrier that zeroes this rank's flags, then the error; else the device's own check."""
        bad = [c for c in range(counts.shape[0]) if counts[c][errors_at(self.world, self.e_loc):][:2].any()]
        if bad:
            st.join()
            self.pm.barrier(clear=True)
            self.calls += 2
            self._refuse_bad(counts[bad[0]], topk_idx)
        self.check()

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.pm.device)
        return self._side

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


class SourcePipeline(TokenPipelines):
    """The pipelined forward by source rank (``pipelined_sources``)."""

    def pipelined_sources(self, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                          experts: Any) -> torch.Tensor:
        """dispatch -> experts -> combine pipelined by source rank, ``experts`` a ``GroupedSwiGLU``
        (its weights go to ``overlap/moe/_grouped_gemm.py``'s kernels).

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
        main = pm.stream()
        n = x.shape[0]
        self._mark("start")
        self._fence()  # every peer is done with what it read before this section
        info = self._new_info(1, x.device)
        mine = Region(WT + r * wb, 0, X + r * rb, t_cap)
        self._post(mine, x, topk_idx, info[0])
        self._post_weights(mine, weights)
        self._push_posted(st.copy_stream(0), 0, 0, t_cap, n)
        self._mark("post")
        self._fence()  # the ids are posted
        ids_all, ranks = self._layout(Region(0, 0, 0, t_cap), info[0])
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
        pm.kernel("rows_index_dense", None, False, 7, source=ROWS_SOURCE)(self._grid(W * t_cap), main, ranks.data_ptr(),
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
            pm.copy_engines.wait(main, 0, CE_PUSHED, 1, kernel=True, source=s)
            self._mark(f"tokens of {s}")
            if cnt[s].any():
                _grouped_gemm.grouped_swiglu_segments(table, experts.w1, experts.w3, seg[3, s], seg[1, s], act,
                                                      index=index[own_rows:int(first[W])])
            self._mark(f"gate/up {s}")
            down(s)
            ls = st.copy_stream(1)
            t_s = int(counts[0][W * e_loc + s])
            if t_s:
                pm.copy_engines.push(ls, s, IN + r * rb, own + OUT + s * rb, t_s * row)
            pm.copy_engines.signal(ls, s, 0, CE_REDUCED, 1)
        down(r)
        if peers:
            pm.copy_engines.wait(main, 0, CE_REDUCED, 1, kernel=True)
        self._mark("partial rows back")
        self._sum(IN, t_cap, lay, out, sum_at)
        self._mark("sum")
        st.join(out, own_act, act, index, seg)  # every copy and signal issued before the closing barrier
        pm.barrier(clear=True)  # every rank has what it waited for; this rank's flags back to zero
        self.calls += 2
        return out
