"""Transport "nccl": the rows of a dispatch in one ``all_to_all_single``, or in pieces, over the group's backend.

Design note. The routing is worked out on the host in numpy or, for a large batch of CUDA ids,
by torch operations on their device (``routing.route_on_host``, ``routing.route_on_device``;
``NcclOptions.routing``, recorded in ``last_routing``); the rows then travel in one uneven
``all_to_all_single`` each way (``exchange.py``), which NCCL (or Gloo, on CPU) carries.

With ``exchange_pieces`` > 1 the row exchange itself is pipelined: piece c carries part c of
every rank's rows for every other rank (cut the same way on both sides from the counts), all
pieces' gathers and asynchronous transfers are issued first, then each arrival is put in place
(``index_copy_`` into ``recv_x``; for combine into each pair's own slot, the weighted sums
following in one batched GEMM) while later pieces are in flight: the extra passes over the rows
overlap the transfer instead of adding to it. Combine uses one piece where the router weights
need a gradient (which needs every returned row in send order).

Without autograd, a forward in token chunks (:meth:`NcclTransport.pipeline`) issues the
exchanges asynchronously: chunk i+1's dispatch and chunk i-1's combine travel while the experts
compute chunk i, the sends from a side stream. ``chunks="auto"`` runs one chunk here: on 2xH200
the pipeline took 0.78-1.05x the sequential time over NCCL (a transfer's CTAs hold back the
experts' persistent GEMM, whose tail then waits for it), and a choice by token count could
differ between ranks, whose counts may differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

import collectives as C
from collectives.errors import UnsupportedError

from .exchange import (
    by_source,
    combine_backward,
    combine_rows,
    dispatch_backward,
    pair_slots,
    pair_sum,
    route_rows,
    sent_weights,
    sum_pairs,
)
from .handles import DispatchHandle, TransportState
from .routing import (
    DEVICE_ROUTING_MIN_PAIRS,
    HostRange,
    check_ids,
    exchange_counts,
    handle_at,
    host_plan,
    route_on_device,
    route_on_host,
    sorted_pairs,
    to_device,
)
from .transport import CombineGrads, Experts, Transport, TransportArguments, TransportOptions, TransportSetup

__all__ = ["NcclOptions", "NcclTransport", "PiecesState"]


@dataclass(frozen=True)
class NcclOptions(TransportOptions):
    """The options of transport "nccl".

    Attributes:
        routing: where a dispatch's routing is worked out: "host" (numpy, from one copy of the
            ids), "device" (torch operations on the ids' device, one wait for the counts; one
            piece only) or "auto" (the device for CUDA ids of at least
            ``DEVICE_ROUTING_MIN_PAIRS`` pairs when ``exchange_pieces`` is 1, else the host).
            Over the device, the ids are checked on every rank after the counts exchange, so a
            bad routing raises the same error everywhere, naming the rank.
        exchange_pieces: dispatch and combine move their rows in this many pieces, each piece's
            gather (resp. weighted sum) overlapping other pieces' transfers; combine uses one
            piece when the router weights need a gradient. The same on every rank.
    """

    routing: str = "auto"
    exchange_pieces: int = 1

    def __post_init__(self) -> None:
        TransportArguments(routing=self.routing, exchange_pieces=self.exchange_pieces)  # the values' checks
        if self.routing == "device" and self.exchange_pieces != 1:
            raise UnsupportedError("routing", self.routing, "applies to transport='nccl' with exchange_pieces=1",
                                   "pass routing='auto' (or 'host')")

    @classmethod
    def from_arguments(cls, args: TransportArguments) -> NcclOptions:
        return cls("auto" if args.routing is None else args.routing,
                   1 if args.exchange_pieces is None else args.exchange_pieces)

    def arguments(self) -> TransportArguments:
        return TransportArguments(routing=self.routing, exchange_pieces=self.exchange_pieces)


@dataclass
class _Pieces:
    """A handle's row exchange cut into pieces: piece c carries part c of every rank's rows for
    every other rank (the same cut on both sides, from the counts both know)."""

    tokens: list[torch.Tensor]     # x's rows each piece sends (its token per sent pair)
    pairs: list[torch.Tensor]      # the pairs' flat indices into topk_idx (for the weights)
    dest: list[torch.Tensor]       # where each received row goes in recv_x
    send: list[list[int]]          # rows to each rank
    recv: list[list[int]]          # rows from each rank


@dataclass(frozen=True)
class PiecesState(TransportState):
    """A handle of transport "nccl" with ``exchange_pieces`` > 1: its rows' exchange in pieces
    (dispatch, and combine where the weights need no gradient; the backward passes use one)."""

    pieces: _Pieces


def _cut(n: int, pieces: int, c: int) -> tuple[int, int]:
    return n * c // pieces, n * (c + 1) // pieces


def _plan_pieces(pieces: int, order: np.ndarray, k: int, send: list[int], recv: list[int],
                 ungroup: np.ndarray) -> tuple[list[np.ndarray], list[list[int]], list[list[int]]]:
    """Per piece: the send-order positions it sends (then its tokens and pairs follow), the
    recv_x positions of what it receives (``ungroup``: by-source row -> its place in recv_x),
    and both split lists."""
    s_start = np.concatenate([[0], np.cumsum(send)]).astype(np.int64)
    r_start = np.concatenate([[0], np.cumsum(recv)]).astype(np.int64)
    arrays: list[np.ndarray] = []
    sends, recvs = [], []
    for c in range(pieces):
        s_ranges = [_cut(n, pieces, c) for n in send]
        r_ranges = [_cut(n, pieces, c) for n in recv]
        pos = np.concatenate([np.arange(s_start[q] + lo, s_start[q] + hi) for q, (lo, hi) in enumerate(s_ranges)])
        got = np.concatenate([np.arange(r_start[q] + lo, r_start[q] + hi) for q, (lo, hi) in enumerate(r_ranges)])
        pairs = order[pos]
        arrays += [pairs // k, pairs, ungroup[got]]
        sends.append([hi - lo for lo, hi in s_ranges])
        recvs.append([hi - lo for lo, hi in r_ranges])
    return arrays, sends, recvs


def _exchange_pieces(src: torch.Tensor, take: list[torch.Tensor], out_splits: list[list[int]],
                     in_splits: list[list[int]], group: Any, land: Callable[[int, torch.Tensor], Any]) -> None:
    """Every piece's gather (``src`` rows ``take[c]``) and asynchronous transfer issued first, each
    transfer after its gather; then ``land(c, received rows)`` for each piece in turn, while later
    pieces travel."""
    flying = []
    for c in range(len(take)):
        rows = src.index_select(0, take[c])
        buf = src.new_empty((sum(out_splits[c]), *src.shape[1:]))
        flying.append((buf, rows, C.all_to_all_single(buf, rows, out_splits[c], in_splits[c], group=group,
                                                      async_op=True)))
    for c, (buf, _, work) in enumerate(flying):
        if work is not None:
            work.wait()
        land(c, buf)


def _route_pieces(p: _Pieces, x: torch.Tensor, total: int, group: Any) -> torch.Tensor:
    """``exchange.route_rows`` in pieces (``_exchange_pieces``): each arrival is put in its place in ``recv_x``."""
    recv_x = x.new_empty((total, *x.shape[1:]))
    _exchange_pieces(x, p.tokens, p.recv, p.send, group, lambda c, buf: recv_x.index_copy_(0, p.dest[c], buf))
    return recv_x


def _combine_pieces(p: _Pieces, rows: torch.Tensor, weights: torch.Tensor, num_tokens: int, group: Any) -> torch.Tensor:
    """``exchange.pair_sum`` of the returned rows, the return in pieces like ``_route_pieces`` (backwards):
    each arrival is put in its pairs' own slots (no two rows share one: no atomics, the same bits
    on every run), then each token's rows are summed with its weights by one batched GEMM, as in
    the one-piece path."""
    k = weights.shape[1]
    per = pair_slots(rows, num_tokens * k, sum(sum(s) for s in p.send))  # what went out comes back
    _exchange_pieces(rows, p.dest, p.send, p.recv, group, lambda c, buf: per.index_copy_(0, p.pairs[c], buf))
    return sum_pairs(per, num_tokens, k, weights)


class NcclTransport(Transport):
    """Rows over ``all_to_all_single`` (``options``: :class:`NcclOptions`). Holds no buffers."""

    options: NcclOptions
    packed_rows: ClassVar[bool] = True  # all_to_all_single of any rows

    def __init__(self, setup: TransportSetup, options: NcclOptions) -> None:
        super().__init__(setup, options)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def routes_on_device(self, topk_idx: torch.Tensor) -> bool:
        """Whether this routing is worked out by torch operations on the ids' device
        (``routing.route_on_device``); ``last_routing`` records the choice and why."""
        if self.options.exchange_pieces != 1:
            self.last_routing = ("host", "exchange_pieces > 1: the pieces are planned in numpy")
        elif self.options.routing != "auto":
            self.last_routing = (self.options.routing, "requested by the caller")
        elif not topk_idx.is_cuda:
            self.last_routing = ("host", f"ids on {topk_idx.device.type}: numpy is faster there")
        elif topk_idx.numel() < DEVICE_ROUTING_MIN_PAIRS:  # measured: see DEVICE_ROUTING_MIN_PAIRS
            self.last_routing = ("host", f"{topk_idx.numel()} pairs < {DEVICE_ROUTING_MIN_PAIRS}: numpy costs "
                                 "less than the device's launches")
        else:
            self.last_routing = ("device", f"{topk_idx.numel()} pairs >= {DEVICE_ROUTING_MIN_PAIRS}: sorting "
                                 "them in numpy costs more than the device's launches")
        return self.last_routing[0] == "device"

    def route(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]]) -> list[DispatchHandle]:
        """``Transport.route``: on the device where :meth:`routes_on_device` says so, else on the
        host, each range's rows cut into ``exchange_pieces`` pieces."""
        if self.routes_on_device(topk_idx):
            return route_on_device(self.setup, topk_idx, bounds)
        n_pieces = self.options.exchange_pieces
        if n_pieces == 1:
            return route_on_host(self.setup, topk_idx, bounds)
        k = topk_idx.shape[1] if topk_idx.dim() == 2 else 1
        splits: list[tuple[list[list[int]], list[list[int]]]] = []

        def extra(c: int, rg: HostRange, arrays: list[np.ndarray]) -> list[np.ndarray]:
            more, sends, recvs = _plan_pieces(n_pieces, rg.order, k, rg.send, rg.recv, arrays[3])  # [3]: ungroup
            splits.append((sends, recvs))
            return more

        def state(c: int, views: list[torch.Tensor]) -> PiecesState:
            return PiecesState(_Pieces(views[0::3], views[1::3], views[2::3], *splits[c]))

        return route_on_host(self.setup, topk_idx, bounds, extra, state)

    def dispatch_rows(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        if isinstance(handle.state, PiecesState):
            return _route_pieces(handle.state.pieces, x, sum(handle.recv_counts), self.group)
        return route_rows(handle, x, self.group)

    def dispatch_backward(self, grad_recv: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return dispatch_backward(handle, grad_recv, self.group)

    def combine(self, rows: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle, weights_grad: bool
                ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        w = sent_weights(handle, weights, rows.dtype)  # each sent row's weight
        if isinstance(handle.state, PiecesState) and not weights_grad:
            # (the weights' gradient needs every returned row in send order: the one-piece path)
            return _combine_pieces(handle.state.pieces, rows.contiguous(), weights, handle.num_tokens, self.group), \
                (None, w)
        return combine_rows(handle, rows, weights, w, self.group)

    def combine_backward(self, grad_out: torch.Tensor, handle: DispatchHandle,
                         saved: tuple[torch.Tensor | None, ...], wanted: CombineGrads
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return combine_backward(handle, grad_out, saved, wanted, self.group)

    def auto_chunks(self, x: torch.Tensor, topk_idx: torch.Tensor, experts: Experts) -> tuple[int | str, str]:
        # the ranks' token counts may differ, and a choice by tokens could then differ
        # between ranks; over NCCL the pipeline measured 0.78-1.05x the sequential time on
        # 2xH200 anyway (bench/results/README.md, gpu_2xh200_moe)
        return 1, ("one chunk: auto follows a tuned table over transport 'peer' only (keyed by max_tokens, "
                   "the same on every rank)")

    def _planner(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]]) -> Callable[[int], DispatchHandle]:
        """Every range's counts exchanged now (one all-to-all, the host's one wait); each range's
        handle planned on the host when asked for, so that planning range c+1 (sorts of its pairs
        and received rows) runs while the GPU computes range c."""
        if self.routes_on_device(topk_idx):  # every range at once: nothing of it scales on the host
            handles = route_on_device(self.setup, topk_idx, bounds)
            return handles.__getitem__
        k = topk_idx.shape[1]
        w, e_loc, E = self.comm.size, self.setup.local_experts, self.setup.num_experts
        dev = topk_idx.device
        ids = topk_idx.detach().to("cpu", torch.int64).numpy().reshape(-1, k)
        check_ids(ids, topk_idx, "topk_idx", E)
        local: list[Any] = [None] * len(bounds)
        if self.setup.capacity_factor is None:  # dropless: the counts are a bincount; the sorts can wait
            counts = np.stack([np.bincount(ids[lo:hi].reshape(-1), minlength=E) for lo, hi in bounds])
        else:  # the counts follow the drops, which need the sorts
            local = [sorted_pairs(ids[lo:hi], E, self.setup.capacity_factor) for lo, hi in bounds]
            counts = np.stack([c for _, _, c, _, _ in local])
        counts = counts.reshape(len(bounds), w, e_loc)
        got = exchange_counts(self.setup, counts, dev)

        def plan(c: int) -> DispatchHandle:
            lo, hi = bounds[c]
            order, _, _, dropped, tokens = local[c] or sorted_pairs(ids[lo:hi], E, None)
            matrix = np.ascontiguousarray(got[:, c, :])
            on_dev = to_device(host_plan(order, k, tokens, matrix), dev)
            return handle_at(on_dev, 0, order.size, matrix, counts[c].sum(1).tolist(), matrix.sum(1).tolist(),
                             tokens, k, dropped)[0]

        return plan

    def pipeline(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: Experts,
                 bounds: list[tuple[int, int]]) -> torch.Tensor:
        """The no-grad pipeline: every rank issues the same exchanges in the same order.

            host:      counts | plan 0 | plan 1      | plan 2         | ...
            exchange:         | send 0 | send 1      | back 0, send 2 | back 1, send 3 | ...
            experts:                   | experts 0   | experts 1      | experts 2      | ...

        On GPUs the sends are issued from a side stream (``send i+1`` must not wait for ``experts
        i``, which the caller's stream holds) and the returns from the caller's stream; NCCL runs
        both on its own stream. Planning range i+1 on the host (``_planner``) overlaps the GPU's
        work on range i: nothing in the loop waits for the GPU.
        """
        g = self.group
        plan = self._planner(topk_idx, bounds)
        cuda = x.device.type == "cuda"
        main = torch.cuda.current_stream(x.device) if cuda else None
        side = self._send_stream(x.device) if cuda else None
        if side is not None and main is not None:
            side.wait_stream(main)
        # The sends' inputs live on the side stream until the end: the backend may let go of a
        # tensor once the caller's stream has waited for the transfer, and the side stream, which
        # has not, could then reuse its memory while the transfer still reads it.
        sent: list[torch.Tensor] = []

        def send(i: int) -> tuple[DispatchHandle, torch.Tensor, Any]:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                h = plan(i)
                lo, hi = bounds[i]
                rows = x[lo:hi].index_select(0, h.token_of)
                sent.append(rows)
                out = rows.new_empty((sum(h.recv_counts), *rows.shape[1:]))
                work = C.all_to_all_single(out, rows, h.recv_counts, h.send_counts, group=g, async_op=True)
            if main is not None:  # made on the side stream, used on the caller's
                for t in (out, h.regroup, h.ungroup, h.pair_row, h.order):
                    t.record_stream(main)  # type: ignore[union-attr]
            return h, out, work

        result = x.new_empty((x.shape[0], self.setup.hidden))

        def land(i: int, h: DispatchHandle, rows: torch.Tensor, work: Any) -> None:
            if work is not None:
                work.wait()
            lo, hi = bounds[i]
            result[lo:hi] = pair_sum(rows, h, hi - lo, topk_weights[lo:hi])

        incoming = send(0)
        returning: tuple[int, DispatchHandle, torch.Tensor, Any] | None = None
        for i in range(len(bounds)):
            h, rows, work = incoming
            if work is not None:
                work.wait()
            y = experts(rows.index_select(0, h.regroup), h.tokens_per_expert)
            if i + 1 < len(bounds):
                incoming = send(i + 1)  # planned on the host while the GPU computes range i
            if returning is not None:
                land(*returning)
            back = y.new_empty((sum(h.send_counts), *y.shape[1:]))
            returning = (i, h, back, C.all_to_all_single(back, by_source(h, y), h.send_counts, h.recv_counts,
                                                         group=g, async_op=True))
        if returning is not None:
            land(*returning)
        if side is not None and main is not None:
            side.wait_stream(main)  # which has waited for every transfer: the inputs can go
        return result

    def _send_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The pipelined forward's stream for the sends (one per device, kept)."""
        st = self._streams.get(device)
        if st is None:
            st = self._streams[device] = torch.cuda.Stream(device)
        return st
