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


def test_a_capture_without_the_shapes_layout_runs_the_sequence() -> None:
    from types import SimpleNamespace

    from overlap import ops
    from overlap.ops import OverlapChoice

    comm = SimpleNamespace(_peer_memory=None, size=2)  # no peer memory, so no layout either
    a, b = torch.randn(256, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
    found = OverlapChoice("gemm_all_reduce", "tile_signal", 4, "the table's entry")
    got = ops._capturable("gemm_all_reduce", comm, a, b, 256, True, found)  # type: ignore[arg-type]
    assert got.strategy == "sequential" and "call the operator once before capturing" in got.reason
    assert not REGISTRY["tile_signal"].ready_for(comm, "gemm_reduce_scatter", a, b, 4)  # type: ignore[arg-type]


def test_auto_runs_the_sequence_where_a_tile_signal_entry_cannot_run() -> None:
    """A table measured tile_signal at M=4096 on CUDA; here (CPU, M=4000) auto must not follow it."""
    from types import SimpleNamespace

    from overlap import ops

    entry = {"op": "gemm_all_reduce", "dtype": "bfloat16", "M": 4096, "K": 8, "N": 8, "graph": False,
             "strategy": "tile_signal", "chunks": 8}
    comm = SimpleNamespace(size=2, _peer_memory=None)
    ops.set_tuned({"meta": {"world": 2}, "entries": [entry]})
    try:
        a, b = torch.randn(4000, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
        got = ops._strategy("gemm_all_reduce", comm, "auto", 1, a, b, 4000)  # type: ignore[arg-type]
        assert got.strategy == "sequential" and "tile_signal cannot take this shape" in got.reason, got
        assert "cpu" in got.reason
    finally:
        ops.set_tuned(None)


def test_the_shape_refusals_are_said_before_anything_is_built() -> None:
    # 2 ranks, 64 MiB of slots: a group of 2048 x 8192 bf16 rows (16384 a rank in 8) needs 2 x 32 MiB,
    # more than the all-reduce's half
    with pytest.raises(Exception, match="COMMOPS_PEER_BYTES"):
        _tile_signal._groups(2, 64 << 20, "ar", 32768, 8192, 2, 8)
    with pytest.raises(Exception, match="whole tiles"):
        _tile_signal._groups(2, 64 << 20, "ar", 4000, 8192, 2, 8)
    with pytest.raises(Exception, match="N = 0"):
        _tile_signal._groups(2, 64 << 20, "rs", 4096, 0, 2, 8)
    # 2048 rows a rank in 8 groups of 256; a group 4 MiB, 8 MiB from both ranks: 4 slots in 32 MiB
    assert _tile_signal._groups(2, 64 << 20, "ar", 4096, 8192, 2, 8) == (8, 256, 256 * 8192 * 2, 4)


def test_a_refused_shape_is_raised_before_the_call_is_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from collectives.errors import UnsupportedError
    from overlap.strategies import tile_signal as strategy

    class Memory:  # what the refusal reads of a PeerMemory
        world, slot_bytes = 2, 64 << 20

    pm = Memory()
    monkeypatch.setattr(strategy, "peer_memory", lambda comm: pm)
    monkeypatch.setattr(T, "supported", lambda a, b: "")  # as on a GPU
    comm = SimpleNamespace(size=2, seq=7)
    a, b = torch.randn(4000, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="whole tiles"):
        REGISTRY["tile_signal"].gemm_all_reduce(comm, a, b, 8)  # type: ignore[arg-type]
    assert comm.seq == 7  # nothing recorded, nothing sent
