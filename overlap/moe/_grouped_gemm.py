"""A persistent grouped GEMM in Triton for the experts of one rank, and its SwiGLU-fused form.

Design note. ``GroupedSwiGLU`` computes ``w2(silu(x w1) * (x w3))`` on rows grouped by expert.
With torch's grouped GEMM that is two grouped GEMMs writing ``h1`` and ``h3`` ``[rows, ffn]``,
an elementwise pass reading both and writing the activation, then the down GEMM. Here the gate
and up products of a tile are accumulated side by side in one mainloop (one load of each ``x``
tile for both) and the tile leaves as ``silu(acc1) * acc3``: ``h1`` and ``h3`` never reach memory.
On one H200 (torch 2.11, Triton 3.6, bf16, uneven expert sizes; a scratch probe, 2026-12-01, not
kept) the gate/up/activation part took 0.70-0.97x the time of torch's two grouped GEMMs and the
elementwise pass (qwen3-30b-like 614 against 778 us, top-1 h4096 f1024 385 against 549, top-2
h4096 f512 412 against 521, DeepSeek-V3-like 3276 against 3371). The whole experts forward, down
GEMM included: 0.75-0.96x in bf16 (``bench/results/gpu_h200_experts.json``).

The kernel is persistent: ``sms`` programs walk the tiles of every expert in turn, so the grid
is whatever the caller leaves free (torch's SM carveout, ``sm_carveout`` below, is honoured the
way cuBLASLt and torch's grouped GEMM honour it). Expert ``e``'s rows end at
``ends[e]`` (int32, on the device: nothing waits for the host). A tile that runs past its
expert's rows loads the next expert's rows but stores only its own. Loads go through TMA
descriptors; stores are masked.

Segments and gathered rows. ``grouped_mm_segments`` and ``grouped_swiglu_segments`` take each
expert's rows from a start and a count, so that one call can cover part of each expert's rows
(one source rank's, say) and leave the rest of the output for another call. With an ``index``
they read row ``index[i]`` of a table instead of row i: a tile's rows are plain loads, pipelined
by Triton, instead of one TMA box. On one H200 (bf16, uneven expert sizes, each row a random row
of a table as large as the result; scratch probe, 2026-12-01, not kept) the fused gate/up kernel
reading gathered rows took 1.02-1.11x its time on rows gathered beforehand, and 0.82-0.92x the
time of ``index_select`` followed by it (qwen3-30b-like 665 us against 642 and 780, top-2 h4096
f512 426 against 387 and 522, top-1 h4096 f1024 444 against 434 and 506, Qwen3-like 1309 against
1179 and 1419).

Only what was measured is offered: bf16 and fp16, ``K`` a multiple of the K tile, rows of 16-byte
multiples, 16-byte aligned operands (``supported``). Elsewhere callers use torch's grouped GEMM.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from collectives.errors import InvalidArgumentError

from .. import _kernel_tuning

__all__ = ["supported", "gpu_bound", "few_rows", "grouped_mm", "grouped_swiglu", "grouped_mm_segments",
           "grouped_swiglu_segments", "grouped_mm_padded", "grouped_swiglu_padded", "sm_carveout"]

_BK = 64
# (BM, BN, warps, stages), measured on one H200 (scratch probe, 2026-12-01): 128x256 was the best
# of four for the plain GEMM, 128x128 of four for the fused one (two accumulators per tile)
_PLAIN = (128, 256, 8, 3)
_FUSED = (128, 128, 8, 3)
_DTYPES = (torch.bfloat16, torch.float16)


def supported(x: torch.Tensor, *weights: torch.Tensor) -> str:
    """Why these operands cannot take the Triton kernels, or ``""``."""
    if not x.is_cuda:
        return f"the operands are on {x.device.type}"
    if x.dtype not in _DTYPES:
        return f"it runs {[str(d) for d in _DTYPES]}, not {x.dtype}"
    for name, k in (("x", x.shape[-1]), *((f"weight {i}", w.shape[-2]) for i, w in enumerate(weights))):
        if k % _BK:
            return f"K = {k} ({name}) is not a multiple of {_BK}"
    for t in (x, *weights):
        if t.dtype != x.dtype or not t.is_contiguous() or t.data_ptr() % 16 or t.shape[-1] * t.element_size() % 16:
            return "an operand is not contiguous, 16-byte aligned, of x's dtype, with rows of whole 16 bytes"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return ""


# Measured on one H200 host, 2026-12-01 (scratch probes, not kept, then launch/bench_experts.py):
# a launch of the fused kernel costs the host about as much as torch's two grouped GEMMs and the
# elementwise pass together (59 against 58 us), but a whole experts call with it cost more: 186
# against 137 us at 1024 rows of a Qwen3-30B-like layer (16 experts of 2048 x 768), whose
# products take the GPU about 70 us. Such a call is bound by its host, and with the fused kernel
# it took 1.45x as long; a DeepSeek-V3-like decode (1024 rows, 32 experts of 7168 x 2048, about
# 470 us of weights to read) took 0.83x. So the fused kernel runs only where the gate and up
# products should keep the GPU busy longer than a call costs the host.
_GPU_BOUND_S = 150e-6
_HBM_BYTES_PER_S = 4.0e12  # H200: 4.8 TB/s peak
_TENSOR_FLOPS = 6.0e14  # bf16 dense: what torch's GEMMs reach on H200, about 0.6 of peak


def gpu_bound(rows: int, experts: int, hidden: int, ffn: int, element_size: int) -> bool:
    """Whether the gate and up products of ``rows`` rows over ``experts`` experts should take the
    GPU at least ``_GPU_BOUND_S``: reading both weight stacks, or their multiply-adds."""
    reading = 2 * experts * hidden * ffn * element_size / _HBM_BYTES_PER_S
    computing = 4 * rows * hidden * ffn / _TENSOR_FLOPS
    return max(reading, computing) >= _GPU_BOUND_S


# Torch's grouped GEMM takes a small-tile kernel at up to 128 rows per group. There, at a
# DeepSeek-V3-like decode's down product (32 experts of 2048 x 7168, 32 rows each on average),
# this module's plain kernel took 0.75-0.79x its time, reading the weights near the memory's
# speed; at 1024-4096 rows per expert it took 1.04-1.21x (one H200, scratch probe, 2026-12-01,
# not kept). So the down product is ours only at few rows per expert.
_FEW_ROWS = 128


def few_rows(rows: int, experts: int) -> bool:
    """Whether ``rows`` spread over ``experts`` are few enough per expert that this module's plain
    grouped GEMM should beat torch's (``_FEW_ROWS`` on average)."""
    return rows <= _FEW_ROWS * experts


def _kernel() -> Any:
    """The jitted kernel, from its own module (imported on first use: importing this one needs no
    Triton and compiles nothing)."""
    from . import _grouped_gemm_triton  # deferred: Triton is optional and compiles on import

    return _grouped_gemm_triton.gmm


@contextlib.contextmanager
def sm_carveout(sms: int | None) -> Iterator[None]:
    """Within: torch's persistent GEMMs (cuBLASLt, torch's grouped GEMM) and this module's kernel
    launch for all SMs but ``sms`` (``torch._C._set_sm_carveout_experimental``), so that kernels
    beside them on another stream find SMs free; the previous setting comes back after. Nothing
    where ``sms`` is 0 or None, or where this torch has no such setting."""
    set_ = getattr(torch._C, "_set_sm_carveout_experimental", None)
    get = getattr(torch._C, "_get_sm_carveout_experimental", None)
    if not sms or set_ is None or get is None:
        yield
        return
    before = get()
    with warnings.catch_warnings():  # torch warns once that the setting is experimental
        warnings.filterwarnings("ignore", message=".*SM carveout.*")
        set_(sms)
    try:
        yield
    finally:
        set_(before)


_SM_COUNT: dict[int, int] = {}


def _sms(device: torch.device, sms: int | None) -> int:
    """The persistent grid: ``sms``, else every SM but torch's carveout."""
    if sms is not None:
        return sms
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(index)
    if n is None:
        n = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    get = getattr(torch._C, "_get_sm_carveout_experimental", None)
    carve = get() if get is not None else None
    return max(1, n - (carve or 0))


def _launch(x: torch.Tensor, w: torch.Tensor, w3: torch.Tensor | None, ends: torch.Tensor, out: torch.Tensor,
            cfg: tuple[int, int, int, int], sms: int | None, cap: int = 0, starts: torch.Tensor | None = None,
            index: torch.Tensor | None = None) -> torch.Tensor:
    from triton.tools.tensor_descriptor import TensorDescriptor  # deferred: Triton is optional

    bm, bn, warps, stages = cfg
    e, k, n = w.shape
    a = TensorDescriptor.from_tensor(x, [bm, _BK])
    b = TensorDescriptor.from_tensor(w.view(e * k, n), [_BK, bn])
    b3 = TensorDescriptor.from_tensor(w3.view(e * k, n), [_BK, bn]) if w3 is not None else b
    if out.shape[0] and x.shape[0]:
        grid = _sms(x.device, sms)
        with torch.cuda.device(x.device):  # Triton launches on the current device and its stream
            _kernel()[(grid,)](a, x, index if index is not None else ends, x.stride(0), b, b3, out, ends,
                               starts if starts is not None else ends, n, k, out.stride(0), E=e, CAP=cap,
                               SEG=starts is not None, GATHER=index is not None, BM=bm, BN=bn, BK=_BK, SMS=grid,
                               SWIGLU=w3 is not None, num_warps=warps, num_stages=stages)
    return out


def _tuned(kernel: str, x: torch.Tensor, w: torch.Tensor, default: tuple[int, int, int, int]
           ) -> tuple[int, int, int, int]:
    """``kernel``'s configuration for these operands: the kernel table's entry, else ``default``
    (``overlap/_kernel_tuning.py``)."""
    e, k, n = w.shape
    return _kernel_tuning.pick(kernel, x.shape[0], e, n, k, str(x.dtype).removeprefix("torch."), x.device,
                               default)  # type: ignore[return-value]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, *, sms: int | None = None,
               config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``[rows, N]``: each expert's rows of ``x [rows, K]`` times its ``w[e] [K, N]``; expert e's
    rows end at ``ends[e]`` (int32, on ``x``'s device, the last equal to ``rows``). On
    ``sms`` SMs (default: all but torch's SM carveout); ``config`` (BM, BN, warps, stages), else
    the kernel table's or the default. Check ``supported`` first."""
    cfg = config or _tuned("gmm", x, w, _PLAIN)
    return _launch(x, w, None, ends, x.new_empty((x.shape[0], w.shape[2])), cfg, sms)


def grouped_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, ends: torch.Tensor, *,
                   sms: int | None = None, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``[rows, ffn]``: ``silu(x w1[e]) * (x w3[e])`` for each expert's rows, the two products
    accumulated in float32 side by side and rounded once. Otherwise as :func:`grouped_mm`."""
    cfg = config or _tuned("gmm_swiglu", x, w1, _FUSED)
    return _launch(x, w1, w3, ends, x.new_empty((x.shape[0], w1.shape[2])), cfg, sms)


def _check_segments(out: torch.Tensor, n: int, starts: torch.Tensor, counts: torch.Tensor,
                    index: torch.Tensor | None) -> None:
    if out.dim() != 2 or out.shape[1] != n or not out.is_contiguous():
        raise InvalidArgumentError("out", out, f"is not a contiguous [rows, {n}]", f"pass a contiguous [rows, {n}]")
    for name, t in (("starts", starts), ("counts", counts)):
        if t.dtype != torch.int32 or t.device != out.device:
            raise InvalidArgumentError(name, t, f"is {t.dtype} on {t.device}", f"pass int32 on {out.device}")
    if index is not None and (index.dtype != torch.int32 or index.shape != (out.shape[0],)):
        raise InvalidArgumentError("index", index, f"is not int32 [{out.shape[0]}] (one entry per row of out)",
                                   f"pass int32 [{out.shape[0]}] on {out.device}")


def grouped_mm_segments(x: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                        out: torch.Tensor, *, index: torch.Tensor | None = None, sms: int | None = None
                        ) -> torch.Tensor:
    """Rows ``starts[e] .. starts[e] + counts[e]`` of ``out`` (int32, on the device) = those rows of
    ``x`` times ``w[e]``; with ``index`` (int32, one per row of ``out``), row i reads row
    ``index[i]`` of ``x`` instead (a table of any length). Rows of ``out`` outside the segments are
    not written; the segments must not overlap. Returns ``out``. Check ``supported`` first."""
    _check_segments(out, w.shape[2], starts, counts, index)
    return _launch(x, w, None, counts, out, _PLAIN, sms, starts=starts, index=index)


def grouped_swiglu_segments(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, starts: torch.Tensor,
                            counts: torch.Tensor, out: torch.Tensor, *, index: torch.Tensor | None = None,
                            sms: int | None = None) -> torch.Tensor:
    """:func:`grouped_swiglu` on the segments of :func:`grouped_mm_segments`."""
    _check_segments(out, w1.shape[2], starts, counts, index)
    return _launch(x, w1, w3, counts, out, _FUSED, sms, starts=starts, index=index)


def grouped_mm_padded(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, *, sms: int | None = None
                      ) -> torch.Tensor:
    """``[E, cap, N]`` from ``x [E, cap, K]``: block e's first ``counts[e]`` rows times ``w[e]``
    (``counts`` ``[E]`` int64 on the device, at most ``cap`` each); the rows after them are left
    as they were allocated (undefined). Nothing depends on the host: a CUDA graph can hold it."""
    E, cap, k = x.shape
    out = x.new_empty((E, cap, w.shape[2]))
    _launch(x.view(E * cap, k), w, None, counts, out.view(E * cap, -1), _PLAIN, sms, cap)
    return out


def grouped_swiglu_padded(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, counts: torch.Tensor, *,
                          sms: int | None = None) -> torch.Tensor:
    """:func:`grouped_swiglu` over the padded blocks of :func:`grouped_mm_padded`."""
    E, cap, k = x.shape
    out = x.new_empty((E, cap, w1.shape[2]))
    _launch(x.view(E * cap, k), w1, w3, counts, out.view(E * cap, -1), _FUSED, sms, cap)
    return out
