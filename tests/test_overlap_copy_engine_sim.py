"""The copy-engine overlap strategy's bookkeeping, on CPU: slot offsets, ring slots and their
reuse, row blocks, chunk splits and flag values, with every rank a thread and a stand-in for
``PeerMemory`` (``tests/_fake_peer.py``).

What this cannot show is the GPU's side: the copy engines, kernels and memory ordering
(``tests/gpu_overlap_check.py`` on the GPUs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from overlap import _copy_engine as CE

from ._fake_peer import run_ranks, use_fake_streams


@pytest.fixture
def fake_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_streams(monkeypatch)


def _data(seed: int, world: int, m: int, k: int, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, k, generator=g, dtype=torch.float64) for _ in range(world)], \
        torch.randn(k, n, generator=g, dtype=torch.float64)


# (world, rows, chunks): odd sizes, empty chunks, a rank with an empty block (all-reduce)
CASES = [(2, 6, 1), (2, 7, 3), (3, 9, 2), (3, 5, 4), (4, 3, 2), (2, 1, 3), (8, 5, 2)]  # 8: MAX_RANKS


@pytest.mark.parametrize("world,rows,chunks", CASES)
def test_all_gather_gemm(fake_streams: None, world: int, rows: int, chunks: int) -> None:
    shards, b = _data(1, world, rows, 5, 4)
    got = run_ranks(world, 1 << 20, lambda pm, r: CE.all_gather_gemm(pm, shards[r], b, chunks, keep_gathered=True))
    want = torch.cat(shards) @ b
    for out, full in got:
        assert torch.allclose(out, want, atol=1e-12)
        assert torch.equal(full.view(-1, 5), torch.cat(shards))


@pytest.mark.parametrize("world,rows,chunks", CASES)
def test_gemm_reduce_scatter(fake_streams: None, world: int, rows: int, chunks: int) -> None:
    parts, b = _data(2, world, rows * world, 6, 3)
    got = run_ranks(world, 1 << 20, lambda pm, r: CE.gemm_reduce_scatter(pm, parts[r], b, chunks))
    total = sum(p @ b for p in parts)
    for r, out in enumerate(got):
        assert torch.allclose(out, total[r * rows:(r + 1) * rows], atol=1e-12), r


@pytest.mark.parametrize("world,rows,chunks", CASES + [(3, 7, 2), (4, 2, 1)])
def test_gemm_all_reduce(fake_streams: None, world: int, rows: int, chunks: int) -> None:
    parts, b = _data(3, world, rows, 4, 5)  # rows need not divide by world
    got = run_ranks(world, 1 << 20, lambda pm, r: CE.gemm_all_reduce(pm, parts[r], b, chunks))
    total = sum(p @ b for p in parts)
    for out in got:
        assert torch.allclose(out, total, atol=1e-12)
    assert all(torch.equal(out, got[0]) for out in got)  # every rank holds the same bits


# a peer buffer so small that the ring holds 2 or 3 slots: chunks reuse slots within the call
@pytest.mark.parametrize("world,rows,chunks", [(2, 12, 6), (3, 10, 5), (2, 9, 9)])
def test_ring_slots_reused_within_a_call(fake_streams: None, world: int, rows: int, chunks: int) -> None:
    small = 3 * 256 * world  # bytes: 3 ring slots of 256-byte regions (up to 4 rows of 8 float64)
    shards, b = _data(5, world, rows, 8, 8)
    got = run_ranks(world, small, lambda pm, r: CE.all_gather_gemm(pm, shards[r], b, chunks, keep_gathered=False))
    want = torch.cat(shards) @ b
    assert all(torch.allclose(out, want, atol=1e-12) for out, _ in got)
    parts, b = _data(6, world, rows * world, 8, 8)
    got = run_ranks(world, small, lambda pm, r: CE.gemm_reduce_scatter(pm, parts[r], b, chunks))
    total = sum(p @ b for p in parts)
    assert all(torch.allclose(out, total[r * rows:(r + 1) * rows], atol=1e-12) for r, out in enumerate(got))
    got = run_ranks(world, 2 * small, lambda pm, r: CE.gemm_all_reduce(pm, parts[r][:rows], b, chunks))
    total = sum(p[:rows] @ b for p in parts)
    assert all(torch.allclose(out, total, atol=1e-12) for out in got)


def test_back_to_back_calls_reuse_the_flags(fake_streams: None) -> None:
    parts, b = _data(4, 2, 8, 4, 4)

    def calls(pm: Any, r: int) -> list[torch.Tensor]:
        return [CE.gemm_all_reduce(pm, parts[r] * (i + 1), b, 2) for i in range(3)]

    got = run_ranks(2, 1 << 20, calls)
    total = sum(p @ b for p in parts)
    for outs in got:
        for i, out in enumerate(outs):
            assert torch.allclose(out, (i + 1) * total, atol=1e-12)


def test_chunks_grow_to_fit_the_peer_buffer() -> None:
    # 1000 rows of 64 float64 (512 B) on 2 ranks in a 64 KiB buffer: two ring slots of two
    # regions hold 32 rows each, so at least 32 chunks
    assert CE._enough(2, 1000, 64, 8, 2, 64 << 10) == 32
    assert CE._enough(40, 1000, 64, 8, 2, 64 << 10) == 40
    with pytest.raises(CE.UnsupportedError, match="COMMOPS_PEER_BYTES"):
        CE._enough(1, 10, 1 << 20, 8, 2, 64 << 10)
