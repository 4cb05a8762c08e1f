"""The layout constants that the host code and the peer-memory kernels each spell out agree: a
tile, a header or a flag area sized differently on the two sides would make the kernels read and
write past what the host allocated, on GPUs only, where nothing in this suite runs. The kernels'
side is every text a module compiles: the common header ``collectives/peer/peer.cuh``, the
collectives' ``kernels.cu``, the MoE row kernels' ``overlap/moe/rows.cu`` and the fused
all-reduce + RMSNorm's ``overlap/norm.cu``."""

from __future__ import annotations

import re
from pathlib import Path

from collectives.peer import _launch
from collectives.peer import copy_engines as CE, memory as M
from overlap.moe import peer_kernels as K
from overlap import norm as N
from overlap.moe import peer_plan as P

ROWS = K.ROWS_SOURCE
SOURCES = {path.name: path.read_text() for path in (*_launch.sources_of(), ROWS, N.SOURCE)}
KERNELS = "\n".join(SOURCES.values())


def _define(name: str) -> int:
    found = re.findall(rf"^#define {name} (\d+)\s*$", KERNELS, flags=re.M)
    assert len(found) == 1, f"#define {name} appears {len(found)} times in {', '.join(SOURCES)}"
    return int(found[0])


def test_the_host_and_the_kernels_agree_on_the_shared_constants() -> None:
    pairs = {
        "MAX_RANKS": M.MAX_RANKS, "MAX_BLOCKS": M.MAX_BLOCKS, "N_STAGES": M.N_STAGES,
        "CE_RING": CE.CE_RING, "CE_STAGES": CE.CE_STAGES, "CE_PUSHED": CE.CE_PUSHED, "CE_REDUCED": CE.CE_REDUCED,
        "CE_PULLED": CE.CE_PULLED, "IDS_HEADER": P.IDS_HEADER, "LAYOUT_TILE": K.LAYOUT_TILE, "MAX_BASE": P.MAX_BASE,
    }
    differ = {name: (host, _define(name)) for name, host in pairs.items() if _define(name) != host}
    assert not differ, f"host value, kernels' value: {differ}"
    # the row kernels' blocks: 512 threads on both sides
    assert K._THREADS == 512 and "__launch_bounds__(512) rows_layout" in SOURCES[ROWS.name]


def test_each_kernel_is_defined_in_one_source_and_the_rows_in_their_own() -> None:
    # a module is the header and one source: an entry point in two sources, or a row kernel left
    # in kernels.cu, would be compiled twice or looked up in the wrong module
    entry = re.compile(r'extern "C" __global__ void[\s\\]+(?:__launch_bounds__\(\d+\)[\s\\]+)?(\w+)')
    header, kernels, rows, norm = (set(entry.findall(text)) for text in SOURCES.values())
    assert not header, f"entry points in peer.cuh: {sorted(header)}"
    assert {"ce_fence", "ce_wait", "ce_wait_from"} <= kernels and not kernels & rows and not (kernels | rows) & norm
    assert rows and all(name.startswith("rows_") for name in rows), sorted(rows)
    assert not any(name.startswith("rows_") for name in kernels)
    # the norm's entry points are pasted per dtype (NAME_##TAG##_vec): their stems
    assert norm == {"ar_rmsnorm_", "ar_rmsnorm_ll_", "add_rmsnorm_"}, sorted(norm)
