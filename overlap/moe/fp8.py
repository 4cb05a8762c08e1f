"""FP8 dispatch: tokens cross as e4m3 with one float32 scale per 128 elements.

Design note. A dispatch moves every (token, rank) row at the activations' width; the experts'
inputs tolerate e4m3 (DeepSeek-V3 trains with it), so a row of ``hidden`` bf16 elements
(``2 * hidden`` bytes) can cross as ``hidden`` e4m3 bytes and ``hidden / 128`` float32 scales
(``hidden * 33 / 32`` bytes, 0.52x). Each block of 128 elements is scaled so that its largest
magnitude maps to e4m3's largest (448), then rounded to e4m3 (3 mantissa bits): an element's
error is at most 2^-4 of it, or for elements below 2^-15 of their block's largest (e4m3's
subnormals) 2^-10 of the block's scale (largest x 1/448); a block of small elements keeps its
own scale. The packed row is raw bytes (``uint8``), so it crosses over any transport that
moves such rows (``Transport.packed_rows``: NCCL's ``all_to_all_single`` of any rows; the peer
transport's kernels, which copy a row's bytes whatever they hold); the receiver dequantizes
into the dispatcher's dtype before the experts. On CUDA one Triton kernel packs and one unpacks
(``_fp8_triton.py``); the torch operations here are the definition they match byte for byte.
Under ``torch.compile`` it runs inside ``MoELayer``'s op (``fp8_dispatch=True``); a
dispatcher's own ``dispatch(..., fp8=True)`` is not traced. Combine and every backward pass
stay in that dtype (the gradient of a dispatch is a combine of the gradient rows: straight through the rounding,
as FP8 training recipes treat it).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from collectives.errors import InvalidArgumentError, UnsupportedError

from .handles import DispatchHandle
from .transport import Transport

__all__ = ["BLOCK", "E4M3_MAX", "packed_width", "quantize_rows", "dequantize_rows", "check_fp8_rows", "dispatch_fp8",
           "dispatch_fp8_experts"]

BLOCK = 128
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def packed_width(hidden: int) -> int:
    """Bytes of one packed row: ``hidden`` e4m3 values, then ``hidden / BLOCK`` float32 scales."""
    return hidden + 4 * (hidden // BLOCK)


def check_fp8_rows(x: torch.Tensor) -> None:
    """Raise before anything is sent where ``x [tokens, hidden]`` cannot be packed."""
    if x.shape[1] % BLOCK:
        raise InvalidArgumentError("x", x, f"has hidden {x.shape[1]}, not a multiple of {BLOCK} (one scale per "
                                   f"{BLOCK} elements)", "dispatch without fp8, or pad hidden")
    if not x.dtype.is_floating_point:
        raise InvalidArgumentError("x", x, f"has dtype {x.dtype}", "pass floating-point tokens")


def _kernels(t: torch.Tensor) -> Any:
    """The Triton kernels (``_fp8_triton.py``) where ``t`` is on CUDA and Triton is installed, else None."""
    if not t.is_cuda or importlib.util.find_spec("triton") is None:
        return None
    from . import _fp8_triton  # deferred: Triton is optional and compiles on first use

    return _fp8_triton


def quantize_rows(x: torch.Tensor, *, fused: bool = True) -> torch.Tensor:
    """``[tokens, packed_width(hidden)]`` uint8: each row's e4m3 values and its block scales
    (on CUDA one Triton kernel where ``fused``; else torch operations, the definition)."""
    T, H = x.shape
    k = _kernels(x) if fused else None
    if k is not None:
        return k.pack(x, torch.empty((T, packed_width(H)), dtype=torch.uint8, device=x.device), BLOCK)
    blocks = x.float().view(T, H // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    # times the float32 reciprocal, not divided: the same rounding on every device (torch's CUDA
    # division by a number multiplies by its reciprocal; the CPU's divides)
    scale = torch.where(amax > 0, amax * (1.0 / E4M3_MAX), torch.ones_like(amax))  # a block of zeros stays zeros
    q = (blocks / scale).to(torch.float8_e4m3fn).view(T, H).view(torch.uint8)
    return torch.cat([q, scale.view(T, H // BLOCK).view(torch.uint8).view(T, 4 * (H // BLOCK))], 1)


def dequantize_rows(packed: torch.Tensor, hidden: int, dtype: torch.dtype, *, fused: bool = True) -> torch.Tensor:
    """``[rows, hidden]`` in ``dtype`` from rows of :func:`quantize_rows` (as it, on CUDA)."""
    R = packed.shape[0]
    k = _kernels(packed) if fused and packed.stride(-1) == 1 else None
    if k is not None:
        return k.unpack(packed, torch.empty((R, hidden), dtype=dtype, device=packed.device), BLOCK)
    nb = hidden // BLOCK
    q = packed[:, :hidden].contiguous().view(torch.float8_e4m3fn).float().view(R, nb, BLOCK)
    scale = packed[:, hidden:].contiguous().view(torch.float32).view(R, nb, 1)
    return (q * scale).view(R, hidden).to(dtype)


def _sent(transport: Transport, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, DispatchHandle]:
    """``x``'s rows packed, through ``transport.dispatch_packed``, unpacked into ``x``'s dtype."""
    packed, handle = transport.dispatch_packed(quantize_rows(x), topk_idx)
    return dequantize_rows(packed, x.shape[1], x.dtype), handle


class _Fp8Dispatch(torch.autograd.Function):
    """The packed rows over ``transport.dispatch_packed``, dequantized, the handle put in ``box``;
    backward: the transport's ``dispatch_backward`` of the gradient rows in their own dtype
    (straight through)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_idx: torch.Tensor, transport: Transport,
                box: list[DispatchHandle]) -> torch.Tensor:
        recv, handle = _sent(transport, x, topk_idx)
        box.append(handle)
        ctx.handle, ctx.transport, ctx.shape = handle, transport, x.shape
        return recv

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return ctx.transport.dispatch_backward(g.contiguous(), ctx.handle).view(ctx.shape), None, None, None


def dispatch_fp8(transport: Transport, x: torch.Tensor, topk_idx: torch.Tensor
                 ) -> tuple[torch.Tensor, DispatchHandle]:
    """``MoEDispatcher.dispatch(..., fp8=True)`` (checked there): the packed rows, routed."""
    if not transport.packed_rows:
        raise UnsupportedError("fp8", True, f"needs a transport that moves packed rows of raw bytes; "
                               f"{type(transport).__name__} moves rows of its hidden size only",
                               "use transport='nccl' or 'peer', or fp8=False")
    check_fp8_rows(x)
    if torch.is_grad_enabled() and x.requires_grad:
        box: list[DispatchHandle] = []
        recv = _Fp8Dispatch.apply(x, topk_idx, transport, box)
        return recv, box[0]
    return _sent(transport, x, topk_idx)


class _Fp8Experts(torch.autograd.Function):
    """Packed rows over ``transport.dispatch_packed`` into ``experts.forward_fp8`` (the FP8
    experts, no dequantization), the handle put in ``box``; the received packed rows are kept.
    Backward in ``x``'s dtype: the kept rows dequantized, the experts' plain (bf16) products
    run again on them with autograd, and the rows' gradient dispatched back
    (``transport.dispatch_backward``): straight through the rounding of rows and weights."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_idx: torch.Tensor, transport: Transport, experts: Any,
                box: list[DispatchHandle], *params: torch.Tensor) -> torch.Tensor:
        packed, handle = transport.dispatch_packed(quantize_rows(x), topk_idx)
        box.append(handle)
        out = experts.forward_fp8(packed, handle.tokens_per_expert, ends=handle.expert_ends, dtype=x.dtype)
        ctx.save_for_backward(packed)
        ctx.handle, ctx.transport, ctx.experts, ctx.shape, ctx.dtype = handle, transport, experts, x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        (packed,) = ctx.saved_tensors
        params = list(ctx.experts.parameters())
        ran = getattr(ctx.experts, "last_path", None)  # the forward's path, which the recompute would replace
        with torch.enable_grad():
            recv = dequantize_rows(packed, ctx.shape[1], ctx.dtype).requires_grad_()
            h = ctx.handle
            out = ctx.experts(recv, h.tokens_per_expert, **({"ends": h.expert_ends} if h.expert_ends is not None else {}))
            grads = torch.autograd.grad(out, [recv, *params], g, allow_unused=True)
        ctx.experts.last_path = ran
        gx = ctx.transport.dispatch_backward(grads[0].contiguous(), ctx.handle).view(ctx.shape)
        return (gx, None, None, None, None, *grads[1:])


def dispatch_fp8_experts(transport: Transport, x: torch.Tensor, topk_idx: torch.Tensor, experts: Any
                         ) -> tuple[torch.Tensor, DispatchHandle]:
    """The FP8 dispatch straight into FP8 experts (``experts.forward_fp8``, a ``GroupedSwiGLU(...,
    fp8=True)``): (their output rows ``[received pairs, hidden]`` in ``x``'s dtype, the handle).
    Differentiable in ``x`` and the experts' parameters (``_Fp8Experts``); checked as
    :func:`dispatch_fp8`."""
    if not transport.packed_rows:
        raise UnsupportedError("fp8", True, f"needs a transport that moves packed rows of raw bytes; "
                               f"{type(transport).__name__} moves rows of its hidden size only",
                               "use transport='nccl' or 'peer', or fp8=False")
    check_fp8_rows(x)
    params = list(experts.parameters())
    if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
        box: list[DispatchHandle] = []
        out = _Fp8Experts.apply(x, topk_idx, transport, experts, box, *params)
        return out, box[0]
    packed, handle = transport.dispatch_packed(quantize_rows(x), topk_idx)
    return experts.forward_fp8(packed, handle.tokens_per_expert, ends=handle.expert_ends, dtype=x.dtype), handle
