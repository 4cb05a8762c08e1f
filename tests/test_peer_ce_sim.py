"""The copy-engine collectives (``collectives/algos/copy_engine.py``: all-reduce, reduce-scatter,
all-gather, over ``collectives/peer/copy_engines.py``) on a CPU stand-in for the GPUs
(``tests/_fake_ce.py``): 2 to 5 ranks, messages that wrap the ring of
slots several times and end in a partial chunk, every stream's work run in random orders. Each
result is checked against its definition in float64, and every rank's copy-engine flags must be
back to zero after the call (the closing barrier's promise to the next call)."""

from __future__ import annotations

import pytest
import torch

from collectives.algos.copy_engine import ce_pieces
from collectives.errors import UnsupportedError
from collectives.peer import _launch
from collectives.peer.copy_engines import CE_PUSHED
from tests._fake_ce import FakeRank, Machine, _at


def _fresh(world: int, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for _ in range(world)]


def _flags_clear(m: Machine) -> None:
    for r, f in enumerate(m.flags):
        assert int(f.abs().sum()) == 0, f"rank {r}: copy-engine flags left set"


# (elements per shard, chunk bytes, ring slots): slot buffers of ring x world chunks, so that
# the ring wraps many times, and shards that end in a partial chunk or fit in one
@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])  # 8: the most ranks of one node (MAX_RANKS)
@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_reduce_scatter_and_all_gather_by_copy_engines(world: int, kind: str) -> None:
    for seed, (m_elems, chunk_bytes, ring) in enumerate([(250, 64, 2), (37, 64, 3), (1000, 256, 2), (1, 64, 2)]):
        machine = Machine(world, ring * world * chunk_bytes, chunk_bytes)
        n_in = m_elems * world if kind == "reduce_scatter" else m_elems
        inputs = _fresh(world, n_in, seed)
        outs = [torch.full((m_elems if kind == "reduce_scatter" else m_elems * world,), float("nan"))
                for _ in range(world)]

        def host(r: FakeRank) -> None:
            r.by_shard(kind, outs[r.rank], inputs[r.rank], m_elems)

        machine.call(host)
        machine.run(seed)
        total = torch.stack(inputs).double().sum(0)
        for r in range(world):
            if kind == "reduce_scatter":
                want = total[r * m_elems:(r + 1) * m_elems]
                assert torch.allclose(outs[r].double(), want, rtol=1e-6, atol=1e-5), (world, m_elems, r)
            else:
                assert torch.equal(outs[r], torch.cat(inputs)), (world, m_elems, r)
        _flags_clear(machine)
        if m_elems * 4 > 2 * ring * chunk_bytes:
            assert machine.most_uses >= 2, "the ring did not wrap"


@pytest.mark.parametrize("world", [2, 3, 4, pytest.param(8, marks=pytest.mark.slow)])  # 8: 40-50 s on two cores
def test_all_reduce_by_copy_engines(world: int) -> None:
    # slot buffers of 2-3 ring slots of (world + 1) shards of a chunk
    for seed, (n, chunk_bytes, slot_bytes) in enumerate([(1001, 64, 2 * 6 * 64), (4000, 256, 3 * 6 * 256),
                                                         (3, 64, 2 * 6 * 64)]):
        for order_seed in range(3):  # the same call, its streams' work interleaved differently
            machine = Machine(world, slot_bytes, chunk_bytes)
            inputs = _fresh(world, n, seed)
            tensors = [x.clone() for x in inputs]
            machine.call(lambda r: r.all_reduce(tensors[r.rank], True))
            machine.run(100 * seed + order_seed)
            total = torch.stack(inputs).double().sum(0)
            for r in range(world):
                assert torch.allclose(tensors[r].double(), total, rtol=1e-6, atol=1e-5), (world, n, r)
            _flags_clear(machine)
            if n > 100:
                assert machine.most_uses >= 2, "the ring did not wrap"


def test_a_missing_signal_is_a_deadlock_not_a_wrong_answer() -> None:
    """The stand-in can fail: drop one rank's PUSHED signals and it reports the wait."""
    machine = Machine(2, 2048, 64)
    inputs = _fresh(2, 74, 0)
    outs = [torch.empty(37) for _ in range(2)]
    with machine.patched():
        write = _launch.write_value
        for r in machine.ranks:
            machine.active = r.rank
            if r.rank == 1:
                _launch.write_value = lambda stream, addr, value: None
            r.by_shard("reduce_scatter", outs[r.rank], inputs[r.rank], 37)
            _launch.write_value = write
    with pytest.raises(AssertionError, match="deadlock"):
        machine.run(0)


@pytest.mark.parametrize("m,chunk,pack,ramp", [(1000, 64, 4, True), (1000, 64, 4, False), (150, 64, 4, True),
                                               (4097, 256, 8, True), (0, 64, 4, True), (7, 64, 4, True)])
def test_copy_engine_chunks_cover_the_message_once_within_the_chunk_size(m: int, chunk: int, pack: int,
                                                                         ramp: bool) -> None:
    pieces = ce_pieces(m, chunk, pack, ramp)
    assert [lo for lo, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
    assert sum(n for _, n in pieces) == m and all(0 < n <= chunk for _, n in pieces)
    assert all(n % pack == 0 for _, n in pieces[:-1]) or m % pack  # whole packs but for a ragged end
    ramped = ramp and m >= chunk // 2 + (chunk // 2 + chunk // 4 + chunk // 8) + chunk
    if ramped:  # a half first piece, full chunks, then shrinking to an eighth
        sizes = [n for _, n in pieces]
        assert sizes[0] == chunk // 2 and sizes[-3:] == [chunk // 2, chunk // 4, chunk // 8]
        assert chunk in sizes
    else:
        assert pieces == [(lo, min(chunk, m - lo)) for lo in range(0, m, chunk)]


def test_a_wait_for_one_source_holds_only_for_that_peers_flag() -> None:
    """``ce_wait(source=q)`` (kernel and stream forms) waits for rank q's flag alone; a source
    that is not a peer is refused before anything is queued."""
    for kernel in (True, False):
        machine = Machine(3, 2048, 64)
        me = machine.ranks[0]
        ce = me.copy_engines
        with machine.patched():
            if not kernel:  # a stream wait is allowed inside a section only
                ce.open()
                me.main.ops.clear()  # the opening barrier
            stream = me.main.cuda_stream
            for bad in (0, 3, -1):
                with pytest.raises(UnsupportedError, match="source"):
                    ce.wait(stream, 0, CE_PUSHED, 1, kernel=kernel, source=bad)
            assert not me.main.ops
            ce.wait(stream, 0, CE_PUSHED, 1, kernel=kernel, source=2)
        assert len(me.main.ops) == 1
        ready = me.main.ops[0][0]
        assert not ready()
        for src, holds in ((1, False), (2, True)):  # another peer's flag leaves it waiting
            _at(me.flag_pointers[0] + FakeRank.flag_offset(0, CE_PUSHED, src), 1, torch.int32).fill_(1)
            assert ready() is holds, (kernel, src)
