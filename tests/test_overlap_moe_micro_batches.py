"""``MoEDispatcher.forward_micro_batches`` and ``MoELayer(micro_batches=, shared_expert=)`` on Gloo
(2-4 ranks) against the single-process definition in float64: outputs and every gradient.

The experts are the fixed affine maps of ``test_overlap_moe`` (any rank rebuilds one from its
id); the reference is ``reference_moe`` over this rank's tokens, with capacity drops applied per
micro-batch (the first ``cap`` pairs of each expert in token order within the micro-batch), as
the dispatcher's documentation says. Cases: uneven random routing, every token to one expert, a
rank with no tokens, fewer tokens than micro-batches (empty micro-batches), three micro-batches,
capacity drops, a shared expert.
"""

from __future__ import annotations

import math
import pytest
import torch
import torch.nn.functional as F

from collectives.errors import InvalidArgumentError
from overlap.moe import MoEDispatcher, MoELayer, reference_moe
from overlap.moe.micro_batches import micro_batch_bounds

from .test_overlap_moe import H, _expert, _kept_mask, _routing, run_layer, sharded_layer, token_data


class _Shared(torch.nn.Module):
    """A shared expert every rank builds alike: a SwiGLU MLP of its own seed."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(555)
        self.w1 = torch.nn.Parameter(torch.randn(hidden, ffn, generator=g, dtype=torch.float64) / hidden ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(ffn, hidden, generator=g, dtype=torch.float64) / ffn ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x @ self.w1) @ self.w2


def _dispatcher_case(rank: int, world: int, case: str, e_per_rank: int, k: int, tokens: list[int], seed: int,
                     capacity: float | None, n: int, shared: bool) -> float:
    experts = e_per_rank * world
    x, idx, w = _routing(rank, tokens[rank], experts, k, case, seed)
    disp = MoEDispatcher(experts, H, dtype=torch.float64, capacity_factor=capacity)
    calls = []

    def local(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        calls.append(rows.shape[0])
        outs = [_expert(disp.first_expert + e, r) for e, r in enumerate(rows.split(per_expert))]
        return torch.cat(outs) if outs else rows

    mod = _Shared(H, 5) if shared else None
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = disp.forward_micro_batches(xs, idx, ws, local, micro_batches=n, shared_expert=mod)
    assert len(calls) == n, calls  # the experts ran once per micro-batch, empty ones included
    G = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7 * rank), dtype=torch.float64)
    (out * G).sum().backward()

    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    wk = wr
    if capacity is not None:
        keep = torch.zeros(idx.shape, dtype=torch.bool)
        for lo, hi in micro_batch_bounds(x.shape[0], n):
            keep[lo:hi] = _kept_mask(idx[lo:hi], experts, math.ceil(capacity * (hi - lo) * k / experts))
        wk = wr * keep
    ref = reference_moe(xr, idx, wk, _expert)
    ref_mod = _Shared(H, 5) if shared else None
    if ref_mod is not None:
        ref = ref + ref_mod(xr)
    if ref.requires_grad and x.numel():
        (ref * G).sum().backward()
    errs = [(out - ref).abs().max().item() if out.numel() else 0.0]
    if x.numel():
        errs += [(xs.grad - xr.grad).abs().max().item(), (ws.grad - wr.grad).abs().max().item()]
        if mod is not None and ref_mod is not None:
            errs += [(mod.w1.grad - ref_mod.w1.grad).abs().max().item(), (mod.w2.grad - ref_mod.w2.grad).abs().max().item()]
    return max(errs)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_micro_batches_match_the_single_process_moe(worlds, world_size: int) -> None:  # noqa: ANN001
    w = worlds(world_size)
    uneven = [5 + 3 * r for r in range(world_size)]
    zero_on_one = [7] * world_size
    zero_on_one[1] = 0
    few = [1] * world_size  # fewer tokens than micro-batches: an empty micro-batch on every rank
    cases = [
        ("random", 2, 2, uneven, None, 2, False),
        ("one_expert", 2, 2, uneven, None, 2, False),
        ("random", 2, 2, zero_on_one, None, 2, True),
        ("random", 1, 1, few, None, 2, False),
        ("random", 2, 3, uneven, None, 3, True),
        ("random", 2, 2, uneven, 0.5, 2, False),      # capacity drops, per micro-batch
        ("random", 2, 2, uneven, None, 1, True),      # one micro-batch: the shared expert beside the dispatch
    ]
    if world_size > 2:  # the Gloo ranks share 2 cores: the cases above at 2 ranks, a few at 3 and 4
        cases = cases[1:3] + cases[4:6]
    for seed, (case, e_per_rank, k, tokens, capacity, n, shared) in enumerate(cases):
        for err in w.run(_dispatcher_case, case, e_per_rank, k, tokens, 300 + seed, capacity, n, shared):
            assert err < 1e-12, (case, e_per_rank, k, tokens, capacity, n, shared, err)


def _layer_case(rank: int, world: int, tokens: list[int], n: int, shared: bool) -> float:
    """``MoELayer(micro_batches=n, shared_expert=...)`` against the single-process layer: the
    output, the input's, the router's, the experts' and the shared expert's gradients."""
    torch.manual_seed(2468)  # the same layer on every rank
    E, k, FF = 2 * world, 2, 10
    mod = _Shared(H, 7) if shared else None
    layer, router, full = sharded_layer(rank, world, H, E, k, FF, micro_batches=n, shared_expert=mod)
    ref_mod = _Shared(H, 7) if shared else None
    lo = rank * (E // world)

    data = token_data(tokens, H, 91)
    x, G = data(rank)
    out, xs = run_layer(layer, x, G)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return (F.silu(rows @ full.w1[e]) * (rows @ full.w3[e])) @ full.w2[e]

    # every rank's tokens through the reference: the experts' gradients sum over them; this
    # rank's part alone gives the output and the input's, router's and shared expert's gradients
    mine = [router.weight] + ([ref_mod.w1, ref_mod.w2] if ref_mod is not None else [])
    errs, total = [], torch.zeros((), dtype=torch.float64)
    for q in range(world):
        xq, Gq = data(q)
        xq.requires_grad_()
        probs = torch.softmax(router(xq), dim=-1)
        wt, idx = probs.topk(k, dim=-1)
        ref = reference_moe(xq, idx, wt / wt.sum(-1, keepdim=True), expert)
        if ref_mod is not None:
            ref = ref + ref_mod(xq)
        total = total + (ref * Gq).sum()
        if q == rank and tokens[rank]:
            errs.append((out - ref).abs().max().item())
            got = torch.autograd.grad((ref * Gq).sum(), [xq, *mine], retain_graph=True)
            errs.append((xs.grad - got[0]).abs().max().item())
            errs.append((layer.router.weight.grad - got[1]).abs().max().item())
            if mod is not None:
                errs += [(mod.w1.grad - got[2]).abs().max().item(), (mod.w2.grad - got[3]).abs().max().item()]
    total.backward()
    for name in ("w1", "w2", "w3"):
        errs.append((getattr(layer.experts, name).grad - getattr(full, name).grad[lo:lo + E // world]).abs().max().item())
    return max(errs)


def test_moe_layer_in_micro_batches_matches_the_single_process_layer(worlds) -> None:  # noqa: ANN001
    w = worlds(2)
    for tokens, n, shared in (([9, 6], 2, False), ([7, 0], 2, True), ([5, 8], 3, True), ([4, 3], 1, True)):
        assert max(w.run(_layer_case, tokens, n, shared)) < 1e-10, (tokens, n, shared)


def _refusals(rank: int, world: int) -> list[str]:
    msgs = []
    disp = MoEDispatcher(2 * world, H, dtype=torch.float64)
    x, idx, wt = _routing(rank, 4, 2 * world, 2, "random", 1)
    for n in (0, -1, 1.5, True):
        try:
            disp.forward_micro_batches(x, idx, wt, lambda r, c: r, micro_batches=n)  # type: ignore[arg-type]
        except InvalidArgumentError as e:
            msgs.append(str(e))
    try:
        MoELayer(H, 4, 2 * world, 2, dtype=torch.float64, micro_batches=2, chunks=2)
    except InvalidArgumentError as e:
        msgs.append(str(e))
    # the group is still usable after the refusals
    out = disp.forward_micro_batches(x, idx, wt, lambda r, c: 2 * r, micro_batches=2)
    msgs.append(f"ok {float((out - 2 * (wt.sum(1, keepdim=True) * x)).abs().max()):.1e}")
    return msgs


def test_bad_micro_batches_are_refused_before_anything_is_sent(worlds) -> None:  # noqa: ANN001
    for msgs in worlds(2).run(_refusals):
        assert len(msgs) == 6, msgs
        assert all("micro_batches" in m for m in msgs[:4]), msgs
        assert "chunks" in msgs[4] and "micro_batches=2" in msgs[4], msgs
        assert msgs[5].startswith("ok ") and float(msgs[5][3:]) < 1e-12, msgs

