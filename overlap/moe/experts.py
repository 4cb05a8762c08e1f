"""The local experts: ``GroupedSwiGLU``, the SwiGLU MLPs of one rank's experts on rows grouped by expert.

Design note. ``MoEDispatcher.dispatch`` hands the experts their rows grouped by local expert
(``recv_x``, ``tokens_per_expert``); the experts' three products then are grouped GEMMs. Where
torch's grouped GEMM runs (``torch._grouped_mm``) each product is one launch for every expert;
a loop of one GEMM per expert, the fallback, costs the host ~3 launches per expert. Without
autograd on CUDA the gate and up products and the activation run as one Triton kernel
(``_grouped_gemm.py``) where the call keeps the GPU busier than its host; the measured cases are
in that module's design note and in ``bench/results/gpu_h200_experts.json``. The row offsets go
to the GPU from a ring of pinned buffers (``_PinnedSlots``) that the host never waits for.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from collectives.errors import InvalidArgumentError

from . import _fp8_gemm, _grouped_gemm
from .fp8 import packed_width

__all__ = ["GroupedSwiGLU", "grouped_mm_works"]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the grouped GEMM's backward needs
    one; ``y.sum().backward()`` gives an expanded one)."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor) -> torch.Tensor:
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}
_FUSED_WARNED: list[str] = []  # the reason the fused experts kernel could not run, once warned


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch runs ``torch._grouped_mm`` for ``dtype`` on ``device``'s type (tried
    once on a tiny case; where it does not, the experts run one GEMM each, and a warning says so
    once)."""
    if device.type == "cuda" and dtype != torch.bfloat16:
        return False  # bf16 is what the grouped kernel is for; fp32 keeps the exact per-expert GEMMs (not checked on GPUs)
    key = (device.type, dtype)
    ok = _GROUPED_OK.get(key)
    if ok is None:
        fn = getattr(torch, "_grouped_mm", None)
        ok = False
        if fn is not None and dtype in (torch.bfloat16, torch.float32):
            try:
                a = torch.ones(4, 8, dtype=dtype, device=device)
                b = torch.ones(2, 8, 8, dtype=dtype, device=device)
                got = fn(a, b, offs=torch.tensor([1, 4], dtype=torch.int32, device=device))
                ok = bool((got == 8).all())
            except (RuntimeError, NotImplementedError):
                ok = False
        if not ok and fn is not None and dtype in (torch.bfloat16, torch.float32):
            warnings.warn(f"torch._grouped_mm does not run {dtype} on {device.type} with torch {torch.__version__}: "
                          "GroupedSwiGLU runs one GEMM per expert", RuntimeWarning, stacklevel=3)
        _GROUPED_OK[key] = ok
    return ok


class _PinnedSlots:
    """Small int32 vectors sent to a GPU from a ring of pinned host buffers, without waiting.

    ``pin_memory()`` on every call would reuse a pinned block only once the GPU has done the copy
    that last used it; while the GPU runs behind the host (a pipeline's queued work), every call
    then allocates pinned memory anew, about 250 us of host time on the 2xH200 machine against
    27-41 us with the GPU idle (scratch probe, 2026-11-30). Here a slot is written again once the
    event recorded after its copy has fired; the host has to be ``slots`` calls ahead of the GPU
    before a call falls back to ``pin_memory()``.
    """

    def __init__(self, slots: int = 64) -> None:
        self._slots: list[tuple[torch.Tensor, torch.cuda.Event] | None] = [None] * slots
        self._next = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> _PinnedSlots:
        return _PinnedSlots(len(self._slots))  # scratch: a copy of a module starts with its own

    def __getstate__(self) -> dict[str, Any]:
        return {"_slots": [None] * len(self._slots), "_next": 0}

    def send(self, values: np.ndarray, device: torch.device) -> torch.Tensor:
        """``values`` (int32) on ``device``, copied on its current stream; the host does not wait."""
        i = self._next
        self._next = (i + 1) % len(self._slots)
        slot, n = self._slots[i], values.size
        if slot is not None and not slot[1].query():  # the GPU has not copied out of it yet
            return torch.from_numpy(values).pin_memory().to(device, non_blocking=True)
        buf = slot[0] if slot is not None and slot[0].numel() >= n else \
            torch.empty(max(n, 64), dtype=torch.int32, pin_memory=True)
        buf.numpy()[:n] = values
        out = buf[:n].to(device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        self._slots[i] = (buf, done)
        return out


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place update counter (-1 for an inference tensor, which keeps none: it cannot be
    updated in place outside inference mode either)."""
    try:
        return int(t._version)
    except RuntimeError:
        return -1


class GroupedSwiGLU(nn.Module):
    """The local experts' SwiGLU MLPs, ``w2(silu(x w1) * (x w3))``, on rows grouped by expert
    (the layout ``MoEDispatcher.dispatch`` returns).

    Where torch's grouped GEMM runs (``torch._grouped_mm``: bf16 on CUDA, bf16 or fp32 on CPU,
    widths in 16-byte multiples), each of the three products is one launch for every expert;
    elsewhere one GEMM per expert. A per-expert loop costs the host ~3 launches per expert, which at 32 experts
    per rank is a hundred small launches per call.

    Without autograd on CUDA (inference), ``fused`` (the default) computes the gate and up
    products and the activation in one Triton kernel (``overlap/moe/_grouped_gemm.py``) wherever the
    call keeps the GPU busier than its host (``_grouped_gemm.gpu_bound``; a decode step of small
    experts does not): ``x w1`` and ``x w3`` are accumulated in float32 side by side and never
    stored, so the result is rounded once where torch's path rounds ``h1``, ``h3`` and their
    product; at few rows per expert (``_grouped_gemm.few_rows``: a decode step) the down product
    runs in Triton too. Where that kernel cannot run (no Triton, widths it was not measured
    for), a warning says why, once, and torch's grouped GEMMs run; ``fused=False`` keeps them
    without a word. Where torch has no grouped GEMM for the rows (fp16 on CUDA), both grouped
    products run in Triton instead of one GEMM per expert. With autograd, torch's path runs.
    ``last_path`` records (which, why) for the last call.
    """

    def __init__(self, num_local_experts: int, hidden: int, ffn_hidden: int, *, dtype: torch.dtype | None = None,
                 device: Any = None, fused: bool = True, fp8: bool = False) -> None:
        super().__init__()
        if fp8 and (hidden % _fp8_gemm.BLOCK or ffn_hidden % _fp8_gemm.BLOCK):
            raise InvalidArgumentError("fp8", fp8, f"needs hidden ({hidden}) and ffn_hidden ({ffn_hidden}) in whole "
                                       f"blocks of {_fp8_gemm.BLOCK} (one scale per 128 x 128 weight block)",
                                       "pad them, or fp8=False")
        self.fused, self.fp8 = fused, fp8
        self._fp8_cache: tuple[Any, ...] | None = None
        self.last_path: tuple[str, str] | None = None
        self.w1 = nn.Parameter(torch.empty(num_local_experts, hidden, ffn_hidden, dtype=dtype, device=device))
        self.w3 = nn.Parameter(torch.empty(num_local_experts, hidden, ffn_hidden, dtype=dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, ffn_hidden, hidden, dtype=dtype, device=device))
        for p in (self.w1, self.w3):
            nn.init.normal_(p, std=hidden ** -0.5)
        nn.init.normal_(self.w2, std=ffn_hidden ** -0.5)
        self._offsets = _PinnedSlots()  # the experts' row offsets, sent to the GPU every call

    def _grouped(self, x: torch.Tensor) -> bool:
        hidden, ffn = self.w1.shape[1], self.w1.shape[2]
        es = x.element_size()
        return (x.dtype == self.w1.dtype and x.is_contiguous() and hidden * es % 16 == 0 and ffn * es % 16 == 0
                and grouped_mm_works(x.device, x.dtype))

    def _path(self, x: torch.Tensor, padded: bool = False) -> tuple[str, str]:
        """Which path runs these rows (``padded``: ``forward_padded``'s blocks), and why
        (a warning, once, where the fused kernel was asked for but cannot take the operands)."""
        if not self.fused:
            return "torch", "fused=False"
        if not x.is_cuda:
            return "torch", f"the fused kernel runs on CUDA; the rows are on {x.device.type}"
        if torch.is_grad_enabled():
            return "torch", "autograd is on (the fused kernel keeps no h1, h3 for a backward pass)"
        experts, hidden, ffn = self.w1.shape
        # the padded blocks are for CUDA graphs, where the host's cost does not count: the same
        # kernels eagerly and captured (a warm-up then compiles what the capture runs)
        if not padded and not _grouped_gemm.gpu_bound(x.shape[0], experts, hidden, ffn, x.element_size()):
            return "torch", "a call this small is bound by its host, where the fused kernel's launch costs more"
        why = _grouped_gemm.supported(x, self.w1, self.w3, *((self.w2,) if padded else ()))
        if why:
            if not _FUSED_WARNED:
                _FUSED_WARNED.append(why)
                warnings.warn(f"GroupedSwiGLU: the fused gate/up kernel cannot run ({why}); torch's grouped GEMMs "
                              "run instead (GroupedSwiGLU(..., fused=False) asks for them)", RuntimeWarning,
                              stacklevel=4)
            return "torch", f"the fused kernel cannot run: {why}"
        if padded:
            return "fused", "inference on CUDA, padded blocks with counts: each block's counted rows only"
        return "fused", "inference on CUDA, GPU-bound: gate, up and activation in one kernel"

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int], *, ends: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``[rows, hidden]`` -> ``[rows, hidden]``; ``tokens_per_expert[e]`` consecutive rows per local expert.

        ``ends`` (optional): ``[E/W]`` int32 on ``x``'s device, the running sum of
        ``tokens_per_expert`` (``DispatchHandle.expert_ends``); given, the grouped GEMMs take it
        instead of a copy of the counts from the host. It must hold those sums (not checked:
        that would wait for the GPU)."""
        if ends is not None and (ends.dtype != torch.int32 or tuple(ends.shape) != (self.w1.shape[0],)
                                 or ends.device != x.device):
            raise InvalidArgumentError("ends", ends, f"is not int32 [{self.w1.shape[0]}] on {x.device}",
                                       "pass DispatchHandle.expert_ends, or leave ends=None")
        if x.shape[0] and self._grouped(x):
            if ends is None:
                rows = np.cumsum(tokens_per_expert, dtype=np.int32)
                # from pinned memory, not waited for: a plain copy would stall the host until the
                # GPU is idle, and the launches after it would then leave the GPU idle in turn
                ends = self._offsets.send(rows, x.device) if x.is_cuda else torch.from_numpy(rows)
            self.last_path = self._path(x)
            if self.last_path[0] == "fused":
                act = _grouped_gemm.grouped_swiglu(x, self.w1, self.w3, ends)
                if _grouped_gemm.few_rows(x.shape[0], self.w1.shape[0]) and not _grouped_gemm.supported(act, self.w2):
                    self.last_path = ("fused", self.last_path[1] + "; few rows per expert: the down product too")
                    return _grouped_gemm.grouped_mm(act, self.w2, ends)
                return torch._grouped_mm(act, self.w2, offs=ends)
            h1 = torch._grouped_mm(x, self.w1, offs=ends)
            h3 = torch._grouped_mm(x, self.w3, offs=ends)
            if not torch.is_grad_enabled():  # no backward to shape: skip two autograd.Function calls
                return torch._grouped_mm(F.silu(h1) * h3, self.w2, offs=ends)
            act = _ContiguousGrad.apply(F.silu(h1) * h3)
            return _ContiguousGrad.apply(torch._grouped_mm(act, self.w2, offs=ends))
        if (x.shape[0] and self.fused and x.is_cuda and not torch.is_grad_enabled()
                and not _grouped_gemm.supported(x, self.w1, self.w3, self.w2)):
            # torch has no grouped GEMM for these rows (fp16 on CUDA): both grouped products in
            # Triton, two launches instead of three per expert
            self.last_path = ("fused", "inference on CUDA, no grouped GEMM of torch's for these rows: both in Triton")
            if ends is None:
                ends = self._offsets.send(np.cumsum(tokens_per_expert, dtype=np.int32), x.device)
            return _grouped_gemm.grouped_mm(_grouped_gemm.grouped_swiglu(x, self.w1, self.w3, ends), self.w2, ends)
        self.last_path = ("torch", "one GEMM per expert (torch's grouped GEMM does not take these rows)")
        outs = []
        for e, rows in enumerate(x.split(list(tokens_per_expert))):
            outs.append((F.silu(rows @ self.w1[e]) * (rows @ self.w3[e])) @ self.w2[e])
        return torch.cat(outs) if outs else x.new_zeros((0, self.w2.shape[-1]))

    def fp8_weights(self) -> tuple[_fp8_gemm.BlockwiseWeight, _fp8_gemm.BlockwiseWeight, _fp8_gemm.BlockwiseWeight]:
        """``w1``, ``w3``, ``w2`` in e4m3 with a scale per 128 x 128 block (``_fp8_gemm.quantize_weight``):
        quantized once, and again only after a parameter changed in place (an optimizer step) or
        moved. Each element within ``max(2**-4 |w|, 2**-10 s)`` of the weight (``s``: its block's scale)."""
        params = (self.w1, self.w3, self.w2)
        key = tuple((_version(p), p.data_ptr()) for p in params)
        if self._fp8_cache is None or self._fp8_cache[0] != key:
            self._fp8_cache = (key, tuple(_fp8_gemm.quantize_weight(p) for p in params))
        return self._fp8_cache[1]  # type: ignore[no-any-return]

    def forward_fp8(self, packed: torch.Tensor, tokens_per_expert: list[int], *, ends: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[rows, hidden]`` in ``dtype`` (default: the weights') from the FP8 dispatch's packed rows
        ``packed [rows, packed_width(hidden)]`` uint8 (e4m3 values, then a float32 scale per 128),
        grouped by expert as :meth:`forward`'s rows, with no dequantization: the gate/up grouped GEMM
        in e4m3 against :meth:`fp8_weights`, float32 accumulation, the SwiGLU quantized again per
        row per 128 columns in its epilogue, then the down GEMM in e4m3 (``_fp8_gemm.py``). On CUDA
        with Triton, two kernels; elsewhere the torch definition (``*_reference``), which the kernels
        match up to the order of float32 additions. Not differentiable itself (``fp8.dispatch_fp8_experts``
        gives the backward); ``last_path`` says which ran."""
        hidden = self.w1.shape[1]
        if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != packed_width(hidden):
            raise InvalidArgumentError("packed", packed, f"is not uint8 [rows, {packed_width(hidden)}] "
                                       "(fp8.quantize_rows' rows)", "pass the FP8 dispatch's rows")
        out_dtype = dtype or self.w1.dtype
        w1, w3, w2 = self.fp8_weights()
        xq, xs = _fp8_gemm.split_rows(packed, hidden)
        why = _fp8_gemm.supported(xq, w1, w3, w2)
        if not why and packed.shape[0]:
            if ends is None:
                ends = self._offsets.send(np.cumsum(tokens_per_expert, dtype=np.int32), packed.device)
            self.last_path = ("fp8", "e4m3 grouped GEMMs in Triton, float32 accumulation")
            hq, hs = _fp8_gemm.grouped_swiglu_fp8(xq, xs, w1, w3, ends)
            return _fp8_gemm.grouped_mm_fp8(hq, hs, w2, ends, out_dtype)
        counts = list(tokens_per_expert)
        self.last_path = ("fp8 reference", f"the torch definition in float32: {why or 'no rows'}")
        hq, hs = _fp8_gemm.grouped_swiglu_fp8_reference(xq, xs, w1, w3, counts)
        return _fp8_gemm.grouped_mm_fp8_reference(hq, hs, w2, counts, out_dtype)

    def forward_padded(self, x: torch.Tensor, tokens_per_expert: torch.Tensor | None = None) -> torch.Tensor:
        """``[E/W, capacity, hidden]`` -> the same shape (the layout of
        ``MoEDispatcher.dispatch_low_latency``; rows past an expert's count give rows nobody reads).

        Without ``tokens_per_expert``: batched GEMMs over every row of every block. With it (the
        low-latency handle's ``[E/W]`` counts, on the device), where the fused kernel runs (as in
        :meth:`forward`, whatever the size: these blocks are for CUDA graphs, where the host's cost
        does not count), only each block's first ``tokens_per_expert[e]`` rows are computed, in
        two Triton kernels (the rest of each block is left undefined). Nothing depends on the
        host either way, so a CUDA graph can hold it."""
        if tokens_per_expert is not None:
            self.last_path = self._path(x, padded=True)
            if self.last_path[0] == "fused":
                act = _grouped_gemm.grouped_swiglu_padded(x, self.w1, self.w3, tokens_per_expert)
                return _grouped_gemm.grouped_mm_padded(act, self.w2, tokens_per_expert)
        else:
            self.last_path = ("torch", "no counts: every row of every block")
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)
