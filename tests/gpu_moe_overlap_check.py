"""The overlapped MoE forms on GPUs against a float64 MoE: ``torchrun --nproc-per-node N
tests/gpu_moe_overlap_check.py`` (run by ``tests/test_gpu_moe_overlap.py``).

Ranks may share GPUs (``local_rank % device_count``), as in ``gpu_moe_sources_check.py``: the
peer transport maps a GPU's own memory from another process as it maps a peer's, and nothing
here uses NCCL. Every kernel, copy, stream and event is real; shared GPUs time nothing.

Families:

- ``micro/<dtype>``: ``forward_micro_batches`` over the peer transport, forward and backward,
  against the float64 single-process MoE with autograd: the output and the gradients of the
  tokens, the routing weights, every local expert's three weights and a shared expert's two.
  Fresh routing in every call; calls with uneven token counts, a rank without tokens, every
  token to one expert, an expert nobody picks, fewer tokens than micro-batches, 2 and 3
  micro-batches.
- ``soak/eager``: 1,000 ``forward_micro_batches`` calls back to back with changing routing and
  token counts, nothing waited for between them; every output checked afterwards.
- ``fp8/kernels``: the FP8 dispatch's Triton packing and unpacking byte for byte against their
  torch definition (``overlap/moe/fp8.py``).
- ``fp8/peer``: the FP8 dispatch over the peer transport (``PeerTransport.dispatch_packed``),
  bf16 and fp16, fresh routing per call, uneven token counts and a rank without tokens, over the
  device layout, at hidden 256 (scalar row copies) and 1024 (16-byte packs): the rows arrive
  as the plain dispatch's rows packed and unpacked by the definition, byte for byte (each row's packing is its own);
  their error against the plain rows within ``fp8.py``'s stated bound; the gradient straight
  through (equal to the plain dispatch's); the layer's output through the experts against the
  float64 MoE within ``FP8_LAYER_TOL`` (RMS).
- ``soak/graph``: the decode layer (``dispatch_low_latency``, ``GroupedSwiGLU.forward_padded``
  on the device counts, ``combine_low_latency``) twice in one CUDA graph (the transport's
  buffer halves alternate), replayed 500 times back to back with new routing copied in before
  each replay (1,000 layers); every output checked afterwards.

The soaks' reference is the definition, vectorised: every expert over every token in float64,
then ``sum_j w[t, j] * expert(idx[t, j])(x[t])``. Prints one line per failure and a summary;
exits non-zero on any; ``--json`` writes the families (``tests/_checks.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from overlap.moe import GroupedSwiGLU, MoEDispatcher, fp8, reference_moe  # noqa: E402
from tests._checks import Checks, check_arguments, dtype_name, report, shared_gpu_ranks  # noqa: E402

DTYPES = (torch.bfloat16, torch.float32)
# of the reference tensor's largest element: bf16 rounds the activation, the output and each
# gradient's operands; fp32 runs the same kernels without the rounding
TOL = {torch.bfloat16: 4e-2, torch.float32: 2e-3}
H, FF, FF_SHARED, K = 256, 128, 96, 2
SOAK_CALLS, SOAK_MAX_TOKENS = 1000, 96
# of the float64 layer's RMS: e4m3 rounds each input element by up to 2^-4 of it (about 3.6% RMS),
# then the products round as in ``micro``
FP8_LAYER_TOL = 5e-2


def families() -> tuple[str, ...]:
    return tuple(f"micro/{dtype_name(d)}" for d in DTYPES) + ("soak/eager", "soak/graph", "fp8/kernels", "fp8/peer")


class Shared(torch.nn.Module):
    """A shared expert (a SwiGLU MLP), the same on every rank."""

    def __init__(self, dtype: torch.dtype, dev: torch.device) -> None:
        super().__init__()
        g = torch.Generator(device=dev).manual_seed(4242)
        self.w1 = torch.nn.Parameter((torch.randn(H, FF_SHARED, generator=g, device=dev) / H ** 0.5).to(dtype))
        self.w2 = torch.nn.Parameter((torch.randn(FF_SHARED, H, generator=g, device=dev) / FF_SHARED ** 0.5).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x @ self.w1) @ self.w2


def _experts(E: int, r: int, w: int, dtype: torch.dtype, dev: torch.device) -> tuple[GroupedSwiGLU, GroupedSwiGLU]:
    """Every expert (seeded alike on every rank) and this rank's slice of them, in ``dtype``."""
    torch.manual_seed(77)
    whole = GroupedSwiGLU(E, H, FF, dtype=dtype, device=dev)
    mine = GroupedSwiGLU(E // w, H, FF, dtype=dtype, device=dev)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(mine, name).copy_(getattr(whole, name)[r * (E // w):(r + 1) * (E // w)])
    return whole, mine


def _inputs(q: int, seed: int, T: int, E: int, dtype: torch.dtype, dev: torch.device, case: str
            ) -> tuple[torch.Tensor, ...]:
    """Rank q's tokens, expert ids, weights and output gradient for one call."""
    g = torch.Generator(device=dev).manual_seed(seed * 131 + q)
    x = torch.randn(T, H, generator=g, device=dev).to(dtype)
    scores = torch.rand(T, E, generator=g, device=dev)
    if case == "one_expert":
        scores[:, 0] = 2.0  # every token's first choice
    scores[:, E - 1] = -1.0  # nobody picks the last expert
    w = torch.rand(T, K, generator=g, device=dev).to(dtype)
    return x, scores.topk(K, dim=-1).indices, w, torch.randn(T, H, generator=g, device=dev).to(dtype)


def _swiglu64(whole64: dict[str, torch.Tensor], e: int, rows: torch.Tensor) -> torch.Tensor:
    return (F.silu(rows @ whole64["w1"][e]) * (rows @ whole64["w3"][e])) @ whole64["w2"][e]


def _close(ck: Checks, where: str, got: torch.Tensor | None, want: torch.Tensor | None, tol: float) -> None:
    ck.count()
    if want is None or want.numel() == 0:
        if got is not None and got.numel() and not bool((got == 0).all()):
            ck.fail(f"{where}: a gradient where none flows")
        return
    if got is None or got.shape != want.shape:
        ck.fail(f"{where}: got {None if got is None else tuple(got.shape)}, want {tuple(want.shape)}")
        return
    scale = max(want.abs().max().item(), 1e-6)
    err = (got.double() - want).abs().max().item()
    if not err <= tol * scale:  # (NaN fails)
        ck.fail(f"{where}: max error {err:.3g} over {tol} x {scale:.3g}")


VERBOSE: list[bool] = []


def _say(msg: str) -> None:
    if VERBOSE:
        print(msg, flush=True)


def check_micro(ck: Checks, r: int, w: int, dtype: torch.dtype, dev: torch.device) -> None:
    E = 4 * w
    whole, mine = _experts(E, r, w, dtype, dev)
    whole64 = {n: getattr(whole, n).detach().double().requires_grad_() for n in ("w1", "w2", "w3")}
    disp = MoEDispatcher(E, H, dtype=dtype, device=dev, transport="peer", max_tokens=320, top_k=K)
    # (case, tokens of rank q, micro-batches, shared expert)
    calls = [("random", lambda q: 150 + 37 * q, 2, True),
             ("random", lambda q: 0 if q == 0 else 200 + q, 2, False),
             ("one_expert", lambda q: 90 + 11 * q, 3, True),
             ("random", lambda q: 1 if q == w - 1 else 301, 2, True)]  # one token: an empty micro-batch
    for call, (case, tokens, n, with_shared) in enumerate(calls):
        where = f"rank {r} {dtype_name(dtype)} call {call} ({case}, {n} micro-batches)"
        every = [_inputs(q, 900 + call, tokens(q), E, dtype, dev, case) for q in range(w)]
        x, idx, wt, gout = every[r]
        shared = Shared(dtype, dev) if with_shared else None
        for p in mine.parameters():
            p.grad = None
        xs, ws = x.clone().requires_grad_(), wt.clone().requires_grad_()
        out = disp.forward_micro_batches(xs, idx, ws, mine, micro_batches=n, shared_expert=shared)
        _say(f"{where}: forward issued")
        out.backward(gout)
        torch.cuda.synchronize()
        _say(f"{where}: backward done")
        # the reference: every rank's tokens (the experts' gradients sum over them), in float64
        shared64 = {n_: p.detach().double().requires_grad_() for n_, p in shared.named_parameters()} if shared else {}
        total = torch.zeros((), dtype=torch.float64, device=dev)
        for g in whole64.values():
            g.grad = None
        for q, (xq, iq, wq, gq) in enumerate(every):
            x64, w64 = xq.double().requires_grad_(), wq.double().requires_grad_()
            ref = reference_moe(x64, iq, w64, lambda e, rows: _swiglu64(whole64, e, rows))
            if shared64:
                ref = ref + F.silu(x64 @ shared64["w1"]) @ shared64["w2"]
            loss = (ref * gq.double()).sum()
            if q == r:
                _close(ck, f"{where} output", out.detach(), ref.detach(), TOL[dtype])
                if xq.shape[0]:
                    leaves = [x64, w64, *shared64.values()]
                    got = torch.autograd.grad(loss, leaves, retain_graph=True)
                    _close(ck, f"{where} grad x", xs.grad, got[0], TOL[dtype])
                    _close(ck, f"{where} grad weights", ws.grad, got[1], TOL[dtype])
                    if shared is not None:
                        for (name, p), want in zip(shared.named_parameters(), got[2:]):
                            _close(ck, f"{where} grad shared.{name}", p.grad, want, TOL[dtype])
            total = total + loss
        total.backward()
        _say(f"{where}: reference done")
        lo = r * (E // w)
        for name in ("w1", "w2", "w3"):
            grad = whole64[name].grad
            want = grad[lo:lo + E // w] if grad is not None else None
            _close(ck, f"{where} grad experts.{name}", getattr(mine, name).grad, want, TOL[dtype])
    disp.close()


def _definition(x: torch.Tensor, idx: torch.Tensor, wt: torch.Tensor, whole64: dict[str, torch.Tensor]) -> torch.Tensor:
    """``sum_j wt[t, j] * expert_idx[t, j](x[t])`` with every expert over every token, float64
    (the activation rounded to ``x``'s dtype once, as the kernels round it)."""
    a = x.double()
    h = F.silu(torch.einsum("th,ehf->etf", a, whole64["w1"])) * torch.einsum("th,ehf->etf", a, whole64["w3"])
    y = torch.einsum("etf,efh->eth", h.to(x.dtype).double(), whole64["w2"])
    picked = y[idx, torch.arange(x.shape[0], device=x.device)[:, None]]  # [T, K, H]
    return (wt.double()[..., None] * picked).sum(1)


def _wrong(got: torch.Tensor, want: torch.Tensor, tol: float) -> int:
    """Elements of ``got`` off ``want`` by more than ``tol`` of its largest element (NaN counts)."""
    if not want.numel():
        return 0
    bad = ~((got.double() - want).abs() <= tol * max(want.abs().max().item(), 1e-6))
    return int(bad.sum())


def _tally(ck: Checks, where: str, pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]], tol: float) -> int:
    """One check per (what, got, want): its wrong elements; the total."""
    total = 0
    for what, got, want in pairs:
        bad = _wrong(got, want, tol)
        ck.count()
        if bad:
            ck.fail(f"{where} {what}: {bad} wrong elements")
        total += bad
    return total


def soak_eager(ck: Checks, r: int, w: int, dev: torch.device) -> None:
    """``SOAK_CALLS`` micro-batched forwards back to back: changing routing, token counts
    (zero on some rank now and then), 2 or 3 micro-batches, a shared expert every other call."""
    dtype, E = torch.bfloat16, 4 * w
    whole, mine = _experts(E, r, w, dtype, dev)
    whole64 = {n: getattr(whole, n).detach().double() for n in ("w1", "w2", "w3")}
    shared = Shared(dtype, dev)
    disp = MoEDispatcher(E, H, dtype=dtype, device=dev, transport="peer", max_tokens=SOAK_MAX_TOKENS, top_k=K)
    kept = []
    with torch.no_grad():
        for call in range(SOAK_CALLS):
            T = 0 if call % 97 == r else SOAK_MAX_TOKENS // 2 + (call * 7 + 13 * r) % (SOAK_MAX_TOKENS // 2 + 1)
            x, idx, wt, _ = _inputs(r, 5000 + call, T, E, dtype, dev, "one_expert" if call % 50 == 3 else "random")
            use = shared if call % 2 else None
            out = disp.forward_micro_batches(x, idx, wt, mine, micro_batches=2 + call % 2, shared_expert=use)
            kept.append((x, idx, wt, use, out))
        torch.cuda.synchronize()

        def pairs() -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
            for call, (x, idx, wt, use, out) in enumerate(kept):
                want = _definition(x, idx, wt, whole64)
                if use is not None:
                    want = want + (F.silu(x.double() @ use.w1.double()) @ use.w2.double())
                yield f"call {call} ({x.shape[0]} tokens)", out, want

        wrong = _tally(ck, f"rank {r} eager soak", pairs(), TOL[dtype])
    print(f"rank {r}: eager soak, {SOAK_CALLS} calls, {wrong} wrong elements", flush=True)
    disp.close()


def soak_graph(ck: Checks, r: int, w: int, dev: torch.device) -> None:
    """The decode layer twice in one CUDA graph, replayed ``SOAK_CALLS // 2`` times back to back,
    new routing copied into its inputs before each replay and its outputs copied out after."""
    dtype, E, T = torch.bfloat16, 4 * w, 64
    whole, mine = _experts(E, r, w, dtype, dev)
    whole64 = {n: getattr(whole, n).detach().double() for n in ("w1", "w2", "w3")}
    disp = MoEDispatcher(E, H, dtype=dtype, device=dev, transport="peer", max_tokens=T, top_k=K)
    pool = [_inputs(r, 7000 + call, T, E, dtype, dev, "one_expert" if call % 40 == 5 else "random")[:3]
            for call in range(SOAK_CALLS)]
    xs = torch.stack([p[0] for p in pool])
    ids = torch.stack([p[1] for p in pool])
    wts = torch.stack([p[2] for p in pool])
    static = [(xs[i].clone(), ids[i].clone(), wts[i].clone()) for i in range(2)]

    def layer(x: torch.Tensor, idx: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
        rv, hl = disp.dispatch_low_latency(x, idx)
        return disp.combine_low_latency(mine.forward_padded(rv, hl.tokens_per_expert), hl, wt)

    outs = torch.full((SOAK_CALLS, T, H), float("nan"), dtype=dtype, device=dev)
    try:
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # buffers and kernels exist before the capture
                for a in static * 2:
                    layer(*a)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = [layer(*a) for a in static]
            for rep in range(SOAK_CALLS // 2):
                for j, (x, idx, wt) in enumerate(static):
                    i = 2 * rep + j
                    x.copy_(xs[i])
                    idx.copy_(ids[i])
                    wt.copy_(wts[i])
                graph.replay()
                outs[2 * rep:2 * rep + 2].copy_(torch.stack(got))
            torch.cuda.synchronize()
            del graph
    except Exception as exc:  # noqa: BLE001 - reported as a failure, with what raised
        ck.count()
        ck.fail(f"rank {r} graph soak: {type(exc).__name__}: {str(exc)[:300]}")
        disp.close()
        return
    wrong = _tally(ck, f"rank {r} graph soak", ((f"layer {i}", outs[i], _definition(xs[i], ids[i], wts[i], whole64))
                                                for i in range(SOAK_CALLS)), TOL[dtype])
    print(f"rank {r}: graph soak, {SOAK_CALLS} layers, {wrong} wrong elements", flush=True)
    disp.close()


def check_fp8_kernels(ck: Checks, r: int, dev: torch.device) -> None:
    """The FP8 dispatch's Triton packing against its torch definition (``fp8.py``), byte for
    byte, and the unpacking likewise, over rows of very different magnitudes, a block of
    zeros, odd row counts and a strided input."""
    g = torch.Generator(device=dev).manual_seed(31 + r)
    for T, H, dtype in ((1, 128, torch.bfloat16), (77, 7168, torch.bfloat16), (300, 2048, torch.float32),
                        (5, 384, torch.float16)):
        x = torch.randn(T, H, generator=g, device=dev) * torch.logspace(-4, 4, T, device=dev).view(T, 1)
        x[0, :128] = 0.0
        x = x.to(dtype)
        for what, src in (("contiguous", x), ("strided", torch.cat([x, x], 1)[:, :H])):
            fused = fp8.quantize_rows(src)
            plain = fp8.quantize_rows(src, fused=False)
            ck.count()
            if not torch.equal(fused, plain):
                ck.fail(f"rank {r} fp8 pack {T}x{H} {dtype_name(dtype)} {what}: "
                        f"{int((fused != plain).sum())} of {fused.numel()} bytes differ")
            ck.count()
            a, b = fp8.dequantize_rows(plain, H, dtype), fp8.dequantize_rows(plain, H, dtype, fused=False)
            if not torch.equal(a, b):
                ck.fail(f"rank {r} fp8 unpack {T}x{H} {dtype_name(dtype)} {what}: {int((a != b).sum())} elements differ")


def _fp8_bound(rows: torch.Tensor) -> torch.Tensor:
    """``fp8.py``'s bound on each element's error, in float64: 2^-4 of the element, or 2^-10 of
    its block's scale (largest / 448) below e4m3's normal range; plus the unpacked value's
    rounding to ``rows``' dtype (half an ulp: 2^-8 in bf16, 2^-11 in fp16)."""
    a = rows.double().abs()
    blocks = a.view(a.shape[0], -1, fp8.BLOCK)
    scale = (blocks.amax(-1, keepdim=True) / fp8.E4M3_MAX).expand_as(blocks).reshape(a.shape)
    ulp = 2.0 ** -8 if rows.dtype == torch.bfloat16 else 2.0 ** -11
    return (2.0 ** -4 + ulp) * a + 2.0 ** -10 * scale


def _fp8_rows(ck: Checks, where: str, disp: MoEDispatcher, x: torch.Tensor, idx: torch.Tensor, wt: torch.Tensor,
              seed: int) -> None:
    """One FP8 dispatch of ``x`` beside the plain one: the rows, their bound, the gradient. Every
    rank runs both dispatches and both backwards (collective) whatever its checks found."""
    xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, h8 = disp.dispatch(xs, idx, wt, fp8=True)
    plain, h = disp.dispatch(xp, idx, wt)
    dev = x.device
    g = torch.randn(plain.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(seed)).to(x.dtype)
    ck.count()
    if h8.tokens_per_expert != h.tokens_per_expert or got.shape != plain.shape:
        ck.fail(f"{where}: {h8.tokens_per_expert} rows per expert, the plain dispatch {h.tokens_per_expert}")
        got.backward(torch.zeros_like(got))
        plain.backward(g)
        return
    want = fp8.dequantize_rows(fp8.quantize_rows(plain.detach()), x.shape[1], x.dtype)
    ck.count()
    if not torch.equal(got, want):
        ck.fail(f"{where}: {int((got != want).sum())} of {got.numel()} elements differ from the plain rows packed "
                "and unpacked")
    ck.count()
    over = int(((got.double() - plain.double()).abs() > _fp8_bound(plain.detach())).sum())
    if over:
        ck.fail(f"{where}: {over} elements beyond fp8.py's bound")
    got.backward(g)
    plain.backward(g)
    ck.count()
    if not torch.equal(xs.grad, xp.grad):
        ck.fail(f"{where}: the gradient is not the plain dispatch's (straight through)")


def check_fp8_peer(ck: Checks, r: int, w: int, dev: torch.device) -> None:
    E = 4 * w
    for dtype in (torch.bfloat16, torch.float16):
        whole, mine = _experts(E, r, w, dtype, dev)
        whole64 = {n: getattr(whole, n).detach().double() for n in ("w1", "w2", "w3")}
        disp = MoEDispatcher(E, H, dtype=dtype, device=dev, transport="peer", max_tokens=320, top_k=K)
        # hidden 1024: packed rows of 1056 B, whole 16-byte packs (the vectorised kernels; the
        # 264-B rows of hidden H take the scalar ones)
        wide = MoEDispatcher(E, 1024, dtype=dtype, device=dev, transport="peer", max_tokens=320, top_k=K)
        for call, tokens in enumerate((lambda q: 150 + 37 * q, lambda q: 0 if q == 0 else 200 + q,
                                       lambda q: 301 - 50 * q)):
            where = f"rank {r} fp8 peer {dtype_name(dtype)} call {call}"
            x, idx, wt, _ = _inputs(r, 700 + call, tokens(r), E, dtype, dev, "random")
            spread = torch.logspace(-3, 3, H, device=dev).to(dtype)  # blocks of very different scales
            _fp8_rows(ck, f"{where} spread", disp, x * spread, idx, wt, 55 + call)
            _fp8_rows(ck, where, disp, x, idx, wt, 65 + call)
            g = torch.Generator(device=dev).manual_seed(80 + 7 * call + r)
            x_wide = (torch.randn(x.shape[0], 1024, generator=g, device=dev) * 4).to(dtype)
            _fp8_rows(ck, f"{where} hidden 1024", wide, x_wide, idx, wt, 75 + call)
            with torch.no_grad():
                out = disp.forward(x, idx, wt, mine, fp8=True)  # collective: every rank, tokens or not
            if not x.shape[0]:
                continue
            ref = _definition(x, idx, wt, whole64)
            ck.count()
            err = float((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30))
            _say(f"{where}: layer RMS error {err:.3g} of the float64 layer's")
            if not err <= FP8_LAYER_TOL:
                ck.fail(f"{where}: the layer's RMS error {err:.3g} of the float64 layer's, over {FP8_LAYER_TOL}")
        disp.close()
        wide.close()


def main() -> int:
    args = check_arguments(families(), verbose=True)
    if args.verbose:
        VERBOSE.append(True)
    only = args.only
    comm, dev = shared_gpu_ranks()
    w, r = comm.size, comm.rank
    ck = Checks(families(), r)
    for dtype in DTYPES:
        if f"micro/{dtype_name(dtype)}" in only:
            with ck.family(f"micro/{dtype_name(dtype)}"):
                check_micro(ck, r, w, dtype, dev)
    if "soak/eager" in only:
        with ck.family("soak/eager"):
            soak_eager(ck, r, w, dev)
    if "fp8/kernels" in only:
        with ck.family("fp8/kernels"):
            check_fp8_kernels(ck, r, dev)
    if "fp8/peer" in only:
        with ck.family("fp8/peer"):
            check_fp8_peer(ck, r, w, dev)
    if "soak/graph" in only:
        with ck.family("soak/graph"):
            soak_graph(ck, r, w, dev)
    failed = report(ck, args.json, "moe overlap", w)
    C.destroy()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
