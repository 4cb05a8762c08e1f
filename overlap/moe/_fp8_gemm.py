"""FP8 experts: grouped GEMMs on e4m3 rows and e4m3 weights with blockwise scales, in Triton.

Design note. The FP8 dispatch (``fp8.py``) delivers each row as e4m3 values with one float32
scale per 128 channels (DeepEP's format). Dequantizing them so that bf16 experts can run costs a
pass over the rows and leaves the experts' GEMMs, a MoE layer's largest cost, at bf16 rates. Here
the experts run in e4m3 too, as DeepSeek-V3's recipe does: each expert's weights are quantized
once into 128 x 128 blocks, each with a float32 scale (its largest magnitude / 448), and kept
K-contiguous (``[E, N, K]``: Hopper's FP8 tensor-core instructions read both operands
K-major). A tile's K loop takes 128 columns at a time; each block's product of e4m3 values is
scaled by the row's and the weight block's scales into a float32 accumulator (DeepSeek-V3's
promotion: the tensor cores' own FP8 accumulation keeps fewer bits than float32 over K in the
thousands). The gate and up products share the A tile and leave the tile as ``silu(h1) * h3``
quantized again per row per 128 columns (the N tile is those 128 columns), so the down GEMM
reads e4m3 too; it writes the dispatcher's dtype for the combine.

Error bound. An element ``v`` of a block whose scale is ``s`` becomes ``round_e4m3(v / s) * s``:
its error is at most ``max(2**-4 |v|, 2**-10 s)`` (three mantissa bits, round to nearest; the
second term for e4m3's subnormals). The same bound holds for the rows (``fp8.py``), the weights
and the activation between the GEMMs; each product's error is then the sum of those of its
terms (``error_bound`` gives it elementwise).

The torch functions here (``*_reference``) are the definition: they dequantize into float32 and
multiply, which is the kernels' arithmetic up to the order of float32 additions. They run
wherever the kernels cannot (CPU, a GPU without Triton), and tests compare the two.
"""

from __future__ import annotations

import contextlib
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import _kernel_tuning
from . import fp8
from ._grouped_gemm import _sms

__all__ = ["BLOCK", "BlockwiseWeight", "quantize_weight", "split_rows", "supported", "grouped_swiglu_fp8",
           "grouped_mm_fp8", "grouped_swiglu_fp8_reference", "grouped_mm_fp8_reference", "error_bound"]

BLOCK = fp8.BLOCK  # 128: the K block of every product, the N tile of the gate/up kernel
_E4M3_REL = 2.0 ** -4  # half a unit in the last place of e4m3's three mantissa bits
_E4M3_SUB = 2.0 ** -10  # half e4m3's subnormal step (2**-9), in units of the block's scale

# (BM, warps, stages) of the two kernels; launch/tune_kernels.py searches them (``_kernel_tuning``)
_SWIGLU = (128, 8, 3)
_PLAIN = (128, 8, 4)


@dataclass(frozen=True)
class BlockwiseWeight:
    """One weight stack in e4m3 with a float32 scale per 128 x 128 block.

    Attributes:
        q: ``[E, N, K]`` ``float8_e4m3fn``, K contiguous (the transpose of the ``[E, K, N]``
            weight it was made from).
        scale: ``[E, N / 128, K / 128]`` float32.
    """

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """``[E, K, N]`` float32: the weight this stack stands for."""
        E, N, K = self.q.shape
        s = self.scale.repeat_interleave(BLOCK, 1).repeat_interleave(BLOCK, 2)
        return (self.q.float() * s).transpose(1, 2)


def quantize_weight(w: torch.Tensor) -> BlockwiseWeight:
    """``w [E, K, N]`` (K, N multiples of 128) as e4m3 blocks of 128 x 128, each scaled so that
    its largest magnitude maps to 448 (a block of zeros keeps scale 1); one expert at a time, so
    the float32 temporaries are one expert's."""
    E, K, N = w.shape
    q = torch.empty((E, N, K), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((E, N // BLOCK, K // BLOCK), dtype=torch.float32, device=w.device)
    for e in range(E):
        blocks = w[e].detach().t().float().reshape(N // BLOCK, BLOCK, K // BLOCK, BLOCK)
        amax = blocks.abs().amax((1, 3), keepdim=True)
        s = torch.where(amax > 0, amax * (1.0 / fp8.E4M3_MAX), torch.ones_like(amax))
        q[e] = (blocks / s).to(torch.float8_e4m3fn).reshape(N, K)
        scale[e] = s.reshape(N // BLOCK, K // BLOCK)
    return BlockwiseWeight(q, scale)


def split_rows(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of rows packed by ``fp8.quantize_rows``: (``[rows, hidden]`` e4m3, ``[rows, hidden /
    128]`` float32 scales), no copy."""
    return packed[:, :hidden].view(torch.float8_e4m3fn), packed[:, hidden:].view(torch.float32)


def _dequantize_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.repeat_interleave(BLOCK, 1)


def grouped_swiglu_fp8_reference(xq: torch.Tensor, xs: torch.Tensor, w1: BlockwiseWeight, w3: BlockwiseWeight,
                                 counts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition of :func:`grouped_swiglu_fp8`: per expert, ``silu(x w1) * (x w3)`` in
    float32 from the dequantized rows and weights, quantized as ``fp8.quantize_rows`` does."""
    x = _dequantize_rows(xq, xs)
    a1, a3 = w1.dequantize(), w3.dequantize()
    h = torch.cat([F.silu(xe @ a1[e]) * (xe @ a3[e]) for e, xe in enumerate(x.split(counts))]) if counts else \
        x.new_zeros((0, a1.shape[2]))
    return split_rows(fp8.quantize_rows(h, fused=False), h.shape[1])


def grouped_mm_fp8_reference(hq: torch.Tensor, hs: torch.Tensor, w2: BlockwiseWeight, counts: list[int],
                             dtype: torch.dtype) -> torch.Tensor:
    """The definition of :func:`grouped_mm_fp8`: per expert, the dequantized rows times the
    dequantized weight in float32, rounded to ``dtype``."""
    h = _dequantize_rows(hq, hs)
    a2 = w2.dequantize()
    parts = [he @ a2[e] for e, he in enumerate(h.split(counts))]
    return (torch.cat(parts) if parts else h.new_zeros((0, a2.shape[2]))).to(dtype)


def error_bound(x: torch.Tensor, w: torch.Tensor, x_scale_floor: torch.Tensor, w_scale_floor: torch.Tensor
                ) -> torch.Tensor:
    """Elementwise bound on ``|q(x) q(w) - x w|`` (float64): each term ``x_k w_k`` is off by at most
    ``|dx_k| |w_k| + |x_k| |dw_k| + |dx_k| |dw_k|`` with ``|dx| <= max(2**-4 |x|, 2**-10 s_x)`` (and
    so for ``w``); ``x_scale_floor`` / ``w_scale_floor`` are ``2**-10`` times each element's
    block scale, broadcast to ``x`` / ``w``."""
    dx = torch.maximum(_E4M3_REL * x.abs(), x_scale_floor)
    dw = torch.maximum(_E4M3_REL * w.abs(), w_scale_floor)
    return dx @ w.abs() + x.abs() @ dw + dx @ dw


def supported(x: torch.Tensor, *weights: BlockwiseWeight) -> str:
    """Why rows ``x`` (e4m3 ``[rows, K]``) and these weights cannot take the Triton kernels, or ``""``."""
    if not x.is_cuda:
        return f"the rows are on {x.device.type}"
    if torch.cuda.get_device_capability(x.device) < (8, 9):
        return "e4m3 tensor cores need compute capability 8.9 or later"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    for w in weights:
        E, N, K = w.q.shape
        if N % BLOCK or K % BLOCK:
            return f"a weight of {K} x {N} is not in whole blocks of {BLOCK}"
        if not w.q.is_contiguous() or w.q.device != x.device:
            return "a weight stack is not contiguous on the rows' device"
    if x.stride(-1) != 1:
        return "the rows' elements are not contiguous"
    return ""


def _kernel() -> Any:
    from . import _fp8_gemm_triton  # deferred: Triton is optional and compiles on first use

    return _fp8_gemm_triton.fp8_gmm


def _descriptor(w: BlockwiseWeight, bn: int) -> Any:
    from triton.tools.tensor_descriptor import TensorDescriptor  # deferred: Triton is optional

    E, N, K = w.q.shape
    return TensorDescriptor.from_tensor(w.q.view(E * N, K), [bn, BLOCK])


def _launch(xq: torch.Tensor, xs: torch.Tensor, w: BlockwiseWeight, w3: BlockwiseWeight | None, ends: torch.Tensor,
            out: torch.Tensor, out_scale: torch.Tensor | None, cfg: tuple[int, int, int], sms: int | None) -> None:
    bm, warps, stages = cfg
    E, N, K = w.q.shape
    if not (xq.shape[0] and out.shape[0]):
        return
    b = _descriptor(w, BLOCK)
    b3 = _descriptor(w3, BLOCK) if w3 is not None else b
    grid = _sms(xq.device, sms) if xq.is_cuda else (sms or 4)
    cs = out_scale if out_scale is not None else xs
    with torch.cuda.device(xq.device) if xq.is_cuda else contextlib.nullcontext():
        _kernel()[(grid,)](xq, xq.stride(0), xs, xs.stride(0), b, b3, w.scale, (w3 or w).scale, out, out.stride(0),
                           cs, cs.stride(0), ends, N, K, E, BM=bm, BN=BLOCK, BK=BLOCK, SMS=grid,
                           SWIGLU=w3 is not None, num_warps=warps, num_stages=stages)


def grouped_swiglu_fp8(xq: torch.Tensor, xs: torch.Tensor, w1: BlockwiseWeight, w3: BlockwiseWeight,
                       ends: torch.Tensor, *, sms: int | None = None, config: tuple[int, int, int] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[rows, F]`` e4m3, ``[rows, F / 128]`` float32 scales): ``silu(x w1[e]) * (x w3[e])`` for
    each expert's rows of ``xq [rows, H]`` e4m3 with scales ``xs [rows, H / 128]`` (any row
    strides: the dispatch's packed rows as :func:`split_rows` views them), quantized per row per
    128 columns. Expert e's rows end at ``ends[e]`` (int32 on the device). ``config``: (BM,
    warps, stages), else the tuned table's or the default. Check :func:`supported` first."""
    rows, F_ = xq.shape[0], w1.q.shape[1]
    hq = torch.empty((rows, F_), dtype=torch.float8_e4m3fn, device=xq.device)
    hs = torch.empty((rows, F_ // BLOCK), dtype=torch.float32, device=xq.device)
    _launch(xq, xs, w1, w3, ends, hq, hs, config or _config("fp8_swiglu", rows, w1), sms)
    return hq, hs


def grouped_mm_fp8(hq: torch.Tensor, hs: torch.Tensor, w2: BlockwiseWeight, ends: torch.Tensor, dtype: torch.dtype,
                   *, sms: int | None = None, config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``[rows, N]`` in ``dtype``: each expert's e4m3 rows ``hq`` (scales ``hs``) times its weight
    block stack ``w2``; otherwise as :func:`grouped_swiglu_fp8`."""
    out = torch.empty((hq.shape[0], w2.q.shape[1]), dtype=dtype, device=hq.device)
    _launch(hq, hs, w2, None, ends, out, None, config or _config("fp8_mm", hq.shape[0], w2), sms)
    return out


def _config(kernel: str, rows: int, w: BlockwiseWeight) -> tuple[int, int, int]:
    """The launch configuration of ``kernel`` for ``rows`` over ``w``: the tuned table's entry for
    this shape class, else the cost model's pick (``_kernel_tuning``)."""
    E, N, K = w.q.shape
    default = _SWIGLU if kernel == "fp8_swiglu" else _PLAIN
    return _kernel_tuning.pick(kernel, rows, E, N, K, "e4m3", w.q.device, default)
