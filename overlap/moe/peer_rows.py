"""MoE dispatch and combine by SM kernels that read and write the peers' memory (``transport="peer"``).

Design note. Over ``all_to_all_single`` a dispatch costs three passes over every (token,
expert) row: a gather into per-destination order, the transfer, and a regroup by expert; and a
token bound for four experts of one rank crosses the link four times. Here each rank copies its
tokens once into its own peer buffer, and every rank *pulls* what it needs with one kernel
(``rows_gather`` in ``overlap/moe/rows.cu``): each (source rank, token) it needs is read
once, over NVLink when the source is a peer, and written straight into every ``recv_x`` row that
wants it. Combine is the mirror image: the experts' rank sums, per (token, source rank), the
weighted rows of its own experts (``rows_partial``, the weights read from the token's rank),
and the token's rank reads one partial row per rank and adds them (``rows_sum``). So one row per
(token, destination rank) crosses the link each way, however many of that rank's experts the
token chose, and nothing is gathered or regrouped in a separate pass.

Every rank learns every rank's routing, in one of two ways. Dropless (the usual case), the
routing is laid out on the GPUs (``dispatch_dense``, below). With a capacity factor, the ranks
all-gather their ``topk_idx`` (a few hundred kilobytes) instead of exchanging counts, and each
rank plans in numpy what it pulls and where its partial rows go (``peer_plan.plan``), applying
every source's capacity limit itself.

Each call uses one half of the transport's peer buffer, behind a barrier (``peer_kernels.py``)::

    dispatch:  x -> my half (X) | fence | rows_gather: peers' X -> recv_x
    combine:   weights -> my half (W) | fence | rows_partial: rows -> my half (P) | fence
               | rows_sum: peers' P -> out

Laid out on the GPUs (``dispatch_dense``), each rank copies its ids into its own buffer,
kernels rank every token per local expert, and the host learns only the counts (the ``_dense``
kernels). Autograd then runs on the same kernels: dispatch's backward is a combine with unit
weights; combine's backward reads each token's output gradient once per rank, writes it scaled
into every row of that rank's pairs, and takes each pair's weight gradient as a dot product where
the rows are (one float per pair goes back). The padded layout (``dispatch_padded``) waits for
nothing on the host: the low-latency pair. The pipelined forwards are ``pipeline.py``'s.
"""

from __future__ import annotations

import torch

from collectives.errors import InvalidArgumentError

from .peer_kernels import MAX_GRID, ROWS_SOURCE
from .peer_plan import DeviceLayout, PeerPlan, totals_at
from .pipeline import SourcePipeline

__all__ = ["PeerRows"]


class PeerRows(SourcePipeline):
    """The peer transport of one dispatcher: its own peer buffer and the row kernels
    (``RowKernels``: the constructor's arguments are its), the exchanges below, and the
    pipelines (``TokenPipelines``, ``SourcePipeline``). Built once, collective; ``close()`` is
    collective.
    """

    def dispatch(self, p: PeerPlan, x: torch.Tensor, total: int, packed: bool = False) -> torch.Tensor:
        """``recv_x [total, hidden]`` (``x`` contiguous ``[tokens, hidden]``; ``packed``: rows of
        raw bytes as float32 words, no wider than the tokens', the FP8 dispatch's, and then
        ``recv_x`` has ``x``'s width)."""
        self._check_rows(x, packed)
        g = self._region(self._next_half(), self.max_tokens)
        recv = x.new_empty((total, x.shape[1]))
        if x.shape[0]:
            self.pm.slot_view(g.x, tuple(x.shape), x.dtype).copy_(x)
        self._fence()
        if p.n_items:
            vec = self._vec(recv.data_ptr(), row_bytes=x.shape[1] * x.element_size())
            k = self.pm.kernel("rows_gather", x.dtype, vec, 7, source=ROWS_SOURCE)
            k(self._grid(p.n_items), self.pm.stream(), p.items.data_ptr(), p.ptr.data_ptr(),
              p.dst.data_ptr(), recv.data_ptr(), p.n_items, x.shape[1], g.x)
        return recv

    def combine(self, p: PeerPlan, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``out [tokens, hidden]``: each token's weighted sum of its rows (``rows`` in ``recv_x``'s
        layout, contiguous; ``weights`` this rank's ``[tokens, k]``)."""
        n = p.n_tokens
        self._check_tokens(n)
        hidden = self._check_weights(rows, weights, n)
        g = self._region(self._next_half(), self.max_tokens)
        stream = self.pm.stream()
        self._post_weights(g, weights)
        self._fence()
        if p.n_items:
            k = self.pm.kernel("rows_partial", rows.dtype, self._vec(rows.data_ptr()), 8, source=ROWS_SOURCE)
            k(self._grid(p.n_items), stream, p.part.data_ptr(), p.ptr.data_ptr(), p.part_ent.data_ptr(),
              rows.data_ptr(), p.n_items, hidden, g.x, g.w)
        self._fence()
        out = rows.new_empty((n, hidden))
        if n:
            k = self.pm.kernel("rows_sum", rows.dtype, self._vec(out.data_ptr()), 6, source=ROWS_SOURCE)
            k(self._grid(n), stream, p.sum_ptr.data_ptr(), p.sum_ent.data_ptr(), out.data_ptr(), n, hidden, g.x)
        return out

    # -- the device-side layout (dropless): no host plan, one small copy to the host
    def dispatch_dense(self, x: torch.Tensor, topk_idx: torch.Tensor, packed: bool = False
                       ) -> tuple[torch.Tensor, DeviceLayout]:
        """``recv_x`` and the layout, from ``x [tokens, hidden]`` (contiguous; ``packed``: as
        ``dispatch``'s) and ``topk_idx``.

        Every rank's ids are checked on every rank (range, repeats) after the barrier, from the
        same copy: a bad routing raises the same ``InvalidArgumentError`` everywhere, naming the
        rank, and nothing has reached another rank's ``recv_x``.
        """
        g, info, ids_all, ranks = self._lay_out(x, topk_idx, packed)
        # the experts' row ends, from the per-expert totals, issued while the host would only wait:
        # after the wait it need not copy them to the device (GroupedSwiGLU(..., ends=))
        at = totals_at(self.world, self.e_loc)
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

    def combine_backward_dense(self, layout: DeviceLayout, grad_out: torch.Tensor, rows: torch.Tensor,
                               weights: torch.Tensor, weights_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Combine's backward over the device layout: ``grad_rows[row of (t, j)] = weights[t, j] *
        grad_out[t]`` (each token's gradient read once per rank) and, with ``weights_grad``, the
        weights' gradient ``<grad_out[t], rows[row of (t, j)]>`` (taken where the rows are, one float
        back per pair). Every rank passes the same ``weights_grad``."""
        hidden = self._check_weights(rows, weights, layout.tokens)
        W, k, T, t_max = self.world, self.top_k, layout.tokens, self.max_tokens
        g = self._region(self._next_half(), t_max)
        d_off = g.x + t_max * self.row_bytes  # D after this rank's gradient rows (dense_backward_fits)
        stream = self.pm.stream()
        ke = self._geo(layout.cap)
        if T:
            self.pm.slot_view(g.x, (T, hidden), grad_out.dtype).copy_(grad_out)
        self._post_weights(g, weights)
        self._fence()
        grad_rows = torch.empty_like(rows)
        if rows.shape[0]:
            kern = self.pm.kernel("rows_grad_dense", rows.dtype, self._vec(rows.data_ptr(), grad_rows.data_ptr()), 12, source=ROWS_SOURCE)
            kern(self._grid(W * t_max), stream, g.x, g.w, d_off, layout.ranks.data_ptr(), layout.info.data_ptr(),
                 layout.ids_all.data_ptr(), rows.data_ptr(), grad_rows.data_ptr(), t_max, hidden, ke, int(weights_grad))
        if not weights_grad:
            return grad_rows, None
        self._fence()
        gw = torch.empty(T * k, dtype=torch.float32, device=rows.device)
        if T:
            self.pm.kernel("rows_dots_dense", None, False, 6, source=ROWS_SOURCE)(max(1, min(MAX_GRID, -(-T * k // 512))), stream, d_off,
                                                                layout.ids_all.data_ptr(), gw.data_ptr(), t_max, ke, T)
        return grad_rows, gw

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
        at = totals_at(self.world, self.e_loc)
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
