"""The tile-signalled GEMM's bookkeeping and refusals on CPU (the kernels run in
``tests/test_gpu_tile_gemm.py`` and ``tests/test_gpu_tile_signal.py``)."""

from __future__ import annotations

import pytest
import torch

from collectives.errors import InvalidArgumentError
from overlap import _tile_gemm as T
from overlap import _tile_signal
from overlap.strategies import REGISTRY


def test_group_tile_counts() -> None:
    # 1000 rows in groups of 384: 384, 384, 232 rows -> 3, 3, 2 row tiles of 128; 776 columns -> 4 tiles of 256
    assert T.tiles(1000, 776, 384) == [12, 12, 8]
    assert T.tiles(128, 256, 128) == [1]
    assert T.tiles(129, 257, 128) == [2, 2]
    assert T.tiles(1000, 776, 384, bn=128) == [21, 21, 14]


def test_refusals_name_the_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="group_rows"):
        T.tiles(256, 64, 100)
    a, b = torch.randn(256, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="cannot take the tile-signalled GEMM"):
        T.tile_mm(a, b)
    assert "cpu" in T.supported(a, b)


def test_strategy_says_why_it_cannot_run_on_cpu() -> None:
    why = REGISTRY["tile_signal"].unavailable(None, torch.device("cpu"), torch.bfloat16)  # type: ignore[arg-type]
    assert "cpu" in why
    assert "float32" in _tile_signal.unavailable(None, torch.device("cuda", 0), torch.float32)


def test_blocks_must_be_whole_tiles() -> None:
    assert _tile_signal.fits(256, 2) and _tile_signal.fits(384, 3) and _tile_signal.fits(128, 1)
    assert not _tile_signal.fits(384, 2) and not _tile_signal.fits(0, 2) and not _tile_signal.fits(200, 1)
