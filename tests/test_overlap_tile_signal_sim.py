"""The ``tile_signal`` strategy's bookkeeping on CPU: walk order, group placement, ring slots and
their reuse, flag values, the kernel's waits and the all-gather's copies, with every rank a
thread and its streams and kernel stand-ins (``tests/_fake_tile.py``), in float64.

What this cannot show is the GPU's side: the Triton kernel, the copy engines and memory ordering
(``tests/test_gpu_tile_gemm.py`` and ``tests/gpu_tile_signal_check.py`` on the GPUs).
"""

from __future__ import annotations

import pytest
import torch

from collectives.errors import UnsupportedError
from overlap import _tile_signal as S

from ._fake_tile import run_ranks, use_fake_gpu

ROWS = 128  # a tile's rows: every rank's block is a whole number of them


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_gpu(monkeypatch)


def _data(seed: int, world: int, m: int, k: int, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, k, generator=g, dtype=torch.float64) for _ in range(world)], \
        torch.randn(k, n, generator=g, dtype=torch.float64)


# (world, tiles a block, chunks, slot bytes): one group, several, a ring reused at 2 ranks
# (16 KiB slots: one or two groups' rows at a time), 3 and 4 ranks with room for a block's groups
CASES = [(2, 1, 1, 1 << 20), (2, 4, 4, 1 << 20), (2, 4, 4, 16 << 10), (2, 3, 2, 1 << 20),
         (3, 2, 2, 1 << 20), (3, 4, 4, 1 << 20), (4, 2, 2, 1 << 20)]


@pytest.mark.parametrize("world,tiles,chunks,slot_bytes", CASES)
@pytest.mark.parametrize("op", ["rs", "ar"])
def test_matches_the_sum_of_products(fake_gpu: None, op: str, world: int, tiles: int, chunks: int,
                                     slot_bytes: int) -> None:
    m = tiles * ROWS
    parts, b = _data(world * 10 + tiles, world, world * m, 3, 4)
    run = S.gemm_reduce_scatter if op == "rs" else S.gemm_all_reduce

    def calls(pm: object, r: int) -> list[torch.Tensor]:
        return [run(pm, parts[r] * (1 + call), b, chunks) for call in range(2)]  # a second call: flags from 0

    got = run_ranks(world, slot_bytes, calls)
    total = sum(p @ b for p in parts)
    for r, outs in enumerate(got):
        for call, out in enumerate(outs):
            want = total * (1 + call) if op == "ar" else total[r * m:(r + 1) * m] * (1 + call)
            assert torch.allclose(out, want, atol=1e-10), (r, call)


def test_a_small_ring_is_reused_at_two_ranks(fake_gpu: None) -> None:
    parts, b = _data(5, 2, 2 * 4 * ROWS, 3, 4)
    got = run_ranks(2, 16 << 10, lambda pm, r: (S.gemm_all_reduce(pm, parts[r], b, 4),
                                               next(iter(S._LAYOUTS[pm].values()))))
    for out, lay in got:
        assert lay.ring < lay.per_block, (lay.ring, lay.per_block)
        assert torch.allclose(out, sum(p @ b for p in parts), atol=1e-10)


def test_three_ranks_take_fewer_groups_rather_than_reuse_a_slot(fake_gpu: None) -> None:
    # 16 tiles a block and 16 chunks asked: the all-reduce's half of the ring has 8 slots, so at
    # 3 ranks the call runs 8 groups of 256 rows, every one with a slot of its own
    parts, b = _data(6, 3, 3 * 16 * ROWS, 3, 8)
    got = run_ranks(3, 1 << 20, lambda pm, r: (S.gemm_all_reduce(pm, parts[r], b, 16),
                                              next(iter(S._LAYOUTS[pm].values()))))
    for out, lay in got:
        assert (lay.per_block, lay.group_rows) == (8, 2 * ROWS) and lay.ring >= lay.per_block, lay
        assert torch.allclose(out, sum(p @ b for p in parts), atol=1e-10)


def test_three_ranks_refuse_a_block_the_slots_cannot_hold(fake_gpu: None) -> None:
    parts, b = _data(8, 3, 3 * 4 * ROWS, 3, 8)  # a block's rows: 512 x 64 B from each of 3 ranks

    def call(pm: object, r: int) -> None:
        with pytest.raises(UnsupportedError, match="COMMOPS_PEER_BYTES"):
            S.gemm_all_reduce(pm, parts[r], b, 4)

    run_ranks(3, 48 << 10, call)


def test_refusals_before_anything_is_sent(fake_gpu: None) -> None:
    parts, b = _data(7, 2, 3 * ROWS, 3, 4)  # 384 rows: not whole tiles per rank at 2 ranks

    def call(pm: object, r: int) -> None:
        with pytest.raises(UnsupportedError, match="whole tiles"):
            S.gemm_all_reduce(pm, parts[r], b, 2)

    run_ranks(2, 1 << 20, call)
