"""MoE dispatch and combine on Gloo (2-4 ranks) against the single-process definition.

Each expert is a fixed affine map any rank can rebuild from its id, so every rank computes the
reference ``out[t] = sum_j w[t, j] * expert_{idx[t, j]}(x[t])`` for its own tokens in float64,
and its gradients with autograd. Cases: uneven random routing, every token to one expert, a rank
with no tokens, capacity drops (the reference drops the same pairs: the first ``cap`` pairs of
each expert in token order are kept), and the chunked forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import collectives as C
from collectives.errors import InvalidArgumentError, UnsupportedError
from overlap.moe import GroupedSwiGLU, MoEDispatcher, MoELayer, reference_moe
from tests._compiled import compile_checked
from tests.mp import messages

H = 6


def sharded_layer(rank: int, world: int, hidden: int, E: int, k: int, FF: int, dtype: torch.dtype = torch.float64,
                  **options: Any) -> tuple[Any, torch.nn.Linear, GroupedSwiGLU]:
    """A ``MoELayer`` of ``dtype`` holding rank ``rank``'s experts of one whole expert set, and the
    float64 router and whole set (for the single-process reference); seed torch first, alike on
    every rank."""
    router = torch.nn.Linear(hidden, E, bias=False).double()
    full = GroupedSwiGLU(E, hidden, FF, dtype=torch.float64)
    layer = MoELayer(hidden, FF, E, k, dtype=dtype, **options)
    lo = rank * (E // world)
    with torch.no_grad():
        layer.router.weight.copy_(router.weight)
        for name in ("w1", "w2", "w3"):
            getattr(layer.experts, name).copy_(getattr(full, name)[lo:lo + E // world])
    return layer, router, full


def token_data(tokens: list[int], hidden: int, seed: int, device: str = "cpu"
               ) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """``data(q)``: rank q's float64 tokens ``[tokens[q], hidden]`` and output gradient, the same
    on every rank (seeded by ``seed + q``)."""
    def data(q: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed + q)
        return torch.randn(tokens[q], hidden, generator=g, dtype=torch.float64).to(device), \
            torch.randn(tokens[q], hidden, generator=g, dtype=torch.float64).to(device)
    return data


def run_layer(layer: Any, x: torch.Tensor, G: torch.Tensor, backend: str | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``layer`` (compiled with ``backend``, its graph holding ``moe_layer``) on a leaf copy of
    ``x``, and the backward of ``(out * G).sum()``: returns (out, the leaf)."""
    xs = x.clone().requires_grad_()
    forward = layer
    if backend is not None:
        forward, traced = compile_checked(layer, backend, xs)
        assert "commops.moe_layer" in traced, traced
        layer.zero_grad(set_to_none=True)
    out = forward(xs)
    (out * G).sum().backward()
    return out, xs


def _expert_params(e: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + e)
    return torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5, torch.randn(H, generator=g, dtype=torch.float64)


def _expert(e: int, x: torch.Tensor) -> torch.Tensor:
    w, b = _expert_params(e)
    return torch.tanh(x @ w + b)


def _routing(rank: int, tokens: int, experts: int, k: int, case: str, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed * 31 + rank)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    if case == "one_expert":
        idx = torch.zeros(tokens, k, dtype=torch.int64)
        idx[:, 1:] = torch.arange(1, k)  # token t goes to experts 0, 1, ..., k-1: expert 0 gets everything
    else:
        idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) if tokens else \
            torch.empty(0, k, dtype=torch.int64)
    w = torch.rand(tokens, k, generator=g, dtype=torch.float64)
    return x, idx, w


def _kept_mask(idx: torch.Tensor, experts: int, cap: int) -> torch.Tensor:
    """Which (token, j) pairs an expert capacity of ``cap`` keeps: the first ``cap`` per expert in token order."""
    keep = torch.zeros(idx.numel(), dtype=torch.bool)
    seen = [0] * experts
    for p, e in enumerate(idx.reshape(-1).tolist()):
        if seen[e] < cap:
            keep[p] = True
        seen[e] += 1
    return keep.view(idx.shape)


def _case(rank: int, world: int, case: str, e_per_rank: int, k: int, tokens: list[int], seed: int,
          capacity: float | None, chunks: int | str, pieces: int = 1, weights_grad: bool = True,
          routing: str = "auto") -> dict[str, float]:
    experts = e_per_rank * world
    x, idx, w = _routing(rank, tokens[rank], experts, k, case, seed)
    disp = MoEDispatcher(experts, H, dtype=torch.float64, capacity_factor=capacity, exchange_pieces=pieces,
                         routing=routing)

    def local(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        outs = [_expert(disp.first_expert + e, r) for e, r in enumerate(rows.split(per_expert))]
        return torch.cat(outs) if outs else rows

    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_(weights_grad)
    if chunks == 1:
        recv, handle = disp.dispatch(xs, idx, ws)
        assert recv.shape[0] == sum(handle.tokens_per_expert) and len(handle.tokens_per_expert) == e_per_rank
        out = disp.combine(local(recv, handle.tokens_per_expert), handle, ws)
        dropped = handle.dropped
    else:
        out = disp.forward_pipelined(xs, idx, ws, local, chunks=chunks)
        dropped = 0
    G = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7 * rank), dtype=torch.float64)
    (out * G).sum().backward()

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_(weights_grad)
    want_dropped = 0
    wk = wr
    if capacity is not None:
        keep = _kept_mask(idx, experts, math.ceil(capacity * x.shape[0] * k / experts))
        want_dropped = int((~keep).sum())
        wk = wr * keep
    ref = reference_moe(xr, idx, wk, _expert)
    if ref.requires_grad:  # a rank without tokens has nothing to differentiate (but ran our backward above)
        (ref * G).sum().backward()
    err = max((out - ref).abs().max().item() if out.numel() else 0.0,
              (xs.grad - xr.grad).abs().max().item() if x.numel() else 0.0,
              (ws.grad - wr.grad).abs().max().item() if w.numel() and weights_grad else 0.0)
    return {"err": err, "dropped": float(dropped), "want_dropped": float(want_dropped if chunks == 1 else 0)}


@pytest.mark.parametrize("world_size,routing", [(2, "auto"), (3, "auto"), (4, "auto"), (2, "device"), (3, "device")])
def test_dispatch_combine_match_the_single_process_moe(worlds, world_size: int, routing: str) -> None:  # noqa: ANN001
    """Every case with the routing worked out on the host (numpy: "auto" on CPU) and by torch
    operations ("device", here on the CPU: the code the GPUs run)."""
    w = worlds(world_size)
    uneven = [5 + 3 * r for r in range(world_size)]
    zero_on_one = [7] * world_size
    zero_on_one[1] = 0
    cases = [
        ("random", 2, 2, uneven, None, 1),
        ("random", 2, 3, uneven, None, 1),
        ("random", 1, 1, uneven, None, 1),
        ("one_expert", 2, 2, uneven, None, 1),
        ("random", 2, 2, zero_on_one, None, 1),
        ("random", 2, 2, uneven, 0.5, 1),        # capacity drops
        ("one_expert", 2, 2, uneven, 1.0, 1),    # most of expert 0's pairs dropped
        ("random", 2, 2, uneven, None, 3),       # chunked forward
    ]
    for seed, (case, e_per_rank, k, tokens, capacity, chunks) in enumerate(cases):
        results = w.run(_case, case, e_per_rank, k, tokens, seed, capacity, chunks, 1, True, routing)
        for res in results:
            assert res["err"] < 1e-12, (case, e_per_rank, k, tokens, capacity, chunks, routing, res)
            assert res["dropped"] == res["want_dropped"], (case, capacity, routing, res)
        if capacity is not None:
            assert sum(r["dropped"] for r in results) > 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_exchange_in_pieces_matches_the_single_process_moe(worlds, world_size: int) -> None:  # noqa: ANN001
    """``exchange_pieces``: dispatch (and combine, where the weights need no gradient) move the
    rows in pieces; more pieces than rows leaves some empty."""
    w = worlds(world_size)
    uneven = [5 + 3 * r for r in range(world_size)]
    zero_on_one = [7] * world_size
    zero_on_one[1] = 0
    cases = [
        ("random", 2, 2, uneven, None, 1, 3, False),
        ("random", 2, 2, uneven, None, 1, 3, True),      # combine in one piece (the weights' gradient)
        ("one_expert", 2, 2, uneven, None, 1, 7, False),
        ("random", 2, 2, zero_on_one, None, 1, 4, False),
        ("random", 2, 2, uneven, 0.5, 1, 2, False),       # capacity drops
        ("random", 2, 2, uneven, None, 3, 2, False),      # chunked forward, each chunk in pieces
    ]
    for seed, (case, e_per_rank, k, tokens, capacity, chunks, pieces, wgrad) in enumerate(cases):
        for res in w.run(_case, case, e_per_rank, k, tokens, 100 + seed, capacity, chunks, pieces, wgrad):
            assert res["err"] < 1e-12, (case, tokens, capacity, chunks, pieces, wgrad, res)
            assert res["dropped"] == res["want_dropped"], (case, capacity, res)


def _errors(rank: int, world: int) -> list[str]:
    d = MoEDispatcher(2 * world, H)
    x = torch.randn(3, H)
    bad_ids = (torch.tensor([[0, 0], [1, 2], [0, 1]]), torch.tensor([[0, 99], [1, 2], [0, 1]]), torch.zeros(3, 2))
    return messages([lambda: MoEDispatcher(2 * world + 1, H), lambda: MoEDispatcher(2 * world, H, capacity_factor=0.0),
                     *(lambda idx=idx: d.dispatch(x, idx) for idx in bad_ids),
                     lambda: MoEDispatcher(2 * world, H, transport="nvshmem"),
                     lambda: MoEDispatcher(2 * world, H, transport="peer", top_k=2),
                     lambda: MoEDispatcher(2 * world, H, transport="peer", max_tokens=8, top_k=2 * world + 1),
                     lambda: MoEDispatcher(2 * world, H, transport="peer", max_tokens=8, top_k=2).dispatch(
                         x, torch.tensor([[0, 1]] * 3)),
                     lambda: d.dispatch_low_latency(x, torch.tensor([[0, 1]] * 3)),
                     lambda: MoEDispatcher(2 * world, H, transport="peer", max_tokens=8, top_k=2).dispatch_low_latency(
                         x, torch.tensor([[0, 1]] * 3)),
                     lambda: MoEDispatcher(2 * world, H, routing="gpu"),
                     lambda: MoEDispatcher(2 * world, H, routing="device", exchange_pieces=2)])


def test_bad_routing_is_refused_before_anything_is_sent(worlds) -> None:  # noqa: ANN001
    for msgs in worlds(2).run(_errors):
        assert all("Fix:" in m for m in msgs), msgs
        assert "num_experts" in msgs[0] and "capacity_factor" in msgs[1]
        assert "same expert twice" in msgs[2] and "outside" in msgs[3] and "integer" in msgs[4]
        assert "transport" in msgs[5]
        assert "max_tokens" in msgs[6] and "top_k" in msgs[7] and "peer" in msgs[8] and "GPUs of one node" in msgs[8]
        assert "low-latency" in msgs[9] and "transport='peer'" in msgs[9] and "GPUs of one node" in msgs[10]
        assert "routing" in msgs[11] and "'gpu'" in msgs[11] and "exchange_pieces=1" in msgs[12]


def _options_case(rank: int, world: int) -> list[str]:
    """A transport's options object in place of its name and keyword arguments: the same
    transport, the same results, the old attributes read from it; the old arguments are refused
    beside it, and an option's bad value raises when the object is built."""
    from overlap.layers import MoELayer
    from overlap.moe import NcclOptions, PeerOptions

    E = 2 * world
    x, idx, w = _routing(rank, 5 + 2 * rank, E, 2, "random", 11)

    def local(disp: MoEDispatcher) -> Any:
        def run(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
            outs = [_expert(disp.first_expert + e, r) for e, r in enumerate(rows.split(per_expert))]
            return torch.cat(outs) if outs else rows
        return run

    by_name = MoEDispatcher(E, H, dtype=torch.float64, routing="device")
    by_options = MoEDispatcher(E, H, dtype=torch.float64, transport=NcclOptions(routing="device"))
    pieces = MoEDispatcher(E, H, dtype=torch.float64, transport=NcclOptions(exchange_pieces=3))
    want = reference_moe(x, idx, w, _expert)
    for d in (by_name, by_options, pieces):
        assert (d.forward(x, idx, w, local(d)) - want).abs().max().item() < 1e-12
    assert by_options.transport == "nccl" and by_options.routing == "device" and by_options.exchange_pieces == 1
    assert by_options.last_routing is not None and by_options.last_routing[0] == "device"
    assert pieces.exchange_pieces == 3 and pieces.transport_options == NcclOptions("auto", 3)
    peer = MoEDispatcher(E, H, transport=PeerOptions(max_tokens=8, top_k=2))  # its buffers wait for a dispatch
    assert peer.transport == "peer" and (peer.max_tokens, peer.top_k, peer.pipeline_transfers) == (8, 2, "auto")
    assert peer.offers_low_latency and not by_name.offers_low_latency
    peer.pipeline_transfers = "sm"
    assert peer.transport_options == PeerOptions(8, 2, "sm")
    torch.manual_seed(5)
    plain = MoELayer(H, 10, E, 2, dtype=torch.float64)
    torch.manual_seed(5)
    layer = MoELayer(H, 10, E, 2, dtype=torch.float64, transport=NcclOptions(exchange_pieces=2))
    assert layer.dispatcher.exchange_pieces == 2
    assert torch.allclose(layer(x), plain(x), rtol=1e-12, atol=1e-12)
    with pytest.raises(UnsupportedError, match="routing"):
        MoEDispatcher(E, H, transport="peer", max_tokens=8, top_k=2, routing="device")
    return messages([lambda: MoEDispatcher(E, H, transport=NcclOptions(), routing="host"),
                     lambda: NcclOptions(exchange_pieces=0),
                     lambda: PeerOptions(max_tokens=8, top_k=0),
                     lambda: MoEDispatcher(E, H, transport=PeerOptions(max_tokens=8, top_k=E + 1)),
                     lambda: setattr(peer, "pipeline_transfers", "dma")])


def test_a_transports_options_object_replaces_its_keyword_arguments(worlds) -> None:  # noqa: ANN001
    for msgs in worlds(2).run(_options_case):
        assert all("Fix:" in m for m in msgs), msgs
        assert "routing" in msgs[0] and "NcclOptions" in msgs[0]
        assert "exchange_pieces" in msgs[1] and "top_k" in msgs[2] and "needed by transport='peer'" in msgs[2]
        assert "top_k" in msgs[3] and "exceeds" in msgs[3] and "pipeline_transfers" in msgs[4]


def _layer_case(rank: int, world: int, tokens: list[int], capacity: float | None, routing: str = "auto",
                backend: str | None = None, device: str = "cpu", dtype: torch.dtype = torch.float64,
                **options: Any) -> float:
    """``MoELayer`` (eager or compiled with ``backend``) against the float64 single-process layer:
    the largest error of its gradients, which carry its output's. ``device``: where it runs
    ("cuda" over NCCL, or another transport of ``options``); ``dtype``: the layer's, its inputs
    the float64 data rounded to it; ``options``: more of ``MoELayer``'s (released after)."""
    import torch.nn.functional as F

    torch.manual_seed(4321)  # the same reference on every rank
    E, k, FF = 2 * world, 2, 10
    layer, router, full = sharded_layer(rank, world, H, E, k, FF, dtype, capacity_factor=capacity, routing=routing,
                                        **options)
    layer, router, full = layer.to(device), router.to(device), full.to(device)
    lo = rank * (E // world)

    try:
        data = token_data(tokens, H, 77, device)
        x, G = data(rank)
        _, xs = run_layer(layer, x.to(dtype), G.to(dtype), backend)

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return (F.silu(rows @ full.w1[e]) * (rows @ full.w3[e])) @ full.w2[e]

        # The reference over every rank's tokens (the experts' gradients sum over them); this rank's
        # part also gives the input's and the router's gradients.
        loss = torch.zeros((), dtype=torch.float64, device=device)
        mine = None
        for q in range(world):
            xq, Gq = data(q)
            xq = xq.clone().requires_grad_()
            probs = torch.softmax(router(xq), dim=-1)
            w, idx = probs.topk(k, dim=-1)
            w = w / w.sum(-1, keepdim=True)
            if capacity is not None:
                w = w * _kept_mask(idx, E, math.ceil(capacity * tokens[q] * k / E))
            out = reference_moe(xq, idx, w, expert)
            if q == rank:
                mine = (xq, router.weight.grad)
                rloss = (out * Gq).sum()
            loss = loss + (out * Gq).sum()
        assert mine is not None
        rgrad = torch.autograd.grad(rloss, [router.weight, mine[0]], retain_graph=True, allow_unused=True) \
            if tokens[rank] else (None, None)
        loss.backward()
        errs = [(xs.grad - rgrad[1]).abs().max().item() if tokens[rank] else 0.0]
        if tokens[rank]:
            errs.append((layer.router.weight.grad - rgrad[0]).abs().max().item())
        for name in ("w1", "w2", "w3"):
            errs.append((getattr(layer.experts, name).grad - getattr(full, name).grad[lo:lo + E // world]).abs().max().item())
    finally:
        layer.close()  # collective: every rank, whatever it found
    return max(errs)


@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_layer_matches_the_single_process_layer(worlds, world_size: int) -> None:  # noqa: ANN001
    w = worlds(world_size)
    tokens = [9 + 2 * r for r in range(world_size)]
    for capacity in (None, 0.75):
        assert max(w.run(_layer_case, tokens, capacity)) < 1e-10, capacity
    tokens[0] = 0  # a rank without tokens still takes part in every exchange
    assert max(w.run(_layer_case, tokens, None)) < 1e-10
    # the routing worked out by torch operations (what CUDA ids of a prefill get), drops included
    for capacity in (None, 0.75):
        assert max(w.run(_layer_case, tokens, capacity, "device")) < 1e-10, capacity


def _moe_bench_smoke(rank: int, world: int) -> list[tuple[int, int, float]]:
    from bench.moe_bench import measure_config

    recs = measure_config(C.get_communicator(), "tiny", 6 + rank, 8, 12, 2 * world, 2, torch.float32,
                          torch.device("cpu"), chunk_counts=(2, "auto", "micro2"), iters=1, reps=1)
    assert recs[1].auto_ran.startswith("1 (one chunk"), recs[1].auto_ran  # no table over NCCL/Gloo
    for r in recs:  # the derived figures follow from the timed ones
        small = min(r.experts_us, r.dispatch_us + r.combine_us)
        assert r.ideal_us == max(r.experts_us, r.dispatch_us + r.combine_us) and small > 0
        assert abs(r.hidden_small_pct - 100 * (r.sequential_us - r.pipelined_us) / small) < 1e-6
        assert r.train_pipelined_us > 0 and r.train_speedup_paired > 0
        # what crosses: whole rows (8 floats) bound for the other rank, a part of those sent
        assert 0 <= r.bytes_crossing < r.bytes_sent and r.bytes_crossing % 32 == 0, (r.bytes_crossing, r.bytes_sent)
        assert abs(r.dispatch_link_GBps * r.dispatch_us * 1e3 - r.bytes_crossing) <= 1e-6 * r.bytes_sent
        # the terms timed in the pipeline's rounds give a share too; no copy engines on CPUs
        assert math.isfinite(r.hidden_small_paired_pct) and r.ce_link_GBps == r.dispatch_vs_ce == 0.0
        assert math.isfinite(r.train_hidden_small_paired_pct)
    recs += measure_config(C.get_communicator(), "tiny", 6 + rank, 8, 12, 2 * world, 2, torch.float32,
                           torch.device("cpu"), chunk_counts=(2,), iters=1, reps=1, routing="device")
    assert all(r.layer_sequential_us > 0 and r.layer_pipelined_us > 0 and r.layer_speedup_paired > 0 for r in recs)
    return [(r.chunks, r.wrong, r.bytes_sent, r.routing) for r in recs]


def test_moe_benchmark_smoke(worlds) -> None:  # noqa: ANN001
    for rank, recs in enumerate(worlds(2).run(_moe_bench_smoke)):
        sent = (6 + rank) * 2 * 8 * 4  # tokens * k rows of 8 floats
        assert recs == [(2, 0, sent, "host"), ("auto", 0, sent, "host"), ("micro2", 0, sent, "host"),
                        (2, 0, sent, "device")]


def _pipelined_no_grad(rank: int, world: int, chunks: int, routing: str = "auto") -> float:
    experts = 2 * world
    x, idx, w = _routing(rank, 11 + 3 * rank, experts, 2, "random", 99)
    disp = MoEDispatcher(experts, H, dtype=torch.float64, routing=routing)

    def local(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        outs = [_expert(disp.first_expert + e, r) for e, r in enumerate(rows.split(per_expert))]
        return torch.cat(outs) if outs else rows

    with torch.no_grad():
        got = disp.forward_pipelined(x, idx, w, local, chunks=chunks)
    want = "device" if routing == "device" else "host"  # CPU ids: numpy under "auto"
    assert disp.last_routing is not None and disp.last_routing[0] == want, disp.last_routing
    return (got - reference_moe(x, idx, w, _expert)).abs().max().item()


@pytest.mark.parametrize("world_size,routing", [(2, "auto"), (3, "auto"), (3, "device")])
def test_overlapped_pipeline_without_autograd_matches(worlds, world_size: int, routing: str) -> None:  # noqa: ANN001
    for chunks in (2, 4):
        assert max(worlds(world_size).run(_pipelined_no_grad, chunks, routing)) < 1e-12


def _bad_on_rank_1(rank: int, world: int, what: str) -> str:
    d = MoEDispatcher(2 * world, H, routing="device")
    idx = torch.tensor([[0, 1], [2, 3], [1, 0]])
    if rank == 1:
        idx[1, 1] = 2 if what == "repeat" else 99
    try:
        d.dispatch(torch.randn(3, H), idx)
    except InvalidArgumentError as exc:
        # and the dispatcher still works: the refused call sent no rows
        recv, h = d.dispatch(torch.ones(3, H), torch.tensor([[0, 1], [2, 3], [1, 0]]))
        assert recv.shape[0] == sum(h.tokens_per_expert) and bool((recv == 1).all())
        return str(exc)
    return "raised nothing"


@pytest.mark.parametrize("what,text", [("repeat", "same expert twice"), ("range", "outside")])
def test_device_routing_refuses_a_bad_routing_on_every_rank(worlds, what: str, text: str) -> None:  # noqa: ANN001
    msgs = worlds(3).run(_bad_on_rank_1, what)
    assert all(text in m and "Fix:" in m for m in msgs), msgs
    assert "rank 1" in msgs[0] and "rank 1" in msgs[2] and "rank 1" not in msgs[1], msgs


def _pipelined_drops(rank: int, world: int, chunks: int) -> float:
    """The no-grad pipeline with a capacity (applied per chunk, like the autograd path) and a rank
    without tokens, against the float64 definition of each chunk with the pairs its capacity
    keeps (each expert's first ``cap`` of this rank's chunk, in token order)."""
    experts = 2 * world
    tokens = 0 if rank == 1 else 17 + 5 * rank
    x, idx, w = _routing(rank, tokens, experts, 2, "random", 5)
    disp = MoEDispatcher(experts, H, dtype=torch.float64, capacity_factor=0.6)

    def local(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        outs = [_expert(disp.first_expert + e, r) for e, r in enumerate(rows.split(per_expert))]
        return torch.cat(outs) if outs else rows

    with torch.no_grad():
        got = disp.forward_pipelined(x, idx, w, local, chunks=chunks)
        parts = []
        for lo, hi in ((tokens * i // chunks, tokens * (i + 1) // chunks) for i in range(chunks)):
            keep = _kept_mask(idx[lo:hi], experts, math.ceil(0.6 * (hi - lo) * 2 / experts))
            parts.append(reference_moe(x[lo:hi], idx[lo:hi], w[lo:hi] * keep, _expert))
        want = torch.cat(parts)
    assert got.shape == want.shape
    return (got - want).abs().max().item() if got.numel() else 0.0


def test_overlapped_pipeline_drops_per_chunk(worlds) -> None:  # noqa: ANN001
    assert max(worlds(3).run(_pipelined_drops, 3)) < 1e-12


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_grouped_experts_match_one_gemm_per_expert_in_float64(dtype: torch.dtype, tol: float) -> None:
    from overlap.moe.experts import grouped_mm_works

    if not grouped_mm_works(torch.device("cpu"), dtype):
        pytest.skip(f"torch {torch.__version__} has no CPU grouped GEMM for {dtype}")
    torch.manual_seed(3)
    m = GroupedSwiGLU(4, 16, 24, dtype=dtype)
    tokens = [5, 0, 9, 2]  # an expert without rows
    x = torch.randn(sum(tokens), 16, dtype=dtype, requires_grad=True)
    assert m._grouped(x)
    g = torch.randn(sum(tokens), 16, dtype=dtype)
    (m(x, tokens) * g).sum().backward()
    y = m(x.detach(), tokens)
    with torch.no_grad():  # inference takes a path of its own (no autograd.Function): the same values
        assert torch.equal(m(x.detach(), tokens), y)

    x64 = x.detach().double().requires_grad_()
    ws = [p.detach().double().requires_grad_() for p in (m.w1, m.w3, m.w2)]
    outs = [(F.silu(r @ ws[0][e]) * (r @ ws[1][e])) @ ws[2][e] for e, r in enumerate(x64.split(tokens))]
    ref = torch.cat(outs)
    (ref * g.double()).sum().backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max())

    assert rel(y, ref) < tol and rel(x.grad, x64.grad) < tol
    for p, q in zip((m.w1, m.w3, m.w2), ws):
        assert rel(p.grad, q.grad) < tol

    # ends= (DispatchHandle.expert_ends) is what the grouped GEMMs take: a split other than
    # tokens' gives that split's products
    other = [0, 7, 2, 7]
    ends = torch.tensor(np.cumsum(other), dtype=torch.int32)
    with torch.no_grad():
        got = m(x.detach(), tokens, ends=ends)
        want = torch.cat([(F.silu(r @ ws[0][e]) * (r @ ws[1][e])) @ ws[2][e] for e, r in enumerate(x64.split(other))])
    assert rel(got, want) < tol
    for bad in (ends.long(), ends[:3]):
        with pytest.raises(InvalidArgumentError, match="ends"):
            m(x.detach(), tokens, ends=bad)


def test_padded_experts_match_one_gemm_per_expert_in_float64() -> None:
    torch.manual_seed(4)
    m = GroupedSwiGLU(3, 16, 24, dtype=torch.float32)
    cap, tokens = 7, [5, 0, 7]  # an empty block, a full one
    x = torch.randn(3, cap, 16)
    got = m.forward_padded(x)
    assert got.shape == (3, cap, 16)
    ws = [p.detach().double() for p in (m.w1, m.w3, m.w2)]
    for e, n in enumerate(tokens):
        rows = x[e, :n].double()
        want = (F.silu(rows @ ws[0][e]) * (rows @ ws[1][e])) @ ws[2][e]
        assert torch.allclose(got[e, :n].double(), want, rtol=1e-5, atol=1e-5), e


def test_block_permutation_is_the_stable_sort_by_local_expert() -> None:
    """recv_x's order (by local expert, then source, then arrival) from the received blocks' sizes,
    against its definition: a stable sort of the received rows by local expert."""
    import numpy as np

    from overlap.moe.routing import block_permutation

    rng = np.random.default_rng(1)
    for trial in range(200):
        w, e_loc = int(rng.integers(1, 6)), int(rng.integers(1, 9))
        matrix = rng.integers(0, 5, size=(w, e_loc))
        if trial % 7 == 0:
            matrix[:] = 0  # nothing received
        want = np.argsort(np.repeat(np.tile(np.arange(e_loc), w), matrix.reshape(-1)), kind="stable")
        regroup, ungroup = block_permutation(matrix)
        assert np.array_equal(regroup, want), matrix
        assert np.array_equal(ungroup[want], np.arange(want.size)), matrix


def test_grouped_swiglu_says_which_path_ran_and_why_on_cpu() -> None:
    from overlap.moe._grouped_gemm import few_rows, gpu_bound
    from overlap.moe.experts import grouped_mm_works

    m = GroupedSwiGLU(2, 16, 24)
    x = torch.randn(5, 16)
    with torch.no_grad():
        m(x, [2, 3])
    # torch's grouped GEMM where this torch has one on CPU, else one GEMM per expert
    why = "CUDA" if grouped_mm_works(torch.device("cpu"), x.dtype) else "per expert"
    assert m.last_path is not None and m.last_path[0] == "torch" and why in m.last_path[1], m.last_path
    m.fused = False
    m(x, [2, 3])
    assert m.last_path == ("torch", "fused=False")
    # the measured cases behind the threshold (overlap/moe/_grouped_gemm.py): a Qwen3-30B-like decode
    # step was host-bound, a DeepSeek-V3-like one and the prefills were not
    assert not gpu_bound(1024, 16, 2048, 768, 2)
    assert gpu_bound(1024, 32, 7168, 2048, 2)
    assert all(gpu_bound(*c, 2) for c in [(65536, 16, 2048, 768), (32768, 16, 4096, 512), (16384, 8, 4096, 1024)])
    # the down product is Triton's at a decode step's 32 rows per expert, torch's at prefill's thousands
    assert few_rows(1024, 32) and not few_rows(32768, 32) and not few_rows(16384, 8)


def test_sm_carveout_holds_torchs_setting_within_and_puts_the_previous_one_back() -> None:
    from overlap.moe._grouped_gemm import sm_carveout

    get = torch._C._get_sm_carveout_experimental
    assert get() is None
    with sm_carveout(5):
        assert get() == 5
        with sm_carveout(0):  # 0: leave the setting alone
            assert get() == 5
    assert get() is None
    with pytest.raises(ValueError), sm_carveout(7):
        raise ValueError("inside")
    assert get() is None


def _sources_refused(rank: int, world: int) -> str:
    disp = MoEDispatcher(2 * world, H, dtype=torch.float64)
    x, idx, w = _routing(rank, 5, 2 * world, 2, "random", 7)
    with torch.no_grad(), pytest.raises(UnsupportedError) as info:
        disp.forward_pipelined(x, idx, w, lambda rows, per: rows, chunks="sources")
    with pytest.raises(InvalidArgumentError, match="'sources'"):
        disp.forward_pipelined(x, idx, w, lambda rows, per: rows, chunks="by-rank")
    return str(info.value)


def test_the_pipeline_by_source_names_what_it_needs(worlds) -> None:  # noqa: ANN001
    for msg in worlds(2).run(_sources_refused):
        assert "chunks" in msg and "transport='peer'" in msg and "pipeline_transfers='copy_engine'" in msg, msg
