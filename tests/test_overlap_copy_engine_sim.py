"""The copy-engine overlap strategy's bookkeeping, on CPU: slot offsets, ring slots and their
reuse, row blocks, chunk splits and flag values. Every rank is a thread with a stand-in for
``PeerMemory``: copies are ``memmove`` into shared CPU buffers, flags live under a condition
variable, the compute stream runs on the rank's thread and each copy stream is a worker thread
that runs what is queued on it in order (so a wait on a copy stream holds that stream only, as
on a GPU).

What this cannot show is the GPU's side: the copy engines, kernels and memory ordering
(``tests/gpu_overlap_check.py`` on the GPUs).
"""

from __future__ import annotations

import ctypes
import queue
import threading
from typing import Any

import pytest
import torch

from overlap import _copy_engine as CE

TIMEOUT_S = 20.0


class _Hub:
    """What the ranks share: slot buffers, flags, barriers."""

    def __init__(self, world: int, slot_bytes: int) -> None:
        self.world = world
        self.slots = [torch.zeros(slot_bytes, dtype=torch.uint8) for _ in range(world)]
        self.flags: dict[tuple[int, int, int, int], int] = {}  # (owner, slot, stage, source) -> value
        self.cv = threading.Condition()
        self.barrier = threading.Barrier(world, timeout=TIMEOUT_S)


class _Stream(threading.Thread):
    """A copy stream: runs queued work in order; ``drain`` waits for all of it."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.work: queue.Queue[Any] = queue.Queue()
        self.errors: list[BaseException] = []
        self.start()

    def run(self) -> None:
        while True:
            fn = self.work.get()
            try:
                if fn is None:
                    return
                if not self.errors:
                    fn()
            except BaseException as exc:  # noqa: BLE001 - reported by drain
                self.errors.append(exc)
            finally:
                self.work.task_done()

    def drain(self) -> None:
        self.work.join()
        if self.errors:
            raise self.errors[0]


MAIN = "main"


def _on(stream: Any, fn: Any) -> None:
    if stream == MAIN:
        fn()
    else:
        stream.work.put(fn)


class _FakePeerMemory:
    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world
        self.slot_bytes = hub.slots[0].numel()
        self.device = torch.device("cpu")
        self.copy_streams = (_Stream(f"push{rank}"), _Stream(f"pull{rank}"))
        self.slot_pointers = tuple(t.data_ptr() for t in hub.slots)

    def ce_open(self) -> None:
        self.hub.barrier.wait()

    def ce_close(self) -> None:
        self.hub.barrier.wait()
        with self.hub.cv:
            for key in [k for k in self.hub.flags if k[0] == self.rank]:
                del self.hub.flags[key]

    def ce_wait(self, stream: Any, slot: int, stage: int, value: int) -> None:
        def ready() -> bool:
            return all(self.hub.flags.get((self.rank, slot, stage, q), 0) >= value
                       for q in range(self.world) if q != self.rank)

        def wait() -> None:
            with self.hub.cv:
                if not self.hub.cv.wait_for(ready, timeout=TIMEOUT_S):
                    raise TimeoutError(f"rank {self.rank} waited for slot {slot} stage {stage} >= {value}: "
                                       f"{self.hub.flags}")

        _on(stream, wait)

    def ce_signal(self, stream: Any, peer: int, slot: int, stage: int, value: int) -> None:
        def signal() -> None:
            with self.hub.cv:
                self.hub.flags[(peer, slot, stage, self.rank)] = value
                self.hub.cv.notify_all()

        _on(stream, signal)

    def ce_push(self, stream: Any, peer: int, offset: int, src: int, nbytes: int) -> None:
        assert 0 <= offset and offset + nbytes <= self.slot_bytes, (offset, nbytes)
        _on(stream, lambda: ctypes.memmove(self.slot_pointers[peer] + offset, src, nbytes))

    def ce_take(self, stream: Any, offset: int, dst: int, nbytes: int) -> None:
        assert 0 <= offset and offset + nbytes <= self.slot_bytes, (offset, nbytes)
        _on(stream, lambda: ctypes.memmove(dst, self.slot_pointers[self.rank] + offset, nbytes))

    def slot_view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        es = torch.empty((), dtype=dtype).element_size()
        n = 1
        for d in shape:
            n *= d
        assert offset % es == 0 and offset + n * es <= self.slot_bytes, (offset, shape)
        return self.hub.slots[self.rank][offset:offset + n * es].view(dtype).view(shape)


class _Streams:
    def __init__(self, pm: Any) -> None:
        self.push, self.pull = pm.copy_streams
        self.main, self.ms, self.ps, self.ls = MAIN, MAIN, self.push, self.pull

    def after_main(self, side: Any) -> None:
        pass  # the compute stream's work is done when the rank's thread gets here

    def join(self, *sides: Any) -> None:
        for side in sides:
            side.drain()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CE, "_Streams", _Streams)


def _run(world: int, slot_bytes: int, fn: Any) -> list[Any]:
    hub = _Hub(world, slot_bytes)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        pm = _FakePeerMemory(hub, rank)
        try:
            results[rank] = fn(pm, rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            hub.barrier.abort()
        finally:
            for st in pm.copy_streams:
                st.work.put(None)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 3)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def _data(seed: int, world: int, m: int, k: int, n: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, k, generator=g, dtype=torch.float64) for _ in range(world)], \
        torch.randn(k, n, generator=g, dtype=torch.float64)


# (world, rows, chunks): odd sizes, empty chunks, a rank with an empty block (all-reduce)
CASES = [(2, 6, 1), (2, 7, 3), (3, 9, 2), (3, 5, 4), (4, 3, 2), (2, 1, 3)]


@pytest.mark.parametrize("world,rows,chunks", CASES)
def test_all_gather_gemm(fake: None, world: int, rows: int, chunks: int) -> None:
    shards, b = _data(1, world, rows, 5, 4)
    got = _run(world, 1 << 20, lambda pm, r: CE.all_gather_gemm(pm, shards[r], b, chunks, keep_gathered=True))
    want = torch.cat(shards) @ b
    for out, full in got:
        assert torch.allclose(out, want, atol=1e-12)
        assert torch.equal(full.view(-1, 5), torch.cat(shards))


@pytest.mark.parametrize("world,rows,chunks", CASES)
def test_gemm_reduce_scatter(fake: None, world: int, rows: int, chunks: int) -> None:
    parts, b = _data(2, world, rows * world, 6, 3)
    got = _run(world, 1 << 20, lambda pm, r: CE.gemm_reduce_scatter(pm, parts[r], b, chunks))
    total = sum(p @ b for p in parts)
    for r, out in enumerate(got):
        assert torch.allclose(out, total[r * rows:(r + 1) * rows], atol=1e-12), r


@pytest.mark.parametrize("world,rows,chunks", CASES + [(3, 7, 2), (4, 2, 1)])
def test_gemm_all_reduce(fake: None, world: int, rows: int, chunks: int) -> None:
    parts, b = _data(3, world, rows, 4, 5)  # rows need not divide by world
    got = _run(world, 1 << 20, lambda pm, r: CE.gemm_all_reduce(pm, parts[r], b, chunks))
    total = sum(p @ b for p in parts)
    for out in got:
        assert torch.allclose(out, total, atol=1e-12)
    assert all(torch.equal(out, got[0]) for out in got)  # every rank holds the same bits


# a peer buffer so small that the ring holds 2 or 3 slots: chunks reuse slots within the call
@pytest.mark.parametrize("world,rows,chunks", [(2, 12, 6), (3, 10, 5), (2, 9, 9)])
def test_ring_slots_reused_within_a_call(fake: None, world: int, rows: int, chunks: int) -> None:
    small = 3 * 256 * world  # bytes: 3 ring slots of 256-byte regions (up to 4 rows of 8 float64)
    shards, b = _data(5, world, rows, 8, 8)
    got = _run(world, small, lambda pm, r: CE.all_gather_gemm(pm, shards[r], b, chunks, keep_gathered=False))
    want = torch.cat(shards) @ b
    assert all(torch.allclose(out, want, atol=1e-12) for out, _ in got)
    parts, b = _data(6, world, rows * world, 8, 8)
    got = _run(world, small, lambda pm, r: CE.gemm_reduce_scatter(pm, parts[r], b, chunks))
    total = sum(p @ b for p in parts)
    assert all(torch.allclose(out, total[r * rows:(r + 1) * rows], atol=1e-12) for r, out in enumerate(got))
    got = _run(world, 2 * small, lambda pm, r: CE.gemm_all_reduce(pm, parts[r][:rows], b, chunks))
    total = sum(p[:rows] @ b for p in parts)
    assert all(torch.allclose(out, total, atol=1e-12) for out in got)


def test_back_to_back_calls_reuse_the_flags(fake: None) -> None:
    parts, b = _data(4, 2, 8, 4, 4)

    def calls(pm: Any, r: int) -> list[torch.Tensor]:
        return [CE.gemm_all_reduce(pm, parts[r] * (i + 1), b, 2) for i in range(3)]

    got = _run(2, 1 << 20, calls)
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
