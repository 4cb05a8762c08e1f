"""The FP8 dispatch's packing as two Triton kernels (``fp8.py``); imported only when they run.

Each program takes ``GROUP`` blocks of 128 elements of one row: ``pack`` reads them once and
writes their e4m3 bytes and float32 scales into the packed row, ``unpack`` reads the packed
bytes once and writes the row in the output's dtype. The arithmetic is ``fp8.py``'s torch
definition's, step for step (float32 block maxima, scale = max * (1 / 448) in float32, an IEEE division by it, round to
nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["pack", "unpack"]

GROUP = 8  # blocks per program


@triton.jit
def _pack(x, out, x_stride, out_stride, H: tl.constexpr, NB: tl.constexpr,  # type: ignore[no-untyped-def]
          BLOCK: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    e = tl.arange(0, BLOCK)
    mask = (b < NB)[:, None]
    cols = b[:, None] * BLOCK + e[None, :]
    v = tl.load(x + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), 1)
    scale = tl.where(amax > 0, amax * (1.0 / 448.0), 1.0)
    q = tl.math.div_rn(v, tl.broadcast_to(scale[:, None], v.shape)).to(tl.float8e4nv, fp_downcast_rounding="rtne")  # IEEE division, as torch
    base = out + row * out_stride
    tl.store(base + cols, q.to(tl.uint8, bitcast=True), mask=mask)
    tl.store((base + H).to(tl.pointer_type(tl.float32)) + b, scale, mask=b < NB)


@triton.jit
def _unpack(p, out, p_stride, out_stride, H: tl.constexpr, NB: tl.constexpr,  # type: ignore[no-untyped-def]
            BLOCK: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    e = tl.arange(0, BLOCK)
    mask = (b < NB)[:, None]
    cols = b[:, None] * BLOCK + e[None, :]
    base = p + row * p_stride
    q = tl.load(base + cols, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    scale = tl.load((base + H).to(tl.pointer_type(tl.float32)) + b, mask=b < NB, other=1.0)
    tl.store(out + row * out_stride + cols, (q * scale[:, None]).to(out.dtype.element_ty), mask=mask)


def pack(x: torch.Tensor, packed: torch.Tensor, block: int) -> torch.Tensor:
    x = x.contiguous()
    T, H = x.shape
    nb = H // block
    if T:
        with torch.cuda.device(x.device):
            _pack[(T, triton.cdiv(nb, GROUP))](x, packed, x.stride(0), packed.stride(0), H=H, NB=nb, BLOCK=block,
                                               GROUP=GROUP, num_warps=4)
    return packed


def unpack(packed: torch.Tensor, out: torch.Tensor, block: int) -> torch.Tensor:
    R, H = out.shape
    nb = H // block
    if R:
        with torch.cuda.device(out.device):
            _unpack[(R, triton.cdiv(nb, GROUP))](packed, out, packed.stride(0), out.stride(0), H=H, NB=nb,
                                                 BLOCK=block, GROUP=GROUP, num_warps=4)
    return out
