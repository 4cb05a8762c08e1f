"""The layout constants that the host code and ``collectives/peer/kernels.cu`` each spell out
agree: a tile, a header or a flag area sized differently on the two sides would make the kernels
read and write past what the host allocated, on GPUs only, where nothing in this suite runs."""

from __future__ import annotations

import re
from pathlib import Path

from collectives.peer import memory as M
from overlap import _moe_peer as P

KERNELS = Path(M.__file__).with_name("kernels.cu").read_text()


def _define(name: str) -> int:
    found = re.findall(rf"^#define {name} (\d+)\s*$", KERNELS, flags=re.M)
    assert len(found) == 1, f"#define {name} appears {len(found)} times in kernels.cu"
    return int(found[0])


def test_the_host_and_the_kernels_agree_on_the_shared_constants() -> None:
    pairs = {
        "MAX_RANKS": M.MAX_RANKS, "MAX_BLOCKS": M.MAX_BLOCKS, "N_STAGES": M.N_STAGES,
        "CE_RING": M.CE_RING, "CE_STAGES": M.CE_STAGES, "CE_PUSHED": M.CE_PUSHED, "CE_REDUCED": M.CE_REDUCED,
        "CE_PULLED": M.CE_PULLED, "IDS_HEADER": P.IDS_HEADER, "LAYOUT_TILE": P.LAYOUT_TILE, "MAX_BASE": P.MAX_BASE,
    }
    differ = {name: (host, _define(name)) for name, host in pairs.items() if _define(name) != host}
    assert not differ, f"host value, kernels.cu value: {differ}"
    # the row kernels' blocks: 512 threads on both sides
    assert P._THREADS == 512 and "__launch_bounds__(512) rows_layout" in KERNELS
