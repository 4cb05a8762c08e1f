"""The FP8 dispatch (``MoEDispatcher.dispatch(..., fp8=True)``, ``overlap/moe/fp8.py``) against
the float64 definitions.

The rounding: every element within its stated bound of the float64 value (at most 2^-4 of it,
or 2^-10 of its block's scale for e4m3's subnormals), over blocks of very different magnitudes,
a block of zeros, and the extremes. Over Gloo at 2 and 3 ranks: recv_x within that bound of the
exact rows, the forward of linear experts within the bound carried through them, the tokens'
gradient equal to the plain dispatch's (straight through, linear experts) and the weights'
within its bound; typed refusals before anything is sent, the group usable after them.
"""

from __future__ import annotations

import pytest
import torch

from collectives.errors import InvalidArgumentError, UnsupportedError
from overlap.moe import MoEDispatcher, reference_moe
from overlap.moe.fp8 import BLOCK, dequantize_rows, packed_width, quantize_rows

HIDDEN = 2 * BLOCK


def _bound(x: torch.Tensor) -> torch.Tensor:
    """The stated bound on each element's error, from the float64 rows."""
    blocks = x.double().view(x.shape[0], -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True) / 448.0
    return torch.maximum(2.0 ** -4 * blocks.abs(), 2.0 ** -10 * scale).view(x.shape)


def test_rounding_stays_within_its_bound() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 3 * BLOCK, generator=g, dtype=torch.float64)
    x *= torch.logspace(-30, 30, 7, dtype=torch.float64).view(7, 1)  # each row its own magnitude
    x[1, BLOCK:2 * BLOCK] *= 1e-6  # a block far smaller than its row's others: its own scale
    x[2, :BLOCK] = 0.0
    x[3, 5] = 1e4 * x[3, :BLOCK].abs().max()  # one large element: its block's others go subnormal
    packed = quantize_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (7, packed_width(3 * BLOCK)) == (7, 3 * BLOCK + 12)
    got = dequantize_rows(packed, 3 * BLOCK, torch.float64)
    err = (got - x).abs()
    assert bool((err <= _bound(x)).all()), (err / _bound(x).clamp(min=1e-300)).max()
    assert bool((got[2, :BLOCK] == 0).all())
    # and the rounding is e4m3's of each block over its largest / 448, as defined (in float64
    # here: a division rounded differently before the cast may land one step away, rarely)
    blocks = x.view(7, -1, BLOCK)
    scale = blocks.abs().amax(-1, keepdim=True).float().double() / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    want = ((blocks / scale).to(torch.float8_e4m3fn).double() * scale).view(x.shape)
    off = int(((got - want).abs() > 1e-6 * want.abs()).sum())  # (the scale is float32 in the rows)
    assert off <= x.numel() // 1000, off


def _linear(e: int) -> torch.Tensor:
    return torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(700 + e), dtype=torch.float64) / 16


def _fp8_case(rank: int, world: int, tokens: list[int], seed: int) -> list[float]:
    E, k = 2 * world, 2
    g = torch.Generator().manual_seed(seed * 17 + rank)
    T = tokens[rank]
    x = torch.randn(T, HIDDEN, generator=g, dtype=torch.float64) * torch.logspace(-2, 2, HIDDEN, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(T, k, generator=g, dtype=torch.float64)
    G = torch.randn(T, HIDDEN, generator=g, dtype=torch.float64)
    disp = MoEDispatcher(E, HIDDEN, dtype=torch.float64)
    first = disp.first_expert

    def experts(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        outs = [r @ _linear(first + e) for e, r in enumerate(rows.split(per_expert))]
        return torch.cat(outs) if outs else rows

    with torch.no_grad():
        exact, _ = disp.dispatch(x, idx)
        got, handle = disp.dispatch(x, idx, fp8=True)
    assert handle.tokens_per_expert == disp.route(idx).tokens_per_expert
    assert exact.numel(), "every rank receives rows in these cases"
    ratio = [float(((got - exact).abs() / _bound(exact).clamp(min=1e-300)).max())]
    # forward and backward through linear experts: the rounding carried through |W_e|
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = disp.forward(xs, idx, ws, experts, fp8=True)
    (out * G).sum().backward()
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = reference_moe(xr, idx, wr, lambda e, rows: rows @ _linear(e))
    if T:
        (ref * G).sum().backward()
        bound = reference_moe(_bound(x), idx, w, lambda e, rows: rows @ _linear(e).abs())
        ratio.append(float(((out - ref).abs() / bound.clamp(min=1e-300)).max()))
        ratio.append(float((xs.grad - xr.grad).abs().max()) / 1e-12)  # straight through: the plain gradient
        per_pair = torch.stack([torch.stack([((_bound(x[t:t + 1]) @ _linear(int(idx[t, j])).abs()) * G[t].abs()).sum()
                                             for j in range(k)]) for t in range(T)])
        ratio.append(float(((ws.grad - wr.grad).abs() / per_pair.clamp(min=1e-300)).max()))
    return ratio


@pytest.mark.parametrize("world_size,tokens", [(2, [9, 5]), (2, [0, 7]), (3, [4, 6, 3])])
def test_fp8_dispatch_within_its_bound_and_gradients_straight_through(worlds, world_size: int,  # noqa: ANN001
                                                                      tokens: list[int]) -> None:
    for ratios in worlds(world_size).run(_fp8_case, tokens, 40 + world_size):
        assert all(r <= 1.0 for r in ratios), ratios
        # the rows were rounded (a dispatch that skipped the rounding would be 0 here)
        assert ratios[0] > 0.05, ratios


def _refusals(rank: int, world: int) -> list[str]:
    msgs = []
    disp = MoEDispatcher(2 * world, 100, dtype=torch.float32)  # hidden 100: no whole blocks
    x, idx = torch.randn(3, 100), torch.tensor([[0, 1], [1, 2], [3, 0]]) % (2 * world)
    try:
        disp.dispatch(x, idx, fp8=True)
    except InvalidArgumentError as e:
        msgs.append(str(e))
    whole = MoEDispatcher(2 * world, HIDDEN, dtype=torch.float32)
    whole.transport_impl.packed_rows = False  # as a transport of fixed-width rows says
    xw = torch.randn(3, HIDDEN)
    try:
        whole.dispatch(xw, idx, fp8=True)
    except UnsupportedError as e:
        msgs.append(str(e))
    whole.transport_impl.packed_rows = True
    # both groups still usable: nothing was sent by the refused calls
    recv, h = disp.dispatch(x, idx)
    got, _ = whole.dispatch(xw, idx, fp8=True)
    msgs.append(f"ok {recv.shape[0] == sum(h.tokens_per_expert)} {got.shape[1]}")
    return msgs


def test_fp8_dispatch_refuses_what_it_cannot_pack_before_sending(worlds) -> None:  # noqa: ANN001
    for msgs in worlds(2).run(_refusals):
        assert len(msgs) == 3, msgs
        assert "x" in msgs[0] and "100" in msgs[0] and "multiple of 128" in msgs[0], msgs
        assert "fp8" in msgs[1] and "packed rows" in msgs[1] and "nccl" in msgs[1], msgs
        assert msgs[2] == f"ok True {HIDDEN}", msgs


def layer_case(rank: int, world: int, tokens: list[int], backend: str | None, device: str = "cpu") -> list[float]:
    """``MoELayer(fp8_dispatch=True)`` (float64, eager or compiled with ``backend``) against the
    single-process layer whose experts take each token packed and unpacked (the rounding of the
    test above) and whose gradient goes straight through it; the router sees the exact tokens.
    Returns the largest error, and the largest difference from the same layer without FP8.
    ``device``: where it runs ("cuda" over NCCL too: ``tests/gpu_compile_check.py``)."""
    import torch.nn.functional as F

    from tests.test_overlap_moe import run_layer, sharded_layer, token_data

    torch.manual_seed(2468)
    E, k, FF = 2 * world, 2, 16
    layer, router, full = sharded_layer(rank, world, HIDDEN, E, k, FF, fp8_dispatch=True)
    plain = sharded_layer(rank, world, HIDDEN, E, k, FF)[0]
    plain.load_state_dict(layer.state_dict())
    layer, router, full, plain = layer.to(device), router.to(device), full.to(device), plain.to(device)

    data = token_data(tokens, HIDDEN, 501, device)
    x, G = data(rank)
    out, xs = run_layer(layer, x, G, backend)
    with torch.no_grad():
        unrounded = plain(x)  # collective: every rank, tokens or not
    apart = float((out.detach() - unrounded).abs().max()) if tokens[rank] else 0.0

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        return (F.silu(rows @ full.w1[e]) * (rows @ full.w3[e])) @ full.w2[e]

    loss = torch.zeros((), dtype=torch.float64, device=device)
    for q in range(world):
        xq, Gq = data(q)
        xq = xq.clone().requires_grad_()
        probs = torch.softmax(router(xq), dim=-1)
        w, idx = probs.topk(k, dim=-1)
        rounded = xq + (dequantize_rows(quantize_rows(xq.detach()), HIDDEN, torch.float64) - xq).detach()
        ref = reference_moe(rounded, idx, w / w.sum(-1, keepdim=True), expert)
        part = (ref * Gq).sum()
        if q == rank and tokens[rank]:
            want_out = ref.detach()
            want_gx, want_gr = torch.autograd.grad(part, [xq, router.weight], retain_graph=True)
        loss = loss + part
    loss.backward()
    errs = [0.0]
    if tokens[rank]:
        errs += [float((out - want_out).abs().max()), float((xs.grad - want_gx).abs().max()),
                 float((layer.router.weight.grad - want_gr).abs().max())]
    lo = rank * (E // world)
    for name in ("w1", "w2", "w3"):
        errs.append(float((getattr(layer.experts, name).grad - getattr(full, name).grad[lo:lo + E // world]).abs().max()))
    return [max(errs), apart]


@pytest.mark.parametrize("world_size,tokens,backend", [(2, [7, 5], None), (2, [6, 9], "aot_eager"),
                                                       (3, [0, 4, 6], None)])
def test_an_fp8_moe_layer_eager_and_compiled_matches_the_rounded_single_process_layer(
        worlds, world_size: int, tokens: list[int], backend: str | None) -> None:  # noqa: ANN001
    for rank, (err, apart) in enumerate(worlds(world_size).run(layer_case, tokens, backend, timeout=600)):
        assert err < 1e-10, err
        assert apart > 1e-4 if tokens[rank] else apart == 0.0, (rank, apart)  # the tokens were rounded


def _layer_refusals(rank: int, world: int) -> list[str]:
    from overlap.moe import MoELayer
    from tests.test_overlap_moe_transport import NAME, _registered

    msgs = []
    for kwargs in ({"micro_batches": 2}, {"chunks": 2}, {"hidden": 100}):
        args: dict = {"hidden": HIDDEN, **kwargs}
        try:
            MoELayer(args.pop("hidden"), 8, 2 * world, 2, dtype=torch.float32, fp8_dispatch=True, **args)
        except InvalidArgumentError as e:
            msgs.append(str(e))
    with _registered():  # a transport of fixed-width rows only
        try:
            MoELayer(HIDDEN, 8, 2 * world, 2, dtype=torch.float32, fp8_dispatch=True, transport=NAME)
        except UnsupportedError as e:
            msgs.append(str(e))
    # the group is still usable: a layer builds (its construction broadcasts the router)
    MoELayer(HIDDEN, 8, 2 * world, 2, dtype=torch.float32, fp8_dispatch=True)
    return msgs


def test_an_fp8_moe_layer_refuses_what_it_cannot_run_at_construction(worlds) -> None:  # noqa: ANN001
    for msgs in worlds(2).run(_layer_refusals):
        assert len(msgs) == 4, msgs
        assert "micro_batches=2" in msgs[0] and "chunks=2" in msgs[1] and "multiple of 128" in msgs[2], msgs
        assert "packed rows" in msgs[3] and "_PlainAllToAll" in msgs[3], msgs
