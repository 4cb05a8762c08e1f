"""Launch configurations of the project's Triton kernels: a tuned table first, a cost model else.

Design note. Each kernel has a few launch parameters (the M tile, warps, pipeline stages; for the
row kernels, rows per program and warps) whose best values depend on the shape and the GPU. The
defaults in each kernel's module were picked by hand on one H200 at one shape each. Here one
mechanism serves them all: ``launch/tune_kernels.py`` times candidate configurations per
(kernel, device, dtype, N, K, rows class) on the GPU and writes the winners to a table (JSON);
``COMMOPS_KERNELS_TUNED`` (or :func:`set_kernel_table`) names it, and the ranks of a group agree on
it before their first collective, as on the other tuned tables (``collectives/_agree.py``). A
shape the table has no entry for takes the cost model's pick (:func:`model_pick`): the
configuration whose tiles leave the least padded work per wave of programs over the SMs, the
default breaking ties. Nothing is searched at import or at a call; a table entry applies only
to the device name it was measured on.

The rows class is the power of two nearest the rows per expert (log2, rounded), so that a table
measured at 4096 tokens serves 3000 and 6000; the entry nearest in that class is taken among
those of the same kernel, device, dtype, N, K and expert count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from collectives import _env

__all__ = ["KERNELS_TUNED", "set_kernel_table", "kernel_table", "rows_class", "pick", "model_pick",
           "CANDIDATES", "last_pick"]

KERNELS_TUNED = _env.KERNELS_TUNED

# (BM, warps, stages) candidates of the grouped GEMMs (their N and K tiles are fixed by their scales)
# (BM, warps, stages) candidates of the FP8 grouped GEMMs (their N and K tiles are fixed by their
# scales); (BM, BN, warps, stages) of the bf16/fp16 ones (overlap/moe/_grouped_gemm.py)
CANDIDATES: dict[str, list[tuple[int, ...]]] = {
    "fp8_swiglu": [(64, 4, 3), (64, 4, 4), (128, 8, 3), (128, 8, 4), (64, 8, 4)],
    "fp8_mm": [(64, 4, 4), (64, 4, 5), (128, 8, 4), (128, 8, 3), (128, 4, 4)],
    "gmm": [(128, 256, 8, 3), (128, 128, 8, 3), (64, 128, 4, 4), (128, 256, 8, 4), (64, 256, 4, 3)],
    "gmm_swiglu": [(128, 128, 8, 3), (64, 128, 4, 4), (128, 128, 8, 4), (64, 128, 8, 3)],
}
# kernels whose default was measured at the shapes they serve (their modules' notes): without a
# table entry they keep it rather than the cost model's guess
MEASURED_DEFAULTS = ("gmm", "gmm_swiglu")

# The cost model's fixed cost of one tile, in rows: the weight block it loads per K step is
# BN x BK (128 x 128) against its BM x BK of rows, about half a 128-row tile's traffic. A
# reasoned guess, not a measurement: the table replaces it where it has measured.
TILE_FIXED_ROWS = 64

_STATE: dict[str, Any] = {}
_LAST: dict[str, tuple[tuple[int, ...], str]] = {}


def set_kernel_table(table: Any) -> None:
    """Follow this kernel table (the dict ``launch/tune_kernels.py`` writes, or its path); ``None``
    goes back to ``COMMOPS_KERNELS_TUNED``. Give every rank the same one."""
    if isinstance(table, (str, bytes)) or hasattr(table, "__fspath__"):
        table = json.loads(Path(table).read_text())
    _STATE.clear()
    if table is not None:
        _STATE["table"] = table


def kernel_table() -> Any:
    """The kernel table in use (:func:`set_kernel_table`'s, else ``COMMOPS_KERNELS_TUNED``'s file,
    read once), or None."""
    if "table" not in _STATE:
        path = KERNELS_TUNED.get()
        if not path:
            return None
        set_kernel_table(path)
    return _STATE["table"]


def rows_class(rows: int, experts: int) -> int:
    """log2 of the rows per expert, rounded (0 for a row or fewer)."""
    return max(0, round(math.log2(max(rows / max(experts, 1), 1.0))))


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H100 SXM's, for the model's arithmetic off the GPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def model_pick(kernel: str, rows: int, experts: int, n: int, sms: int, default: tuple[int, ...],
               tile_n: int = 128) -> tuple[tuple[int, ...], str]:
    """The cost model's configuration: of the candidates' M tiles, the one whose work (waves of
    tiles over ``sms`` programs x each tile's padded rows and fixed cost) is least for ``rows``
    spread evenly over ``experts``;
    among configurations of that M tile, ``default`` where it has it, else the first listed."""
    per = rows / max(experts, 1)

    def cost(bm: int) -> float:
        tiles = experts * math.ceil(per / bm) * math.ceil(n / tile_n)
        # a tile also loads its weight block whatever its rows: counted as TILE_FIXED_ROWS rows
        return math.ceil(tiles / sms) * (bm + TILE_FIXED_ROWS)

    cands = CANDIDATES.get(kernel, [default])
    best = min({c[0] for c in cands}, key=lambda bm: (cost(bm), bm != default[0], -bm))
    same = [c for c in cands if c[0] == best]
    chosen = default if default in same else same[0]
    return chosen, (f"cost model: BM={best} leaves the least padded work for {per:.0f} rows per expert over "
                    f"{sms} SMs (no table entry)")


def pick(kernel: str, rows: int, experts: int, n: int, k: int, dtype: str, device: torch.device,
         default: tuple[int, ...]) -> tuple[int, ...]:
    """The configuration ``kernel`` launches with for ``rows`` rows over ``experts`` experts of
    ``k -> n``: the kernel table's entry for this device, dtype, N, K and experts nearest in rows
    class, else :func:`model_pick`. :func:`last_pick` says which and why."""
    table = kernel_table()
    found = None
    if table is not None:
        name, cls = _device_name(device), rows_class(rows, experts)
        same = [e for e in table.get("entries", []) if e["kernel"] == kernel and e["device"] == name
                and e["dtype"] == dtype and e["N"] == n and e["K"] == k and e["experts"] == experts]
        if same:
            e = min(same, key=lambda e: (abs(e["rows_class"] - cls), e["rows_class"]))
            found = (tuple(e["config"]), f"kernel table: measured best at rows class {e['rows_class']} "
                                         f"({e['us']:.1f} us against {e['default_us']:.1f} with the default)")
    if found is None and kernel in MEASURED_DEFAULTS:
        found = (default, "the default, measured by hand on one H200 (no table entry)")
    if found is None:
        found = model_pick(kernel, rows, experts, n, _sm_count(device), default)
    _LAST[kernel] = found
    return found[0]


def last_pick(kernel: str) -> tuple[tuple[int, ...], str] | None:
    """(configuration, why) of ``kernel``'s last launch in this process, or None."""
    return _LAST.get(kernel)
