"""A host-planned handle's rows over ``all_to_all_single``: dispatch, combine and their adjoints.

Design note. These are the row moves of transport "nccl", and the backward passes of every
handle planned on the host (transport "peer" with a capacity factor runs its backward passes
here too). The rows go in one ``all_to_all_single`` with uneven splits; a rank's rows for itself
are a local copy inside the collective and never cross a link. ``combine`` runs the dispatch's
steps backwards and sums each token's returned rows weighted by its router weights; the two are
each other's adjoints, which is how autograd differentiates them: dispatch's backward is a
combine without weights, combine's a dispatch of the output gradient scaled by the weights,
plus the weights' own gradient. Each returned row is put in its pair's own slot, so that no two
rows share one: no atomics, and the same bits on every run; the sums are one batched GEMM in at
least fp32, rounded once.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import collectives as C

from .handles import DispatchHandle
from .transport import CombineGrads

__all__ = ["exchange_rows", "route_rows", "by_source", "return_rows", "pair_sum", "pair_slots", "sum_pairs",
           "sent_weights", "combine_rows", "dispatch_backward", "combine_backward"]


def exchange_rows(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """``rows`` (``send[q]`` for rank q, in rank order) exchanged: ``recv[q]`` rows from each rank."""
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    C.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


def route_rows(handle: DispatchHandle, x: torch.Tensor, group: Any) -> torch.Tensor:
    """Rows of ``x`` (one per kept pair) to the experts' ranks, grouped by local expert."""
    sent = x.index_select(0, handle.token_of)
    received = exchange_rows(sent, handle.send_counts, handle.recv_counts, group)
    return received.index_select(0, handle.regroup)


def by_source(handle: DispatchHandle, rows: torch.Tensor) -> torch.Tensor:
    """Rows in ``recv_x``'s layout put back in arrival order (by source rank)."""
    if handle.ungroup is not None:
        return rows.index_select(0, handle.ungroup)  # a gather: several times faster than a scatter on GPUs
    out = torch.empty_like(rows)
    out[handle.regroup] = rows
    return out


def return_rows(handle: DispatchHandle, rows: torch.Tensor, group: Any) -> torch.Tensor:
    """Rows in ``recv_x``'s layout back to their pairs' ranks, in send order."""
    return exchange_rows(by_source(handle, rows), handle.recv_counts, handle.send_counts, group)


def pair_sum(rows: torch.Tensor, h: DispatchHandle, num_tokens: int, weights: torch.Tensor | None = None
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
        per = pair_slots(rows, n, rows.shape[0])
        per.index_copy_(0, h.order, rows)
    return sum_pairs(per, num_tokens, k, weights)


def pair_slots(rows: torch.Tensor, n: int, kept: int) -> torch.Tensor:
    """One row per pair, ``n`` of them, for rows placed by pair; zeros where pairs were dropped
    (fewer ``kept`` than pairs), which then add nothing."""
    return (rows.new_empty if kept == n else rows.new_zeros)((n, *rows.shape[1:]))


def sum_pairs(per: torch.Tensor, num_tokens: int, k: int, weights: torch.Tensor | None) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * per[t * k + j]`` (unit weights without ``weights``), in at
    least fp32 (a batched GEMM), rounded once."""
    shape = per.shape[1:]
    per = per.view(num_tokens, k, math.prod(shape))
    if weights is None:
        out = per.sum(1, dtype=torch.promote_types(per.dtype, torch.float32)).to(per.dtype)
    else:
        out = torch.bmm(weights.reshape(num_tokens, 1, k).to(per.dtype), per)
    return out.view(num_tokens, *shape)


def sent_weights(handle: DispatchHandle, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each sent row's router weight, in ``dtype`` (what combine's backward scales rows by)."""
    return weights.reshape(-1).index_select(0, handle.order).to(dtype)


def combine_rows(handle: DispatchHandle, rows: torch.Tensor, weights: torch.Tensor, w: torch.Tensor, group: Any
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """``Transport.combine`` over one ``all_to_all_single``: the rows back in send order, then
    :func:`pair_sum` with the weights; saves the returned rows (the weights' gradient) and ``w``
    (:func:`sent_weights`)."""
    back = return_rows(handle, rows.contiguous(), group)
    return pair_sum(back, handle, handle.num_tokens, weights), (back, w)


def dispatch_backward(handle: DispatchHandle, g: torch.Tensor, group: Any) -> torch.Tensor:
    """``Transport.dispatch_backward``: the rows' gradients back to their tokens, summed."""
    back = return_rows(handle, g, group)
    return pair_sum(back, handle, handle.num_tokens)


def combine_backward(handle: DispatchHandle, g: torch.Tensor, saved: tuple[torch.Tensor | None, ...],
                     wanted: CombineGrads, group: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``Transport.combine_backward`` for what :func:`combine_rows` (or a combine that saved
    ``(None, w)``, its weights needing no gradient) saved: the output gradient dispatched,
    scaled by each row's weight, and the weights' gradient from the returned rows."""
    back, w = saved
    assert w is not None  # every combine of a host plan saves the sent rows' weights
    g_rows = g.index_select(0, handle.token_of)  # each pair's share of the output gradient
    grows = None
    if wanted.rows:
        grows = exchange_rows(g_rows * w.unsqueeze(-1), handle.send_counts, handle.recv_counts, group)
        grows = grows.index_select(0, handle.regroup)
    gw = None
    if wanted.weights:
        assert back is not None  # saved whenever the weights need a gradient
        flat = torch.zeros(int(torch.tensor(wanted.weights_shape).prod()), dtype=wanted.weights_dtype, device=g.device)
        flat[handle.order] = (g_rows * back).sum(-1).to(wanted.weights_dtype)
        gw = flat.view(wanted.weights_shape)
    return grows, gw
