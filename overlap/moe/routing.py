"""Routing helpers the transports share: the host plan of a dispatch, its checks, and the same on the device.

Design note. With ``E`` experts on ``W`` ranks, rank r owns experts ``r*E/W ... (r+1)*E/W - 1``.
A dispatch turns each (token, chosen expert) pair into one row sent to the expert's rank:

1. pairs are sorted by expert (stably, so ties keep token order); that is also rank order;
2. the per-expert counts go to their ranks first (an all-to-all of ``E`` integers), so every
   rank knows how many rows it will receive from whom for which of its experts (dropless:
   any count works);
3. the rows go to their ranks (the transport's business);
4. received rows (grouped by source rank, then expert) are regrouped by local expert.

Steps 1, 2 and 4's permutations are worked out here, on the host in numpy from one copy of the
ids (:func:`route_on_host`: the host must learn the counts anyway, since an all-to-all's splits
are host integers) or by torch operations on the ids' device (:func:`route_on_device`: a few
dozen small operations whatever the batch, which beat numpy's sorts from
``DEVICE_ROUTING_MIN_PAIRS`` pairs on). Both check the ids before any row is sent, and a bad
routing raises the same error on every rank. Every index a handle needs goes to the device in
one copy (:func:`plan_handles`), a transport's own arrays included, so that a transport adds its
plan to the shared one instead of copying it separately.

With a ``capacity_factor``, each expert takes at most ``ceil(capacity_factor * tokens * k / E)``
pairs from each rank, the first ones in token order; the rest are dropped (they add nothing to
the output) and counted in the handle.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

import collectives as C
from collectives.errors import InvalidArgumentError

from .handles import DispatchHandle, TransportState
from .transport import TransportSetup

__all__ = ["DEVICE_ROUTING_MIN_PAIRS", "sorted_pairs", "block_permutation", "bad_routing", "check_ids",
           "exchange_counts", "host_plan", "to_device", "handle_at", "HostRange", "host_ranges", "plan_handles",
           "route_on_host", "route_on_device"]


def bad_routing(name: str, topk_idx: torch.Tensor, num_experts: int, repeated: bool) -> InvalidArgumentError:
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


def block_permutation(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def host_plan(order: np.ndarray, k: int, tokens: int, matrix: np.ndarray) -> list[np.ndarray]:
    """One range's index arrays, in ``handle_at``'s order: its kept pairs in send order, their
    tokens, ``regroup``, ``ungroup`` and (dropless) ``pair_row``; ``matrix [W, E/W]`` the rows
    this rank receives from each rank for each local expert."""
    regroup, ungroup = block_permutation(matrix)
    pair_row = np.empty(0, dtype=np.int64)
    if order.size == tokens * k:  # dropless: every pair has its sent row
        pair_row = np.empty(order.size, dtype=np.int64)
        pair_row[order] = _iota(order.size)
    return [order, order // k, regroup, ungroup, pair_row]


def to_device(arrays: list[np.ndarray], dev: torch.device) -> torch.Tensor:
    """``arrays`` concatenated as one int64 tensor on ``dev``: on a GPU one copy from pinned memory
    that the host does not wait for (the caching host allocator keeps the pages until it is done)."""
    flat = torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False)) if arrays \
        else torch.empty(0, dtype=torch.int64)
    if dev.type != "cuda":
        return flat.to(dev)
    return flat.pin_memory().to(dev, non_blocking=True)


def handle_at(on_dev: torch.Tensor, at: int, m_pairs: int, matrix: np.ndarray, send: list[int], recv: list[int],
               tokens: int, k: int, dropped: int) -> tuple[DispatchHandle, int]:
    """The handle whose ``host_plan`` arrays start at ``on_dev[at]``, and where they end."""
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


def check_ids(ids: np.ndarray, topk_idx: torch.Tensor, name: str, num_experts: int) -> None:
    """Raise ``InvalidArgumentError`` naming ``name`` if the host's ``ids [tokens, k]`` (a copy of
    ``topk_idx``) are out of ``0..num_experts-1`` or repeat an expert within a token."""
    E, k = num_experts, ids.shape[1] if ids.ndim == 2 else 1
    if ids.size:
        if ids.min() < 0 or ids.max() >= E:
            raise bad_routing(name, topk_idx, E, repeated=False)
        by_row = np.sort(ids, axis=1)
        if k > 1 and (by_row[:, 1:] == by_row[:, :-1]).any():
            raise bad_routing(name, topk_idx, E, repeated=True)


def exchange_counts(setup: TransportSetup, counts: np.ndarray, dev: torch.device) -> np.ndarray:
    """``counts [n, W, E/W]`` (rows this rank sends, per range, rank and that rank's local
    expert) -> ``[W, n, E/W]``: what each rank sends this one (an all-to-all; the host waits)."""
    w, n, e_loc = setup.comm.size, counts.shape[0], setup.local_experts
    send_buf = torch.from_numpy(np.ascontiguousarray(counts.transpose(1, 0, 2)).reshape(-1))
    if dev.type == "cpu" or not setup.comm.backend_for(dev.type):
        got_t = torch.empty_like(send_buf)
        C.all_to_all_single(got_t, send_buf, group=setup.group)
    else:
        # GPU tokens: the counts travel over the GPU's backend, like the rows
        got_dev = torch.empty_like(send_buf, device=dev)
        C.all_to_all_single(got_dev, send_buf.to(dev), group=setup.group)
        got_t = got_dev.cpu()
    return got_t.numpy().reshape(w, n, e_loc)


@dataclass(frozen=True)
class HostRange:
    """One token range's routing, known on the host.

    Attributes:
        order: its kept pairs' flat indices into the range's ids, in send order (by expert).
        dropped: pairs the capacity dropped.
        tokens: the range's tokens.
        matrix: ``[W, E/W]`` rows this rank receives from each rank for each local expert.
        send, recv: rows sent to and received from each rank.
    """

    order: np.ndarray
    dropped: int
    tokens: int
    matrix: np.ndarray
    send: list[int]
    recv: list[int]


def host_ranges(local: list[tuple[np.ndarray, np.ndarray, np.ndarray, int, int]], counts: np.ndarray,
                got: np.ndarray) -> list[HostRange]:
    """Each range's ``HostRange`` from its ``sorted_pairs``, ``counts [n, W, E/W]`` (rows this
    rank sends) and ``got [W, n, E/W]`` (rows each rank sends this one)."""
    out = []
    for c, (order, _, _, dropped, tokens) in enumerate(local):
        matrix = np.ascontiguousarray(got[:, c, :])
        out.append(HostRange(order, dropped, tokens, matrix, counts[c].sum(1).tolist(), matrix.sum(1).tolist()))
    return out


# a transport's own index arrays for range c (given the range and its host_plan arrays), and its
# state for range c from their views on the device
Extra = Callable[[int, HostRange, list[np.ndarray]], list[np.ndarray]]
MakeState = Callable[[int, list[torch.Tensor]], TransportState]


def plan_handles(ranges: list[HostRange], k: int, dev: torch.device, extra: Extra | None = None,
                 make_state: MakeState | None = None) -> list[DispatchHandle]:
    """The handles of ``ranges``: every range's ``host_plan`` arrays, and where given a
    transport's own (``extra``), go to ``dev`` in one copy; ``make_state`` then makes each
    handle's ``state`` from the views of its own arrays there (both or neither)."""
    pieces: list[np.ndarray] = []
    sizes: list[list[int]] = []
    for c, rg in enumerate(ranges):
        arrays = host_plan(rg.order, k, rg.tokens, rg.matrix)
        pieces += arrays
        more = extra(c, rg, arrays) if extra is not None else []
        pieces += more
        sizes.append([a.size for a in more])
    on_dev = to_device(pieces, dev)  # one copy to the device for every index of every range
    handles, at = [], 0
    for c, rg in enumerate(ranges):
        h, at = handle_at(on_dev, at, rg.order.size, rg.matrix, rg.send, rg.recv, rg.tokens, k, rg.dropped)
        if make_state is not None:
            views = []
            for size in sizes[c]:
                views.append(on_dev[at:at + size])
                at += size
            h.state = make_state(c, views)
        handles.append(h)
    return handles


def route_on_host(setup: TransportSetup, topk_idx: torch.Tensor, bounds: list[tuple[int, int]],
                  extra: Extra | None = None, make_state: MakeState | None = None) -> list[DispatchHandle]:
    """``Transport.route`` in numpy, from one copy of ``topk_idx [tokens, k]``: the ids checked,
    each range's pairs sorted by expert (and capped), every range's counts exchanged in one
    all-to-all (:func:`exchange_counts`; the host waits), then :func:`plan_handles`. Collective.

    Numpy's cost grows with the pairs: 2-4 ms per prefill dispatch on the 2xH200 machine's CPUs
    (bench/results/README.md), while the GPU idles; :func:`route_on_device` is the alternative.
    """
    k = topk_idx.shape[1] if topk_idx.dim() == 2 else 1
    w, e_loc = setup.comm.size, setup.local_experts
    ids = topk_idx.detach().to("cpu", torch.int64).numpy().reshape(-1, k)
    check_ids(ids, topk_idx, "topk_idx", setup.num_experts)
    local = [sorted_pairs(ids[lo:hi], setup.num_experts, setup.capacity_factor) for lo, hi in bounds]
    counts = np.stack([c for _, _, c, _, _ in local]).reshape(len(bounds), w, e_loc)
    got = exchange_counts(setup, counts, topk_idx.device)
    return plan_handles(host_ranges(local, counts, got), k, topk_idx.device, extra, make_state)


def route_on_device(setup: TransportSetup, topk_idx: torch.Tensor, bounds: list[tuple[int, int]]
                    ) -> list[DispatchHandle]:
    """``Transport.route`` by torch operations on the ids' device (transport "nccl", one piece).

    Each range's pairs are sorted by expert there (stably: ties in token order) and counted;
    the counts go out in one all-to-all with two words per rank saying whether its ids are
    out of range or repeat an expert, and come back to the host in the one wait. A bad
    routing then raises on every rank, naming the rank, before any row is sent. The received
    blocks' permutation is worked out on the host from the counts (``block_permutation``).
    A few dozen small operations: on a slow host they cost less than sorting a prefill's
    pairs in numpy, and nothing scales with the pairs on the host.
    """
    k = topk_idx.shape[1] if topk_idx.dim() == 2 else 1
    w, e_loc, E, n, me = setup.comm.size, setup.local_experts, setup.num_experts, len(bounds), setup.comm.rank
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
        cap = None if setup.capacity_factor is None or not part.numel() else \
            math.ceil(setup.capacity_factor * part.numel() / E)
        caps.append(cap)
        full.append(cnt)
        sorted_ids.append(values)
        orders.append(order)
        counts.append(cnt if cap is None else cnt.clamp(max=cap))  # what each expert keeps
    kept = torch.stack(counts).view(n, w, e_loc) if n else torch.zeros((0, w, e_loc), dtype=torch.int64, device=dev)
    row = n * e_loc + 2  # what this rank sends each rank: its kept counts there, then its flags
    send = torch.cat([kept.transpose(0, 1).reshape(w, n * e_loc), flags.expand(w, 2)], 1).reshape(-1)
    if dev.type == "cpu" or not setup.comm.backend_for(dev.type):
        send = send.cpu()
    got = torch.empty_like(send)
    C.all_to_all_single(got, send, group=setup.group)
    host = torch.cat([got.to(dev), kept.reshape(-1)]).cpu().numpy()  # the one wait
    from_each = host[:w * row].reshape(w, row)
    bad = np.flatnonzero(from_each[:, -2:].any(1))
    if bad.size:
        s = int(bad[0])
        raise bad_routing("topk_idx" if s == me else f"topk_idx of rank {s}", topk_idx, E,
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
        regroup, ungroup = block_permutation(matrix)
        on_dev = to_device([regroup, ungroup], dev)
        pair_row = order.new_empty(0)
        if n_kept == pairs:  # dropless: every pair has its sent row
            pair_row = torch.empty_like(order)
            pair_row[order] = torch.arange(pairs, device=dev)
        handles.append(DispatchHandle(matrix.sum(0).tolist(), mine[c].sum(1).tolist(), matrix.sum(1).tolist(),
                                      torch.from_numpy(matrix), order, torch.div(order, k, rounding_mode="floor"),
                                      on_dev[:regroup.size], tokens, k, pairs - n_kept,
                                      ungroup=on_dev[regroup.size:], pair_row=pair_row))
    return handles
