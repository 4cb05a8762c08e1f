"""Expert-parallel dispatch and combine over all-to-all, and a pipelined forward.

Design note. With ``E`` experts on ``W`` ranks, rank r owns experts ``r*E/W ... (r+1)*E/W - 1``.
A dispatch turns each (token, chosen expert) pair into one row sent to the expert's rank:

1. pairs are sorted by expert (stably, so ties keep token order); that is also rank order;
2. the per-expert counts go to their ranks first (an all-to-all of ``E`` integers), so every
   rank knows how many rows it will receive from whom for which of its experts (dropless:
   any count works);
3. the rows go in one ``all_to_all_single`` with uneven splits; a rank's rows for itself are a
   local copy inside the collective and never cross a link;
4. received rows (grouped by source rank, then expert) are regrouped by local expert.

``combine`` runs the same steps backwards and sums each token's returned rows weighted by its
router weights. The two are each other's adjoints, which is how autograd differentiates them
(``_Dispatch``: backward is a combine without weights; ``_Combine``: backward is a dispatch of
the output gradient, scaled by the weights, plus the weights' own gradient).

With ``capacity_factor`` set, each expert takes at most ``ceil(capacity_factor * tokens * k /
E)`` pairs from each rank, the first ones in token order; the rest are dropped (they add nothing
to the output) and counted in the handle.

With ``exchange_pieces`` > 1 the row exchange itself is pipelined: piece c carries part c of
every rank's rows for every other rank (cut the same way on both sides from the counts), all
pieces' gathers and asynchronous transfers are issued first, then each arrival is put in place
(``index_copy_`` into ``recv_x``; for combine into each pair's own slot, the weighted sums
following in one batched GEMM) while later pieces are in flight: the extra passes over the rows
overlap the transfer instead of adding to it.

With ``transport="peer"`` every rank learns every rank's routing instead of the counts, and SM
kernels read each token once per destination rank straight out of the source's peer buffer into
``recv_x``, and return one weighted partial sum per (token, rank) (``_moe_peer.py``).
``dispatch_low_latency`` gives each local expert a fixed block of rows instead, so that nothing
waits for the host and a decode step's exchange can be captured in a CUDA graph.

``forward_pipelined`` splits the tokens into chunks. Without autograd it issues the exchanges
asynchronously (chunk i+1's dispatch and chunk i-1's combine travel while the experts compute
chunk i); with autograd the chunks run one after another through the differentiable halves.
``chunks="auto"`` follows a tuned table where one measured a pipeline faster (transport
"peer" only: ``forward_pipelined``), else runs one chunk and says why: on 2xH200 the pipeline
took 0.78-1.05x the sequential time over NCCL (a transfer's CTAs hold back the experts' persistent GEMM, whose
tail then waits for it) and lost over the peer transport (its exchanges are 17-40% of the
layer, and token chunks shrink every expert's GEMM). Keeping SMs for the exchanges did not
change that: with torch's SM carveout at 24 for the experts and the row kernels capped at 48
blocks beside them, the peer pipeline ran at 0.73-0.89x the sequential forward's speed against
0.79-0.96x without, at 2 chunks (Qwen3-30B-like, top-2 and top-1 prefill; a scratch probe on
2xH200, 2026-12-01, not kept): the experts lost more to the SMs kept than the exchanges gained.

``forward_pipelined(..., chunks="sources")`` pipelines by source rank instead
(``PeerRows.pipelined_sources``): this rank's own tokens need no transfer, so their experts run
while copy engines (which take no SMs) carry every rank's tokens to its peers; the experts'
Triton gate/up kernel reads each pair's token where it landed, so nothing is gathered into
``recv_x``; each peer's results return by copy engine while the next source computes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import collectives as C
from collectives.errors import InvalidArgumentError, UnsupportedError

from . import _grouped_gemm
from .experts import GroupedSwiGLU
from .handles import DispatchHandle, LowLatencyHandle, TransportState
from .peer_rows import PeerDenseState, PeerPaddedState, PeerPlanState

__all__ = ["MoEDispatcher", "DispatchHandle", "LowLatencyHandle"]


def _exchange_rows(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    C.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


def _route(handle: DispatchHandle, x: torch.Tensor, group: Any) -> torch.Tensor:
    """Rows of ``x`` (one per kept pair) to the experts' ranks, grouped by local expert."""
    sent = x.index_select(0, handle.token_of)
    received = _exchange_rows(sent, handle.send_counts, handle.recv_counts, group)
    return received.index_select(0, handle.regroup)


def _by_source(handle: DispatchHandle, rows: torch.Tensor) -> torch.Tensor:
    """Rows in ``recv_x``'s layout put back in arrival order (by source rank)."""
    if handle.ungroup is not None:
        return rows.index_select(0, handle.ungroup)  # a gather: several times faster than a scatter on GPUs
    by_source = torch.empty_like(rows)
    by_source[handle.regroup] = rows
    return by_source


def _return(handle: DispatchHandle, rows: torch.Tensor, group: Any) -> torch.Tensor:
    """Rows in ``recv_x``'s layout back to their pairs' ranks, in send order."""
    return _exchange_rows(_by_source(handle, rows), handle.recv_counts, handle.send_counts, group)


def _pair_sum(rows: torch.Tensor, h: DispatchHandle, num_tokens: int, weights: torch.Tensor | None = None
              ) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * rows[i]`` over token t's kept pairs (row i holds pair
    ``h.order[i] = t * k + j``; unit weights without ``weights``). Each pair has its own slot, so
    the rows are placed without atomics (gathered by ``h.pair_row`` when dropless) and summed in
    at least fp32 (a batched GEMM), rounded once."""
    k = h.top_k
    n = num_tokens * k
    if h.pair_row is not None and h.pair_row.numel() == n and rows.shape[0] == n:
        per = rows.index_select(0, h.pair_row)
    else:
        per = _pair_slots(rows, n, rows.shape[0])
        per.index_copy_(0, h.order, rows)
    return _sum_pairs(per, num_tokens, k, weights)


def _pair_slots(rows: torch.Tensor, n: int, kept: int) -> torch.Tensor:
    """One row per pair, ``n`` of them, for rows placed by pair; zeros where pairs were dropped
    (fewer ``kept`` than pairs), which then add nothing."""
    return (rows.new_empty if kept == n else rows.new_zeros)((n, *rows.shape[1:]))


def _sum_pairs(per: torch.Tensor, num_tokens: int, k: int, weights: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * per[t * k + j]`` (unit weights without ``weights``), in at
    least fp32 (a batched GEMM), rounded once."""
    shape = per.shape[1:]
    per = per.view(num_tokens, k, math.prod(shape))
    if weights is None:
        out = per.sum(1, dtype=torch.promote_types(per.dtype, torch.float32)).to(per.dtype)
    else:
        out = torch.bmm(weights.reshape(num_tokens, 1, k).to(per.dtype), per)
    return out.view(num_tokens, *shape)


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
    """A handle of transport "nccl" with ``exchange_pieces`` > 1: its rows' exchange in pieces."""

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
    """``_route`` in pieces (``_exchange_pieces``): each arrival is put in its place in ``recv_x``."""
    recv_x = x.new_empty((total, *x.shape[1:]))
    _exchange_pieces(x, p.tokens, p.recv, p.send, group, lambda c, buf: recv_x.index_copy_(0, p.dest[c], buf))
    return recv_x


def _combine_pieces(p: _Pieces, rows: torch.Tensor, weights: torch.Tensor, num_tokens: int, group: Any) -> torch.Tensor:
    """``_pair_sum`` of the returned rows, the return in pieces like ``_route_pieces`` (backwards):
    each arrival is put in its pairs' own slots (no two rows share one: no atomics, the same bits
    on every run), then each token's rows are summed with its weights by one batched GEMM, as in
    the one-piece path."""
    k = weights.shape[1]
    per = _pair_slots(rows, num_tokens * k, sum(sum(s) for s in p.send))  # what went out comes back
    _exchange_pieces(rows, p.dest, p.send, p.recv, group, lambda c, buf: per.index_copy_(0, p.pairs[c], buf))
    return _sum_pairs(per, num_tokens, k, weights)


def _bad_routing(name: str, topk_idx: torch.Tensor, num_experts: int, repeated: bool) -> InvalidArgumentError:
    """The error for expert ids out of range (``repeated``: an expert twice for one token), whichever
    side found them: the host's checks or the peer transport's kernels."""
    if repeated:
        return InvalidArgumentError(name, topk_idx, "routes a token to the same expert twice",
                                    "give each token k distinct experts")
    return InvalidArgumentError(name, topk_idx, f"has expert ids outside 0..{num_experts - 1}",
                                f"route to experts 0..{num_experts - 1}")


# routing="auto" works out CUDA ids' routing on their device from this many (token, expert)
# pairs: on 2xH200 (launch/bench_moe.py, 2026-11-30) a prefill dispatch of 32768-65536 pairs
# took 2.1-3.1 ms routed on the device and 3.3-4.9 ms in numpy, a decode one of 1024 pairs 2.0
# ms on the device and 1.3 ms in numpy; the crossover lies between, not measured
DEVICE_ROUTING_MIN_PAIRS = 8192

_IOTA = np.arange(0, dtype=np.int64)


def _iota(n: int) -> np.ndarray:
    """``np.arange(n)`` (int64) from one kept array: the routing asks for several per dispatch,
    and fresh pages cost more than the indices."""
    global _IOTA
    if _IOTA.size < n:
        _IOTA = np.arange(max(n, 2 * _IOTA.size), dtype=np.int64)
    return _IOTA[:n]


def _block_permutation(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``regroup`` and its inverse ``ungroup`` for ``matrix [W, E/W]`` received rows.

    Received rows arrive in blocks (source 0: expert 0, expert 1, ...; source 1: ...); recv_x
    wants the same blocks in (expert, source) order, each block's rows kept in order: recv_x row
    i of block b is received row ``start_received[b] + (i - start_recv_x[b])``. Both are one
    ``repeat`` of per-block offsets plus a range (what a stable sort by local expert gives, in
    linear time and without the sort)."""
    w, e_loc = matrix.shape
    sizes = matrix.reshape(-1).astype(np.int64)           # blocks in arrival order (s, e)
    at_in = np.cumsum(sizes) - sizes
    sizes_t = matrix.T.reshape(-1).astype(np.int64)        # blocks in recv_x order (e, s)
    at_out = np.cumsum(sizes_t) - sizes_t
    at_in_t = at_in.reshape(w, e_loc).T.reshape(-1)
    at_out_s = at_out.reshape(e_loc, w).T.reshape(-1)
    total = int(sizes.sum())
    regroup = np.repeat(at_in_t - at_out, sizes_t) + _iota(total)
    ungroup = np.repeat(at_out_s - at_in, sizes) + _iota(total)
    return regroup, ungroup


def _host_plan(order: np.ndarray, k: int, tokens: int, matrix: np.ndarray) -> list[np.ndarray]:
    """One range's index arrays, in ``_handle_at``'s order: its kept pairs in send order, their
    tokens, ``regroup``, ``ungroup`` and (dropless) ``pair_row``; ``matrix [W, E/W]`` the rows
    this rank receives from each rank for each local expert."""
    regroup, ungroup = _block_permutation(matrix)
    pair_row = np.empty(0, dtype=np.int64)
    if order.size == tokens * k:  # dropless: every pair has its sent row
        pair_row = np.empty(order.size, dtype=np.int64)
        pair_row[order] = _iota(order.size)
    return [order, order // k, regroup, ungroup, pair_row]


def _to_device(arrays: list[np.ndarray], dev: torch.device) -> torch.Tensor:
    """``arrays`` concatenated as one int64 tensor on ``dev``: on a GPU one copy from pinned memory
    that the host does not wait for (the caching host allocator keeps the pages until it is done)."""
    flat = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False)) if arrays \
        else torch.empty(0, dtype=torch.int64)
    if dev.type != "cuda":
        return flat.to(dev)
    return flat.pin_memory().to(dev, non_blocking=True)


def _handle_at(on_dev: torch.Tensor, at: int, m_pairs: int, matrix: np.ndarray, send: list[int], recv: list[int],
               tokens: int, k: int, dropped: int) -> tuple[DispatchHandle, int]:
    """The handle whose ``_host_plan`` arrays start at ``on_dev[at]``, and where they end."""
    m_recv = sum(recv)
    n_pair_row = m_pairs if m_pairs == tokens * k else 0
    views = []
    for size in (m_pairs, m_pairs, m_recv, m_recv, n_pair_row):
        views.append(on_dev[at:at + size])
        at += size
    order_t, token_t, regroup_t, ungroup_t, pair_row_t = views
    return DispatchHandle(matrix.sum(0).tolist(), send, recv, torch.from_numpy(matrix), order_t, token_t, regroup_t,
                          tokens, k, dropped, ungroup=ungroup_t, pair_row=pair_row_t), at


def sorted_pairs(ids: np.ndarray, num_experts: int, capacity_factor: float | None
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """One range's routing ``ids [tokens, k]``: its kept pairs (flat indices into ``ids``) sorted by
    expert, ties in token order; their experts; the per-expert counts; how many the capacity
    dropped (each expert keeps its first ``ceil(capacity_factor * tokens * k / E)`` pairs in
    token order); the tokens."""
    E = num_experts
    flat = ids.reshape(-1)
    small = np.int16 if E <= np.iinfo(np.int16).max else np.int64  # numpy sorts 16-bit keys by radix
    order = np.argsort(flat.astype(small), kind="stable")
    experts = flat[order]
    per_expert = np.bincount(experts, minlength=E)
    dropped = 0
    tokens = ids.shape[0]
    if capacity_factor is not None and flat.size:
        cap = math.ceil(capacity_factor * flat.size / E)
        start = np.cumsum(per_expert) - per_expert
        keep = np.arange(flat.size) - start[experts] < cap
        order, experts = order[keep], experts[keep]
        dropped = flat.size - order.size
        per_expert = np.bincount(experts, minlength=E)
    return order, experts, per_expert, dropped, tokens


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: DispatchHandle, group: Any) -> torch.Tensor:
        ctx.handle, ctx.group, ctx.shape = handle, group, x.shape
        state = handle.state
        if isinstance(state, PeerPlanState):
            from collectives.dispatch import recorded

            rows, p = state.rows, state.plan
            total = sum(handle.recv_counts)
            with recorded(C.get_communicator(group), "moe_dispatch", "peer",
                          torch.empty((total, *x.shape[1:]), dtype=x.dtype, device="meta"), x):
                return rows.dispatch(p, x.contiguous(), total)
        if isinstance(state, PiecesState):
            return _route_pieces(state.pieces, x, sum(handle.recv_counts), group)
        return _route(handle, x, group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        h = ctx.handle
        back = _return(h, g.contiguous(), ctx.group)
        return _pair_sum(back, h, h.num_tokens).view(ctx.shape), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle, group: Any) -> torch.Tensor:
        state = handle.state
        ctx.handle, ctx.group, ctx.wshape, ctx.wdtype = handle, group, weights.shape, weights.dtype
        w = weights.reshape(-1).index_select(0, handle.order).to(rows.dtype)  # each sent row's weight
        if isinstance(state, PeerPlanState) and not ctx.needs_input_grad[1]:
            from collectives.dispatch import recorded

            ctx.save_for_backward(None, w)
            transport, p = state.rows, state.plan
            with recorded(C.get_communicator(group), "moe_combine", "peer",
                          torch.empty((handle.num_tokens, *rows.shape[1:]), dtype=rows.dtype, device="meta"), rows):
                return transport.combine(p, rows.contiguous(), weights)
        if isinstance(state, PiecesState) and not ctx.needs_input_grad[1]:
            # (the weights' gradient needs every returned row in send order: the one-piece path)
            ctx.save_for_backward(None, w)
            return _combine_pieces(state.pieces, rows.contiguous(), weights, handle.num_tokens, group)
        back = _return(handle, rows.contiguous(), group)
        ctx.save_for_backward(back, w)
        return _pair_sum(back, handle, handle.num_tokens, weights)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        back, w = ctx.saved_tensors
        h = ctx.handle
        g_rows = g.index_select(0, h.token_of)  # each pair's share of the output gradient
        grows = None
        if ctx.needs_input_grad[0]:
            grows = _exchange_rows(g_rows * w.unsqueeze(-1), h.send_counts, h.recv_counts, ctx.group)
            grows = grows.index_select(0, h.regroup)
        gw = None
        if ctx.needs_input_grad[1]:
            flat = torch.zeros(int(torch.tensor(ctx.wshape).prod()), dtype=ctx.wdtype, device=g.device)
            flat[h.order] = (g_rows * back).sum(-1).to(ctx.wdtype)
            gw = flat.view(ctx.wshape)
        return grows, gw, None, None


class _DenseDispatch(torch.autograd.Function):
    """Dispatch over the peer transport's device layout; backward: a combine with unit weights."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_idx: torch.Tensor, transport: Any, box: list[Any]) -> torch.Tensor:
        recv, layout = transport.dispatch_dense(x.contiguous(), topk_idx)
        box.append(layout)
        ctx.transport, ctx.layout = transport, layout
        return recv

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        lay = ctx.layout
        ones = torch.ones((lay.tokens, ctx.transport.top_k), dtype=torch.float32, device=g.device)
        return ctx.transport.combine_dense(lay, g.contiguous(), ones), None, None, None


class _DenseCombine(torch.autograd.Function):
    """Combine over the device layout; backward: the gradient dispatched scaled by the weights,
    and the weights' gradient from dot products taken where the rows are."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weights: torch.Tensor, transport: Any, layout: Any) -> torch.Tensor:
        ctx.save_for_backward(rows, weights)
        ctx.transport, ctx.layout = transport, layout
        return transport.combine_dense(layout, rows.contiguous(), weights)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        rows, weights = ctx.saved_tensors
        grad_rows, gw = ctx.transport.combine_backward_dense(ctx.layout, g.contiguous(), rows.contiguous(), weights,
                                                             ctx.needs_input_grad[1])
        return grad_rows, (gw.view(weights.shape).to(weights.dtype) if gw is not None else None), None, None


class MoEDispatcher:
    """Dispatch tokens to their experts' ranks and combine the experts' outputs, for one group.

    Args:
        num_experts: ``E``, divisible by the group's size ``W``; rank r owns experts
            ``r*E/W ... (r+1)*E/W - 1``.
        hidden: the tokens' width.
        group: the expert-parallel group (default: world).
        dtype, device: of the tokens (checked on every call).
        capacity_factor: ``None`` (dropless) or the factor of each expert's capacity per rank,
            ``ceil(capacity_factor * tokens * k / E)`` pairs.
        exchange_pieces: dispatch and combine move their rows in this many pieces, each piece's
            gather (resp. weighted sum) overlapping other pieces' transfers; combine uses one
            piece when the router weights need a gradient. The same on every rank.
        transport: "nccl" (``all_to_all_single``) or "peer" (the GPUs of one node: SM kernels pull each token once per rank from the
            peers' memory and return one partial sum per token and rank,
            ``overlap/_moe_peer.py``; ``exchange_pieces`` does not apply; dropless, the routing is
            laid out on the GPUs and the backward passes use the same kernels; with a
            ``capacity_factor`` it is planned on the host and the backward passes use NCCL).
        max_tokens, top_k: transport "peer" only (required there): the most tokens one dispatch
            takes on any rank, and the k of every ``topk_idx``; they size its peer buffers, which
            :meth:`close` releases (collective).
        routing: where transport "nccl" works out a dispatch's routing: "host" (numpy, from one
            copy of the ids), "device" (torch operations on the ids' device, one wait for the
            counts; one piece only) or "auto" (the device for CUDA ids of at least
            ``DEVICE_ROUTING_MIN_PAIRS`` pairs when ``exchange_pieces`` is 1, else the host).
            Over the device, the ids are checked on every rank after the counts exchange, so a
            bad routing raises the same error everywhere, naming the rank.
        pipeline_transfers: how transport "peer"'s pipelined forward moves rows between GPUs:
            "sm" (the SM kernels, on a side stream), "copy_engine" (peer copies, which take no SMs
            from the experts; every kernel then runs on the caller's stream, on local memory; the
            peer buffers are sized for it, about 1.5x at 2 ranks) or "auto" ("sm": the copy
            engines measured no gain on 2xH200). ``last_pipeline`` records (which, why).

    Every rank calls ``dispatch`` and ``combine`` the same number of times, in the same order
    (they communicate); token counts may differ between ranks, and may be zero.
    """

    def __init__(self, num_experts: int, hidden: int, group: Any = None, *, dtype: torch.dtype | None = None,
                 device: Any = None, capacity_factor: float | None = None, exchange_pieces: int = 1,
                 transport: str = "nccl", max_tokens: int | None = None, top_k: int | None = None,
                 routing: str = "auto", pipeline_transfers: str = "auto") -> None:
        comm = C.get_communicator(group)
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % comm.size:
            raise InvalidArgumentError("num_experts", num_experts, f"is not a positive multiple of the group's {comm.size} ranks",
                                       f"use a multiple of {comm.size} (each rank owns the same number of experts)")
        if capacity_factor is not None and not capacity_factor > 0:
            raise InvalidArgumentError("capacity_factor", capacity_factor, "must be positive or None", "pass e.g. 1.25, or None")
        self.group, self.comm = group, comm
        self.num_experts, self.hidden = num_experts, hidden
        self.local_experts = num_experts // comm.size
        self.first_expert = comm.rank * self.local_experts
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.capacity_factor = capacity_factor
        if not isinstance(exchange_pieces, int) or isinstance(exchange_pieces, bool) or exchange_pieces < 1:
            raise InvalidArgumentError("exchange_pieces", exchange_pieces, "is not a positive int", "pass 1 (or e.g. 4)")
        self.exchange_pieces = exchange_pieces
        if transport not in ("nccl", "peer"):
            raise InvalidArgumentError("transport", transport, "is not 'nccl' or 'peer'", "pass 'nccl'")
        self.transport = transport
        if routing not in ("auto", "host", "device"):
            raise InvalidArgumentError("routing", routing, "is not 'auto', 'host' or 'device'", "pass 'auto'")
        if routing == "device" and (transport != "nccl" or exchange_pieces != 1):
            raise UnsupportedError("routing", routing, "applies to transport='nccl' with exchange_pieces=1",
                                   "pass routing='auto' (or 'host')")
        self.routing = routing
        if pipeline_transfers not in ("auto", "copy_engine", "sm"):
            raise InvalidArgumentError("pipeline_transfers", pipeline_transfers, "is not 'auto', 'copy_engine' or 'sm'",
                                       "pass 'auto'")
        self.pipeline_transfers = pipeline_transfers
        self.last_pipeline: tuple[str, str] | None = None  # transport "peer": (transfers, why) of the last pipeline
        if transport == "peer":
            # the peer buffers are sized once, from these bounds (like any buffer-owning object)
            for name, v in (("max_tokens", max_tokens), ("top_k", top_k)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise InvalidArgumentError(name, v, "is needed by transport='peer' (it sizes the peer buffers)",
                                               f"pass {name}= as a positive int, e.g. max_tokens=4096, top_k=8")
            if top_k > num_experts:  # type: ignore[operator]
                raise InvalidArgumentError("top_k", top_k, f"exceeds the {num_experts} experts", f"pass top_k<={num_experts}")
        self.max_tokens: int = max_tokens or 0  # (transport "peer" only)
        self.top_k: int = top_k or 0
        self._peer: Any = None
        self._no_plan: dict[torch.device, torch.Tensor] = {}
        self._meta: dict[torch.dtype, torch.Tensor] = {}  # dispatch's output as the flight recorder notes it
        # the peer transport sizes its buffers by the rows' bytes
        self._row_bytes = hidden * torch.empty((), dtype=dtype).element_size() if dtype is not None else 0
        self.last_chunks: tuple[int, str] | None = None
        self.last_routing: tuple[str, str] | None = None  # transport "nccl": (where, why) of the last routing
        # chunks="auto": the tuned table last followed, and its choices per shape
        self._auto_table: Any = None
        self._auto: dict[tuple[Any, ...], tuple[int | str, str]] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    # -- routing ---------------------------------------------------------------------------------
    def _check(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            raise InvalidArgumentError("x", x, f"is not [tokens, {self.hidden}]", f"pass x as [tokens, {self.hidden}]")
        if self.dtype is not None and x.dtype != self.dtype:
            raise InvalidArgumentError("x", x, f"has dtype {x.dtype}, the dispatcher {self.dtype}", f"pass {self.dtype} tokens")
        if self.device is not None and x.device != self.device:
            raise InvalidArgumentError("x", x, f"is on {x.device}, the dispatcher on {self.device}", f"move x to {self.device}")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_idx.dtype.is_floating_point:
            raise InvalidArgumentError("topk_idx", topk_idx, f"is not an integer [{x.shape[0]}, k] tensor",
                                       "pass the router's expert ids, one row per token")
        if topk_weights is not None and topk_weights.shape != topk_idx.shape:
            raise InvalidArgumentError("topk_weights", topk_weights, f"has shape {tuple(topk_weights.shape)}, topk_idx "
                                       f"{tuple(topk_idx.shape)}", "pass one weight per (token, expert) pair")

    def _check_transport(self, x: torch.Tensor) -> None:
        if self.transport == "peer":
            from .. import _copy_engine

            why = _copy_engine.unavailable(self.comm, x.device, x.dtype)
            if why:
                raise UnsupportedError("transport", self.transport, f"cannot run here: {why}", "use transport='nccl'")
            self._row_bytes = x.shape[1] * x.element_size()

    def _check_ids(self, ids: np.ndarray, topk_idx: torch.Tensor, name: str) -> None:
        E, k = self.num_experts, ids.shape[1] if ids.ndim == 2 else 1
        if ids.size:
            if ids.min() < 0 or ids.max() >= E:
                raise _bad_routing(name, topk_idx, E, repeated=False)
            by_row = np.sort(ids, axis=1)
            if k > 1 and (by_row[:, 1:] == by_row[:, :-1]).any():
                raise _bad_routing(name, topk_idx, E, repeated=True)

    def _gather_routing(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]], k: int
                        ) -> tuple[list[np.ndarray], list[list[tuple[int, int]]]]:
        """Every rank's ``topk_idx`` and ranges (the peer transport), checked on every rank, so a
        bad routing on one rank raises the same error on all of them."""
        w, T = self.comm.size, topk_idx.shape[0]
        if k != self.top_k:
            raise InvalidArgumentError("topk_idx", topk_idx, f"has k={k}; the dispatcher was built for top_k="
                                       f"{self.top_k}", f"pass [tokens, {self.top_k}] expert ids")
        if T > self.max_tokens:
            raise InvalidArgumentError("x", topk_idx, f"has {T} tokens; the peer transport was built for max_tokens="
                                       f"{self.max_tokens}", f"pass max_tokens>={T} to MoEDispatcher")
        head = [T, *(v for b in bounds for v in b)]
        size = len(head) + self.max_tokens * k
        mine = torch.full((size,), -1, dtype=torch.int32, device=topk_idx.device)
        mine[:len(head)].copy_(torch.tensor(head, dtype=torch.int32))
        mine[len(head):len(head) + T * k].copy_(topk_idx.detach().reshape(-1))
        every = torch.empty(w * size, dtype=torch.int32, device=topk_idx.device)
        C.all_gather_single(every, mine, group=self.group)
        rows = every.cpu().numpy().reshape(w, size).astype(np.int64)
        ids, ranges = [], []
        for s in range(w):
            t = int(rows[s, 0])
            mine_ids = rows[s, len(head):len(head) + t * k].reshape(t, k)
            self._check_ids(mine_ids, topk_idx, "topk_idx" if s == self.comm.rank else f"topk_idx of rank {s}")
            ids.append(mine_ids)
            ranges.append([(int(rows[s, 1 + 2 * i]), int(rows[s, 2 + 2 * i])) for i in range(len(bounds))])
        return ids, ranges

    def _exchange_counts(self, counts: np.ndarray, dev: torch.device) -> np.ndarray:
        """``counts [n, W, E/W]`` (rows this rank sends, per range, rank and that rank's local
        expert) -> ``[W, n, E/W]``: what each rank sends this one (an all-to-all; the host waits)."""
        w, n, e_loc = self.comm.size, counts.shape[0], self.local_experts
        send_buf = torch.from_numpy(np.ascontiguousarray(counts.transpose(1, 0, 2)).reshape(-1))
        if dev.type == "cpu" or not self.comm.backend_for(dev.type):
            got_t = torch.empty_like(send_buf)
            C.all_to_all_single(got_t, send_buf, group=self.group)
        else:
            # GPU tokens: the counts travel over the GPU's backend, like the rows
            got_dev = torch.empty_like(send_buf, device=dev)
            C.all_to_all_single(got_dev, send_buf.to(dev), group=self.group)
            got_t = got_dev.cpu()
        return got_t.numpy().reshape(w, n, e_loc)

    def _peer_rows(self) -> Any:
        """The peer transport's buffers, built on first use (collective: every rank dispatches)."""
        if self._peer is None:
            from . import peer_rows as _moe_peer

            self._peer = _moe_peer.PeerRows(self.comm, self.max_tokens, self.top_k, self._row_bytes,
                                            self.num_experts, pipeline_transfers=self.pipeline_transfers)
        self._peer.pipeline_transfers = self.pipeline_transfers
        return self._peer

    def close(self) -> None:
        """Release the peer transport's buffers, if any (collective). The dispatcher can be used
        again afterwards (it builds them anew)."""
        if self._peer is not None:
            self._peer.close()
            self._peer = None

    def route(self, topk_idx: torch.Tensor) -> DispatchHandle:
        """The handle for routing ``topk_idx`` (exchanges the per-expert counts: collective)."""
        return self.route_chunks(topk_idx, [(0, topk_idx.shape[0])])[0]

    def route_chunks(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]]) -> list[DispatchHandle]:
        """One handle per token range of ``bounds``, with one exchange of every range's counts.

        With ``routing`` "host" (and for CPU ids, or several exchange pieces, under "auto") the
        routing is worked out on the host, in numpy, from one copy of ``topk_idx``: the host must
        learn the counts anyway (the row exchange's splits are host integers). The checks of the
        expert ids come with it, before anything is sent; the results go back to the device in
        one copy. Numpy's cost grows with the pairs: 2-4 ms per prefill dispatch on the 2xH200
        machine's CPUs (bench/results/README.md), while the GPU idles. So CUDA ids of a large
        batch are routed on their device by default (``_route_on_device``): a few dozen small
        operations whatever the batch, which at decode sizes cost more than numpy.
        """
        if self._routes_on_device(topk_idx):
            return self._route_on_device(topk_idx, bounds)
        k = topk_idx.shape[1] if topk_idx.dim() == 2 else 1
        w, e_loc = self.comm.size, self.local_experts
        dev = topk_idx.device
        n = len(bounds)
        every: np.ndarray | None = None
        if self.transport == "peer":
            # every rank's routing (each plans its pulls from all of them): one small all-gather
            every_ids, every_bounds = self._gather_routing(topk_idx, bounds, k)
            me = self.comm.rank
            sources = [[sorted_pairs(every_ids[s][lo:hi], self.num_experts, self.capacity_factor)
                        for lo, hi in every_bounds[s]] for s in range(w)]
            local = sources[me]
            every = np.stack([np.stack([c for _, _, c, _, _ in sources[s]]) for s in range(w)]).reshape(w, n, w, e_loc)
        else:
            ids = topk_idx.detach().to("cpu", torch.int64).numpy().reshape(-1, k)
            self._check_ids(ids, topk_idx, "topk_idx")
            local = [sorted_pairs(ids[lo:hi], self.num_experts, self.capacity_factor) for lo, hi in bounds]
        counts = np.stack([c for _, _, c, _, _ in local]).reshape(n, w, e_loc)
        if self.transport == "peer" and not self._row_bytes:
            raise InvalidArgumentError("dtype", self.dtype, f"is needed by the {self.transport} transport before the first "
                                       "dispatch (it sizes the peer buffers' regions by the rows' bytes)",
                                       "pass dtype= to MoEDispatcher, or dispatch before calling route")
        if self.transport == "peer":
            got = np.ascontiguousarray(every[:, :, self.comm.rank, :])  # type: ignore[index]
        else:
            got = self._exchange_counts(counts, dev)
        pieces, layout = [], []
        n_pieces = self.exchange_pieces
        for c, (order, _, _, dropped, tokens) in enumerate(local):
            matrix = np.ascontiguousarray(got[:, c, :])
            send, recv = counts[c].sum(1).tolist(), matrix.sum(1).tolist()
            arrays = _host_plan(order, k, tokens, matrix)
            ungroup = arrays[3]
            pieces += arrays
            split_lists: Any = None
            if self.transport == "peer":
                from . import peer_rows as _moe_peer

                p_scalars, arrays = _moe_peer.plan(self.comm.rank, w, e_loc, k, self.max_tokens,
                                                 [(every_ids[s][lo:hi], sources[s][c][0], hi - lo)
                                                  for s, (lo, hi) in enumerate(b[c] for b in every_bounds)])
                pieces += arrays
                split_lists = ("peer", p_scalars, [a.size for a in arrays])
            elif n_pieces > 1:
                arrays, sends, recvs = _plan_pieces(n_pieces, order, k, send, recv, ungroup)
                pieces += arrays
                split_lists = ("pieces", (sends, recvs), [a.size for a in arrays])
            layout.append((matrix, dropped, tokens, send, recv, split_lists))
        on_dev = _to_device(pieces, dev)  # one copy to the device for every index of every range
        handles, at = [], 0
        for c, (matrix, dropped, tokens, send, recv, split_lists) in enumerate(layout):
            h, at = _handle_at(on_dev, at, local[c][0].size, matrix, send, recv, tokens, k, dropped)
            if split_lists is not None:
                kind, info, sizes = split_lists
                views = []
                for size in sizes:
                    views.append(on_dev[at:at + size])
                    at += size
                if kind == "peer":
                    from . import peer_rows as _moe_peer

                    h.state = _moe_peer.PeerPlanState(self._peer_rows(), _moe_peer.build(info, views))
                else:
                    h.state = PiecesState(_Pieces(views[0::3], views[1::3], views[2::3], *info))
            handles.append(h)
        return handles

    def _routes_on_device(self, topk_idx: torch.Tensor) -> bool:
        """Whether transport "nccl" works this routing out by torch operations on the ids' device;
        ``last_routing`` records the choice and why."""
        if self.transport != "nccl":
            return False  # the peer transport lays its routing out with its own kernels
        if self.exchange_pieces != 1:
            self.last_routing = ("host", "exchange_pieces > 1: the pieces are planned in numpy")
        elif self.routing != "auto":
            self.last_routing = (self.routing, "requested by the caller")
        elif not topk_idx.is_cuda:
            self.last_routing = ("host", f"ids on {topk_idx.device.type}: numpy is faster there")
        elif topk_idx.numel() < DEVICE_ROUTING_MIN_PAIRS:  # measured: see DEVICE_ROUTING_MIN_PAIRS
            self.last_routing = ("host", f"{topk_idx.numel()} pairs < {DEVICE_ROUTING_MIN_PAIRS}: numpy costs "
                                 "less than the device's launches")
        else:
            self.last_routing = ("device", f"{topk_idx.numel()} pairs >= {DEVICE_ROUTING_MIN_PAIRS}: sorting "
                                 "them in numpy costs more than the device's launches")
        return self.last_routing[0] == "device"

    def _route_on_device(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]]) -> list[DispatchHandle]:
        """``route_chunks`` by torch operations on the ids' device (transport "nccl", one piece).

        Each range's pairs are sorted by expert there (stably: ties in token order) and counted;
        the counts go out in one all-to-all with two words per rank saying whether its ids are
        out of range or repeat an expert, and come back to the host in the one wait. A bad
        routing then raises on every rank, naming the rank, before any row is sent. The received
        blocks' permutation is worked out on the host from the counts (``_block_permutation``).
        A few dozen small operations: on a slow host they cost less than sorting a prefill's
        pairs in numpy, and nothing scales with the pairs on the host.
        """
        k = topk_idx.shape[1] if topk_idx.dim() == 2 else 1
        w, e_loc, E, n, me = self.comm.size, self.local_experts, self.num_experts, len(bounds), self.comm.rank
        dev = topk_idx.device
        ids = topk_idx.detach().reshape(-1, k).to(torch.int64)
        flags = torch.zeros(2, dtype=torch.int64, device=dev)
        if ids.numel():
            flags[0] = ((ids < 0) | (ids >= E)).any()
            if k > 1:
                by_row = ids.sort(dim=1).values
                flags[1] = (by_row[:, 1:] == by_row[:, :-1]).any()
        flat = ids.clamp(0, E - 1).reshape(-1)  # (a bad routing raises before its counts are used)
        sorted_ids, orders, counts, full = [], [], [], []
        caps: list[int | None] = []
        for lo, hi in bounds:
            part = flat[lo * k:hi * k]
            values, order = torch.sort(part, stable=True)
            cnt = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, part, torch.ones_like(part))
            cap = None if self.capacity_factor is None or not part.numel() else \
                math.ceil(self.capacity_factor * part.numel() / E)
            caps.append(cap)
            full.append(cnt)
            sorted_ids.append(values)
            orders.append(order)
            counts.append(cnt if cap is None else cnt.clamp(max=cap))  # what each expert keeps
        kept = torch.stack(counts).view(n, w, e_loc) if n else torch.zeros((0, w, e_loc), dtype=torch.int64, device=dev)
        row = n * e_loc + 2  # what this rank sends each rank: its kept counts there, then its flags
        send = torch.cat([kept.transpose(0, 1).reshape(w, n * e_loc), flags.expand(w, 2)], 1).reshape(-1)
        if dev.type == "cpu" or not self.comm.backend_for(dev.type):
            send = send.cpu()
        got = torch.empty_like(send)
        C.all_to_all_single(got, send, group=self.group)
        host = torch.cat([got.to(dev), kept.reshape(-1)]).cpu().numpy()  # the one wait
        from_each = host[:w * row].reshape(w, row)
        bad = np.flatnonzero(from_each[:, -2:].any(1))
        if bad.size:
            s = int(bad[0])
            raise _bad_routing("topk_idx" if s == me else f"topk_idx of rank {s}", topk_idx, E,
                              repeated=not from_each[s, -2])
        matrices = from_each[:, :-2].reshape(w, n, e_loc)
        mine = host[w * row:].reshape(n, w, e_loc)
        handles = []
        for c, (lo, hi) in enumerate(bounds):
            tokens, pairs = hi - lo, (hi - lo) * k
            order = orders[c]
            n_kept = int(mine[c].sum())
            if n_kept < pairs:  # each expert keeps its first `cap` pairs in token order
                start = torch.cumsum(full[c], 0) - full[c]
                rank_in = torch.arange(pairs, device=dev) - start.index_select(0, sorted_ids[c])
                cap = caps[c]
                assert cap is not None  # pairs were dropped: there is a capacity
                drop = (rank_in >= cap).to(torch.int8)
                order = order.index_select(0, torch.sort(drop, stable=True).indices[:n_kept])
            matrix = np.ascontiguousarray(matrices[:, c, :])
            regroup, ungroup = _block_permutation(matrix)
            on_dev = _to_device([regroup, ungroup], dev)
            pair_row = order.new_empty(0)
            if n_kept == pairs:  # dropless: every pair has its sent row
                pair_row = torch.empty_like(order)
                pair_row[order] = torch.arange(pairs, device=dev)
            handles.append(DispatchHandle(matrix.sum(0).tolist(), mine[c].sum(1).tolist(), matrix.sum(1).tolist(),
                                          torch.from_numpy(matrix), order, torch.div(order, k, rounding_mode="floor"),
                                          on_dev[:regroup.size], tokens, k, pairs - n_kept,
                                          ungroup=on_dev[regroup.size:], pair_row=pair_row))
        return handles

    # -- the two halves --------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, DispatchHandle]:
        """``recv_x [received pairs, hidden]`` grouped by local expert, and the routing handle.

        Differentiable in ``x``: its backward is a combine without weights (``_Dispatch`` over a
        host-planned handle; ``_DenseDispatch`` over the peer transport's device layout).
        ``topk_weights`` is only checked here; ``combine`` takes it.
        """
        self._check(x, topk_idx, topk_weights)
        self._check_transport(x)
        if self._device_layout(topk_idx):
            return self._dispatch_dense(x, topk_idx)
        handle = self.route(topk_idx)
        return _Dispatch.apply(x, handle, self.group), handle

    def _device_layout(self, topk_idx: torch.Tensor) -> bool:
        """Whether this dispatch lays its routing out on the GPUs (transport "peer"): no host plan;
        for the layouts the kernels serve (dropless; k up to a warp's 32 lanes; local experts x
        ranks up to their table). Differentiable through the same kernels."""
        from . import peer_rows as _moe_peer

        return (self.transport == "peer"
                and self.capacity_factor is None  # drops need each expert's count before the rows
                and topk_idx.dim() == 2 and topk_idx.shape[1] <= 32  # one lane per pair of a token
                and self.num_experts <= _moe_peer.MAX_BASE  # the kernels' (local expert, source) table
                # combine's backward keeps the per-pair dot products beside the gradient rows
                and _moe_peer.dense_backward_fits(self.comm.size, topk_idx.shape[1], self.hidden * self._es()))

    def _es(self) -> int:
        """The tokens' element size (2 until the first dispatch tells, if ``dtype`` was not given)."""
        return self._row_bytes // self.hidden if self._row_bytes else 2

    def _dispatch_dense(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, DispatchHandle]:
        """Dispatch over the device layout; the handle carries the counts the host learned, and
        the layout for the combine and both backward passes."""
        from collectives.dispatch import recorded

        w, e_loc = self.comm.size, self.local_experts
        if topk_idx.shape[1] != self.top_k:
            raise InvalidArgumentError("topk_idx", topk_idx, f"has k={topk_idx.shape[1]}; the dispatcher was built "
                                       f"for top_k={self.top_k}", f"pass [tokens, {self.top_k}] expert ids")
        rows = self._peer_rows()
        meta = self._meta.get(x.dtype)  # what the flight recorder notes of the output (shape, dtype)
        if meta is None:
            meta = self._meta[x.dtype] = torch.empty((0, x.shape[1]), dtype=x.dtype, device="meta")
        with recorded(self.comm, "moe_dispatch", "peer", meta, x):
            if torch.is_grad_enabled() and x.requires_grad:
                box: list[Any] = []
                recv = _DenseDispatch.apply(x, topk_idx, rows, box)
                layout = box[0]
            else:  # nothing to differentiate: the same call without autograd's bookkeeping
                recv, layout = rows.dispatch_dense(x.contiguous(), topk_idx)
        none = self._no_plan.get(x.device)  # no host plan (see DispatchHandle): one empty tensor, shared
        if none is None:
            none = self._no_plan[x.device] = torch.empty(0, dtype=torch.int64, device=x.device)
        counts = layout.counts
        matrix = counts[:w * e_loc].reshape(w, e_loc).astype(np.int64)
        handle = DispatchHandle(matrix.sum(0).tolist(), counts[w * e_loc + w:w * e_loc + 2 * w].astype(np.int64).tolist(),
                                matrix.sum(1).tolist(), torch.from_numpy(matrix), none, none, none, x.shape[0],
                                topk_idx.shape[1], 0, PeerDenseState(rows, layout), expert_ends=layout.ends)
        return recv, handle

    def dispatch_low_latency(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, LowLatencyHandle]:
        """``recv_x [E/W, capacity, hidden]`` and its handle, without waiting for the host.

        The decode-time dispatch: every local expert gets a block of ``capacity`` rows (``W *
        max_tokens``), its own rows first (``handle.tokens_per_expert``, on the device). Nothing
        here waits for the GPUs, so a dispatch, the experts (``GroupedSwiGLU.forward_padded``,
        given ``handle.tokens_per_expert`` to compute only the counted rows)
        and ``combine_low_latency`` can be captured in one CUDA graph and replayed. Transport
        "peer" only, dropless, without autograd. The ids are not checked before the exchange
        (that would wait): ``check_routing(handle, topk_idx)`` does, waiting.
        """
        from collectives.dispatch import recorded

        self._check(x, topk_idx, None)
        if self.transport != "peer" or self.capacity_factor is not None:
            raise UnsupportedError("transport", self.transport, "has no low-latency dispatch here (it needs "
                                   "transport='peer' and no capacity_factor)",
                                   "build the dispatcher with transport='peer', max_tokens= and top_k=, dropless")
        if torch.is_grad_enabled() and x.requires_grad:
            raise UnsupportedError("x", "a tensor that requires grad", "cannot go through the low-latency dispatch, "
                                   "which keeps no plan for a backward pass", "use dispatch(), or run under torch.no_grad()")
        self._check_transport(x)
        if not self._device_layout(topk_idx) or topk_idx.shape[1] != self.top_k:
            raise InvalidArgumentError("topk_idx", topk_idx, f"is not [tokens, {self.top_k}] with k <= 32 (the layout "
                                       "the low-latency kernels serve)", f"pass [tokens, {self.top_k}] expert ids")
        rows = self._peer_rows()
        meta = torch.empty((0, x.shape[1]), dtype=x.dtype, device="meta")
        with recorded(self.comm, "moe_dispatch", "peer_low_latency", meta, x):
            recv, counts, layout = rows.dispatch_padded(x.contiguous(), topk_idx)
        return recv, LowLatencyHandle(counts, layout.cap, x.shape[0], topk_idx.shape[1], PeerPaddedState(rows, layout))

    def combine_low_latency(self, expert_out: torch.Tensor, handle: LowLatencyHandle,
                            topk_weights: torch.Tensor) -> torch.Tensor:
        """``out [tokens, hidden]`` from ``expert_out [E/W, capacity, hidden]`` (``dispatch_low_latency``'s
        layout); only each block's first ``tokens_per_expert`` rows are read."""
        from collectives.dispatch import recorded

        state = handle.state
        assert isinstance(state, PeerPaddedState)  # what dispatch_low_latency returns
        rows, layout = state.rows, state.layout
        meta = torch.empty((handle.num_tokens, self.hidden), dtype=expert_out.dtype, device="meta")
        with recorded(self.comm, "moe_combine", "peer_low_latency", meta, expert_out):
            return rows.combine_padded(layout, expert_out, topk_weights)

    def check_routing(self, handle: LowLatencyHandle, topk_idx: torch.Tensor) -> None:
        """Raise ``InvalidArgumentError`` on every rank if any rank's ids in this low-latency
        dispatch were out of range or repeated an expert (waits for the dispatch)."""
        state = handle.state
        assert isinstance(state, PeerPaddedState)  # what dispatch_low_latency returns
        state.rows.check_padded(state.layout, topk_idx)

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor) -> torch.Tensor:
        """``out [tokens, hidden]``, ``out[t] = sum_j topk_weights[t, j] * expert_out`` of pair (t, j).

        Differentiable in ``expert_out`` and ``topk_weights`` (``_Combine``: its backward is a
        dispatch of the output gradient scaled by the weights).
        """
        if expert_out.shape[0] != sum(handle.tokens_per_expert):
            raise InvalidArgumentError("expert_out", expert_out, f"has {expert_out.shape[0]} rows; the dispatch "
                                       f"delivered {sum(handle.tokens_per_expert)}", "pass rows in recv_x's layout")
        dense = handle.state
        if isinstance(dense, PeerDenseState):
            from collectives.dispatch import recorded

            rows, layout = dense.rows, dense.layout
            with recorded(self.comm, "moe_combine", "peer", torch.empty((handle.num_tokens, expert_out.shape[1]),
                                                                         dtype=expert_out.dtype, device="meta"),
                          expert_out):
                if torch.is_grad_enabled() and (expert_out.requires_grad or topk_weights.requires_grad):
                    return _DenseCombine.apply(expert_out, topk_weights, rows, layout)
                # nothing to differentiate: the same call without autograd's bookkeeping
                return rows.combine_dense(layout, expert_out.contiguous(), topk_weights)
        return _Combine.apply(expert_out, topk_weights, handle, self.group)

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                experts: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
        """dispatch -> ``experts(recv_x, tokens_per_expert)`` -> combine (a ``GroupedSwiGLU`` also
        gets the handle's ``expert_ends``, where the dispatch has them on the device)."""
        recv, handle = self.dispatch(x, topk_idx, topk_weights)
        if handle.expert_ends is not None and isinstance(experts, GroupedSwiGLU):
            rows = experts(recv, handle.tokens_per_expert, ends=handle.expert_ends)
        else:
            rows = experts(recv, handle.tokens_per_expert)
        return self.combine(rows, handle, topk_weights)

    def forward_pipelined(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                          experts: Callable[[torch.Tensor, list[int]], torch.Tensor], chunks: int | str = "auto"
                          ) -> torch.Tensor:
        """``forward`` with the tokens in ``chunks`` parts. Every rank must pass the same ``chunks``;
        ``last_chunks`` says what ran.

        Without autograd (``torch.no_grad()``, inference) the exchanges are asynchronous: chunk
        i+1's rows travel while the experts compute chunk i, and chunk i's combine returns while
        chunk i+1 is computed (NCCL runs them on its own stream, Gloo on its threads, the peer
        transport's kernels on a side stream). With autograd the chunks run one after another
        through the differentiable dispatch and combine (same results; overlapping the backward
        is not built yet).

        ``chunks="sources"`` pipelines by source rank instead of token ranges
        (``PeerRows.pipelined_sources``): this rank's own tokens' pairs first, which need no
        transfer, while the copy engines carry every rank's tokens; then each peer's, whose
        results return while the next computes. The experts' kernels read the tokens where the
        copy engines left them, so it asks for transport "peer" built with
        ``pipeline_transfers="copy_engine"``, no autograd, the dropless device layout, and
        ``experts`` a ``GroupedSwiGLU`` of this rank's experts whose Triton kernels take the rows
        (``overlap/_grouped_gemm.py``); a typed error names what is missing.

        ``chunks="auto"`` follows a tuned table (``launch/bench_moe.py --tune``, read through
        ``overlap.set_tuned`` or ``COMMOPS_OVERLAP_TUNED``, like the overlap operators'): over
        transport "peer", without autograd, for a ``GroupedSwiGLU`` of the measured shape, the
        pipeline that measured faster than the sequential forward at the dispatcher's
        ``max_tokens`` (the same on every rank, so every rank picks the same), where this call
        can run it; else one chunk, the sequential forward. ``last_chunks`` says which and why.
        """
        if chunks == "sources":
            return self._pipelined_sources(x, topk_idx, topk_weights, experts)
        if chunks == "auto":
            self._check(x, topk_idx, topk_weights)
            picked, why = self._auto_chunks(x, topk_idx, experts)
            if picked == "sources":
                return self._pipelined_sources(x, topk_idx, topk_weights, experts, why)
            n = int(picked)
        elif isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1:
            n, why = chunks, "requested by the caller"
        else:
            raise InvalidArgumentError("chunks", chunks, "is not 'auto', 'sources' or a positive int",
                                       "pass 'auto' or e.g. 4")
        self.last_chunks = (n, why)
        if n == 1:
            return self.forward(x, topk_idx, topk_weights, experts)
        self._check(x, topk_idx, topk_weights)
        self._check_transport(x)
        bounds = [(x.shape[0] * i // n, x.shape[0] * (i + 1) // n) for i in range(n)]
        if self._device_layout(topk_idx) and not torch.is_grad_enabled():
            # every chunk routed on the GPUs first, then the rows of chunk i+1 travel (peer kernels
            # on a side stream) while the experts compute chunk i
            return self._peer_pipeline(x, topk_idx, topk_weights, lambda rows, xc: rows.pipelined_dense(
                xc, topk_idx, topk_weights, experts, bounds))
        if self._device_layout(topk_idx):  # with autograd: chunk after chunk, each laid out on the GPUs
            return torch.cat([self.forward(x[lo:hi], topk_idx[lo:hi], topk_weights[lo:hi], experts)
                              for lo, hi in bounds])
        if not torch.is_grad_enabled() and self.transport != "peer":
            return self._overlapped(x, topk_idx, topk_weights, experts, bounds)
        handles = self.route_chunks(topk_idx, bounds)  # every chunk's counts in one small exchange
        recv = [_Dispatch.apply(x[bounds[0][0]:bounds[0][1]], handles[0], self.group)]
        outs = []
        for i, (lo, hi) in enumerate(bounds):
            if i + 1 < n:
                nlo, nhi = bounds[i + 1]
                recv.append(_Dispatch.apply(x[nlo:nhi], handles[i + 1], self.group))
            rows = experts(recv[i], handles[i].tokens_per_expert)
            outs.append(_Combine.apply(rows, topk_weights[lo:hi], handles[i], self.group))
        return torch.cat(outs)

    def _auto_chunks(self, x: torch.Tensor, topk_idx: torch.Tensor, experts: Any) -> tuple[int | str, str]:
        """``chunks="auto"``: (what to run, why), the same on every rank given the same table."""
        if torch.is_grad_enabled():
            return 1, "one chunk: with autograd the chunks run one after another (the tuned pipelines ran without it)"
        if self.transport != "peer":
            # the ranks' token counts may differ, and a choice by tokens could then differ
            # between ranks; over NCCL the pipeline measured 0.78-1.05x the sequential time on
            # 2xH200 anyway (bench/results/README.md, gpu_2xh200_moe)
            return 1, ("one chunk: auto follows a tuned table over transport 'peer' only (keyed by max_tokens, "
                       "the same on every rank)")
        from ..ops import _tuned_table

        table = _tuned_table()
        if table is None:
            return 1, ("one chunk: no tuned table (launch/bench_moe.py --tune writes one; overlap.set_tuned or "
                       "COMMOPS_OVERLAP_TUNED reads it)")
        if table is not self._auto_table:  # another table since (overlap.set_tuned): choose anew
            self._auto_table = table
            self._auto.clear()
        key = (x.dtype, x.device.type, topk_idx.shape[1], self.pipeline_transfers,
               tuple(experts.w1.shape) if isinstance(experts, GroupedSwiGLU) else None)
        found = self._auto.get(key)
        if found is None:
            found = self._auto[key] = _from_moe_table(table, self, x, topk_idx.shape[1], experts)
        picked, why = found
        if picked == "sources":
            missing = self._sources_missing(x, topk_idx, experts)
            if missing:
                return 1, f"one chunk: the tuned table's pipeline by source needs {missing}"
        return found

    def _pipelined_sources(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           experts: Any, why: str = "") -> torch.Tensor:
        """``forward_pipelined(..., chunks="sources")``: what it needs checked, then the peer
        transport's pipeline by source rank. ``why``: auto's reason, given once ``_auto_chunks``
        has found nothing missing (not looked for again)."""
        self._check(x, topk_idx, topk_weights)
        self._check_transport(x)
        missing = "" if why else self._sources_missing(x, topk_idx, experts)
        if missing:
            raise UnsupportedError("chunks", "sources", f"needs {missing}", "use chunks='auto' or an int")
        out = self._peer_pipeline(x, topk_idx, topk_weights, lambda rows, xc: rows.pipelined_sources(
            xc, topk_idx, topk_weights, experts))
        self.last_chunks = (self.comm.size, why or "by source rank (chunks='sources')")
        return out

    def _sources_missing(self, x: torch.Tensor, topk_idx: torch.Tensor, experts: Any) -> str:
        """What the pipeline by source needs that this call lacks, or ``""``."""
        missing = ""
        if self.transport != "peer" or self.pipeline_transfers != "copy_engine":
            missing = (f"transport='peer' with pipeline_transfers='copy_engine' (this dispatcher: transport="
                       f"{self.transport!r}, pipeline_transfers={self.pipeline_transfers!r})")
        elif torch.is_grad_enabled():
            missing = "no autograd (it runs the experts' inference kernels): call it under torch.no_grad()"
        elif not self._device_layout(topk_idx):
            missing = "the dropless device layout (CUDA ids, no capacity_factor)"
        elif not isinstance(experts, GroupedSwiGLU) or experts.w1.shape[0] != self.local_experts:
            missing = f"experts a GroupedSwiGLU of this rank's {self.local_experts} experts, not {type(experts).__name__}"
        else:
            # the kernels read the tokens from the peer buffer (aligned), not from x: x's dtype and width
            why = _grouped_gemm.supported(x.new_empty((1, x.shape[1])), experts.w1, experts.w3, experts.w2)
            if why:
                missing = f"rows the experts' Triton kernels take: {why}"
        return missing

    def _peer_pipeline(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       run: Callable[[Any, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A pipelined forward of the peer transport, ``run(rows, x)``: the ids and weights checked
        against its ``top_k``, the call recorded, ``last_pipeline`` kept."""
        from collectives.dispatch import recorded

        if topk_idx.shape[1] != self.top_k or tuple(topk_weights.shape) != tuple(topk_idx.shape):
            raise InvalidArgumentError("topk_idx", topk_idx, f"is not [tokens, {self.top_k}] with weights of its "
                                       "shape", f"pass [tokens, {self.top_k}] ids and weights")
        rows = self._peer_rows()
        meta = torch.empty((x.shape[0], self.hidden), dtype=x.dtype, device="meta")
        with recorded(self.comm, "moe_forward", "peer", meta, x):
            out = run(rows, x.contiguous())
        self.last_pipeline = rows.last_pipeline
        return out

    def _planner(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]]) -> Callable[[int], DispatchHandle]:
        """Every range's counts exchanged now (one all-to-all, the host's one wait); each range's
        handle planned on the host when asked for, so that planning range c+1 (sorts of its pairs
        and received rows) runs while the GPU computes range c."""
        if self._routes_on_device(topk_idx):  # every range at once: nothing of it scales on the host
            handles = self._route_on_device(topk_idx, bounds)
            return handles.__getitem__
        k = topk_idx.shape[1]
        w, e_loc, E = self.comm.size, self.local_experts, self.num_experts
        dev = topk_idx.device
        ids = topk_idx.detach().to("cpu", torch.int64).numpy().reshape(-1, k)
        self._check_ids(ids, topk_idx, "topk_idx")
        local: list[Any] = [None] * len(bounds)
        if self.capacity_factor is None:  # dropless: the counts are a bincount; the sorts can wait
            counts = np.stack([np.bincount(ids[lo:hi].reshape(-1), minlength=E) for lo, hi in bounds])
        else:  # the counts follow the drops, which need the sorts
            local = [sorted_pairs(ids[lo:hi], E, self.capacity_factor) for lo, hi in bounds]
            counts = np.stack([c for _, _, c, _, _ in local])
        counts = counts.reshape(len(bounds), w, e_loc)
        got = self._exchange_counts(counts, dev)

        def plan(c: int) -> DispatchHandle:
            lo, hi = bounds[c]
            order, _, _, dropped, tokens = local[c] or sorted_pairs(ids[lo:hi], E, None)
            matrix = np.ascontiguousarray(got[:, c, :])
            on_dev = _to_device(_host_plan(order, k, tokens, matrix), dev)
            return _handle_at(on_dev, 0, order.size, matrix, counts[c].sum(1).tolist(), matrix.sum(1).tolist(),
                              tokens, k, dropped)[0]

        return plan

    def _overlapped(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
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

        result = x.new_empty((x.shape[0], self.hidden))

        def land(i: int, h: DispatchHandle, rows: torch.Tensor, work: Any) -> None:
            if work is not None:
                work.wait()
            lo, hi = bounds[i]
            result[lo:hi] = _pair_sum(rows, h, hi - lo, topk_weights[lo:hi])

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
            returning = (i, h, back, C.all_to_all_single(back, _by_source(h, y), h.send_counts, h.recv_counts,
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


# A pipeline replaces the sequential forward in a tuned table only when it measured at least this
# much faster, paired in the same rounds, so that auto never trades the sequential forward for a
# measured tie. The host's noise is large: unpaired, one layer's sequential forward took 2006 and
# 1765 us in two runs on 2xH200 the same day (gpu_2xh200_moe, gpu_2xh200_moe_pipeline). The
# overlap operators' tables take 3% (bench.gemm_collective.TUNE_MARGIN); 5% here until paired MoE
# runs show how steady the ratio is.
MOE_TUNE_MIN_SPEEDUP = 1.05


def _from_moe_table(table: dict[str, Any], disp: MoEDispatcher, x: torch.Tensor, k: int, experts: Any
                    ) -> tuple[int | str, str]:
    """The tuned table's choice for this dispatcher, tokens and experts (see ``forward_pipelined``)."""
    if table.get("meta", {}).get("world", disp.comm.size) != disp.comm.size:
        return 1, f"one chunk: the tuned table was measured at {table['meta']['world']} ranks, not {disp.comm.size}"
    if not isinstance(experts, GroupedSwiGLU):
        return 1, f"one chunk: the tuned table measured GroupedSwiGLU experts, not {type(experts).__name__}"
    want = {"op": "moe_forward", "transport": disp.transport, "dtype": str(x.dtype).removeprefix("torch."),
            "device_type": x.device.type, "tokens": disp.max_tokens, "hidden": disp.hidden,
            "ffn_hidden": experts.w1.shape[2], "experts": disp.num_experts, "top_k": k}
    for e in table.get("entries", []):
        if all(e.get(f) == v for f, v in want.items()):
            # a pipeline over token chunks moves its rows as the dispatcher's pipeline_transfers says
            how = "sm" if disp.pipeline_transfers == "auto" else disp.pipeline_transfers
            if e["chunks"] != "sources" and e.get("pipeline", how) != how:
                return 1, (f"one chunk: the tuned table's {e['chunks']} chunks ran over {e['pipeline']}, this "
                           f"dispatcher's pipeline_transfers is {disp.pipeline_transfers!r}")
            chunks = e["chunks"] if e["chunks"] == "sources" else int(e["chunks"])
            return chunks, f"tuned table: {e['note']}"
    return 1, (f"one chunk: the tuned table has no measurement of this layer (max_tokens {disp.max_tokens}, hidden "
               f"{disp.hidden}, ffn {experts.w1.shape[2]}, {disp.num_experts} experts, top-{k}, {want['dtype']})")
