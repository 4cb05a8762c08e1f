"""A GEMM that says which rows of its result are finished while it runs: one persistent Triton
kernel whose tiles, grouped by rows, each add one to their group's counter in device memory.

Design note. The chunked overlap strategies cut a GEMM into row chunks so that each chunk's
result can travel while the next is computed. On 2xH200 that costs the GEMM itself (each chunk
is a separate cuBLAS call with its own tail and, eagerly, 25-37 us of host time) and leaves the
last chunk's transfer with nothing to hide behind (``bench/results/README.md``, 2026-11-30).
Here the GEMM is one launch and the chunks are only a walk order:

* The tiles (``BM`` x ``BN``) are walked group by group, a group being ``group_rows`` rows
  (whole row tiles) across every column, starting at group ``first`` and wrapping round: a
  reduce-scatter walks the rows bound for its peers first and its own last.
* A finished tile's program waits for its threads' stores (a CTA barrier), then adds one to its
  group's counter with release semantics at system scope. A group is finished when its counter
  reaches ``tiles(group)``; a copy stream holds on that with a stream memory wait
  (``cuStreamWaitValue32``, no SM) and then moves the group's rows by copy engine.
* The counters are reset on the caller's stream before the kernel (``zero_``), so the expected
  values are the same in every call and a CUDA graph replays them unchanged. A wait on them needs
  no bound of its own: the kernel that signals them depends on nothing outside this GPU.

Tile sizes (``CONFIG``) start from ``overlap/moe/_grouped_gemm.py``'s measurement on one H200
(128 x 256, 8 warps, 3 stages, BK 64). ``launch/probe_tile_gemm.py`` times this GEMM against cuBLAS, with and
without the copies beside it, at the tensor-parallel benchmark's shapes.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from collectives.errors import InvalidArgumentError

__all__ = ["TILE_ROWS", "DTYPES", "supported", "tiles", "counters_for", "tile_mm"]

TILE_ROWS = 128  # BM: a group is a whole number of these rows
CONFIG = (256, 8, 3)  # (BN, warps, stages)
_BK = 64
DTYPES = (torch.bfloat16, torch.float16)
_SM_COUNT: dict[int, int] = {}


def supported(a: torch.Tensor, b: torch.Tensor) -> str:
    """Why ``a @ b`` cannot run in this kernel, or ``""``."""
    if not (a.is_cuda and b.is_cuda):
        return f"the operands are on {a.device.type} and {b.device.type}"
    if a.dtype not in DTYPES or b.dtype != a.dtype:
        return f"it multiplies {[str(d) for d in DTYPES]} (both operands one dtype), not {a.dtype} @ {b.dtype}"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or a.shape[1] == 0:
        return f"it multiplies [M, K] by [K, N] with K >= 1, not {tuple(a.shape)} by {tuple(b.shape)}"
    for name, t in (("a", a), ("b", b if b.is_contiguous() else b.t())):
        if not t.is_contiguous() or t.data_ptr() % 16 or t.shape[1] * t.element_size() % 16:
            return (f"{name} is not contiguous (b: nor its transpose) and 16-byte aligned with rows of whole 16 "
                    "bytes (the TMA's rule)")
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return ""


def tiles(m: int, n: int, group_rows: int, bn: int = CONFIG[0]) -> list[int]:
    """How many tiles each group of ``group_rows`` rows of an ``[m, n]`` result has (``bn``
    columns a tile): the value its counter reaches when the group is finished."""
    if group_rows <= 0 or group_rows % TILE_ROWS:
        raise InvalidArgumentError("group_rows", group_rows, f"must be a positive multiple of {TILE_ROWS} (whole "
                                   "row tiles)", f"pass a multiple of {TILE_ROWS}")
    cols = -(-n // bn)
    return [-(-min(group_rows, m - lo) // TILE_ROWS) * cols for lo in range(0, m, group_rows)]


def counters_for(m: int, group_rows: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters, one per group of ``group_rows`` rows of an ``m``-row result."""
    return torch.zeros(max(1, -(-m // group_rows)), dtype=torch.int32, device=device)


def _kernel() -> Any:
    from . import _tile_gemm_triton  # deferred: Triton is optional and compiles on import

    return _tile_gemm_triton.tile_mm


def _sms(index: int) -> int:
    n = _SM_COUNT.get(index)
    if n is None:
        n = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def tile_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *, counters: torch.Tensor | None = None,
            group_rows: int = TILE_ROWS, first: int = 0, sms: int | None = None,
            config: tuple[int, int, int] = CONFIG, meta: torch.Tensor | None = None,
            staging: torch.Tensor | None = None, err: torch.Tensor | None = None,
            flat: bool | None = None) -> torch.Tensor:
    """``a @ b`` into ``out`` (new where None) on the current stream, walking the groups of
    ``group_rows`` rows from group ``first``; with ``counters`` (``counters_for``'s, zeroed by the
    caller before this call on this stream), group g's counter reaches ``tiles(...)[g]`` once its
    rows are written and visible. ``sms``: the persistent grid (default every SM); ``config``:
    (BN, warps, stages), ``CONFIG`` unless measuring another (``tiles`` takes the same BN).

    ``meta`` (int64 ``[groups, 2 + 3 S]``, on the device) places each group instead: its first
    row ``meta[g, 1]`` elements into ``out`` (``meta[g, 0]`` 0) or ``staging`` (1), rows ``n``
    apart; and each of the ``S`` sources adds rows: ``meta[g, 2 + 3 s]`` their address (0:
    none), once the 32-bit flag at ``meta[g, 3 + 3 s]`` reaches ``meta[g, 4 + 3 s]``, a wait that
    gives up when the int32 word ``err`` (required then) is nonzero. Only offsets and the
    sources' fixed addresses are in ``meta``: it is built once per layout and kept.

    ``flat``: Triton's flattened persistent loop (the next tile's loads start during this one's
    epilogue); the default only where nothing signals or waits. On one H200 the flattened loop
    with a tile's barrier and release in it ran 3.4-3.8x cuBLAS's time
    (``bench/results/gpu_h200_tile_gemm.json``), the flattened loop alone 0.91-1.14x."""
    why = supported(a, b)
    if why:
        raise InvalidArgumentError("a", a, f"cannot take the tile-signalled GEMM: {why}", "use torch.mm")
    m, n = a.shape[0], b.shape[1]
    groups = len(tiles(m, n, group_rows)) if m else 1
    if not 0 <= first < groups:
        raise InvalidArgumentError("first", first, f"is not one of the {groups} groups of {group_rows} rows",
                                   f"pass 0 .. {groups - 1}")
    adds = 0
    if meta is not None:
        if meta.dtype != torch.int64 or meta.dim() != 2 or meta.shape[0] < groups or (meta.shape[1] - 2) % 3 \
                or meta.device != a.device or not meta.is_contiguous() or err is None or out is None:
            raise InvalidArgumentError("meta", meta, f"must be a contiguous int64 [{groups}, 2 + 3 S] tensor on "
                                       f"{a.device}, with out and err", "build it as the design note says")
        adds = (meta.shape[1] - 2) // 3
    elif out is None:
        out = a.new_empty((m, n))
    if meta is None and (out.shape != (m, n) or out.dtype != a.dtype or not out.is_contiguous()
                         or out.device != a.device):
        raise InvalidArgumentError("out", out, f"must be a contiguous [{m}, {n}] {a.dtype} tensor on {a.device}",
                                   "pass a new tensor (or None)")
    if counters is not None and (counters.dtype != torch.int32 or counters.numel() < groups
                                 or counters.device != a.device):
        raise InvalidArgumentError("counters", counters, f"must be int32 on {a.device} with at least {groups} "
                                   "elements", "pass counters_for(m, group_rows, device)")
    if m == 0 or n == 0:
        return out  # type: ignore[return-value]
    from triton.tools.tensor_descriptor import TensorDescriptor  # deferred: Triton is optional

    bn, warps, stages = config
    if flat is None:
        flat = meta is None and counters is None
    index = a.get_device()
    grid = sms or _sms(index)
    c = out if out is not None else a
    stage = staging if staging is not None else c
    with torch.cuda.device(index):  # Triton launches on the current device and its stream
        b_t = not b.is_contiguous()  # b's transpose is (supported): a weight [N, K] as stored
        b_desc = TensorDescriptor.from_tensor(b.t(), [bn, _BK]) if b_t else TensorDescriptor.from_tensor(b, [_BK, bn])
        _kernel()[(grid,)](TensorDescriptor.from_tensor(a, [TILE_ROWS, _BK]), b_desc,
                           c, stage, counters if counters is not None else c, meta if meta is not None else c,
                           err if err is not None else c, m, n, a.shape[1], n, first,
                           GROUP_M=group_rows // TILE_ROWS, SIGNAL=counters is not None, META=meta is not None,
                           ADD=adds, BM=TILE_ROWS, BN=bn, BK=_BK, SMS=grid, FLAT=flat, B_T=b_t,
                           num_warps=warps, num_stages=stages)
    return out  # type: ignore[return-value]
