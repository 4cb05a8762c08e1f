"""A stand-in for the GPU side of ``overlap/_tile_signal.py`` on CPU threads: its flags, counters,
streams and the tile-signalled kernel, for the bookkeeping tests of
``tests/test_overlap_tile_signal_sim.py``.

Every rank is a thread with real CPU buffers for its slots and flags (the strategy's addresses,
``ce_flag_offset`` included, are used as they are). Each of its streams (the compute stream, push,
pull and gather) is a worker thread that runs what is queued on it in order, so a wait holds that
stream only, as on a GPU. The kernel runs on the compute stream's thread, one group after another
in its walk order (a schedule the persistent kernel may take: one program); each group waits, as
the real tiles do, for its sources' flags, adds their rows, stores, then fills its counter. Every
wait is bounded (``TIMEOUT_S``): a schedule that can deadlock on the GPUs fails here instead.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import pytest
import torch

from collectives.peer._layout import CE_RING, CE_STAGES, MAX_RANKS, ce_flag_offset
from overlap import _tile_gemm as T
from overlap import _tile_signal as S

from . import _fake_peer

TIMEOUT_S = 20.0
_CV = threading.Condition()  # notified on every flag, counter or error write
_LOCAL = threading.local()  # the calling rank's stand-in


def _load32(addr: int) -> int:
    return ctypes.c_int32.from_address(addr).value


def _store32(addr: int, value: int) -> None:
    with _CV:
        ctypes.c_int32.from_address(addr).value = value
        _CV.notify_all()


def _wait32(addr: int, value: int, what: str, err: int | None = None) -> None:
    def ready() -> bool:  # the cyclic >= of cuStreamWaitValue32's GEQ, or the error word set
        ahead = ((_load32(addr) - value + (1 << 31)) % (1 << 32)) - (1 << 31)
        return ahead >= 0 or (err is not None and _load32(err) != 0)

    with _CV:
        if not _CV.wait_for(ready, timeout=TIMEOUT_S):
            raise TimeoutError(f"{what}: the word at {addr:#x} stayed {_load32(addr)} < {value}")


class _Stream(_fake_peer._Stream):
    """A stream (``_fake_peer``'s): work runs in order; ``drain`` is bounded here."""

    def put(self, fn: Any) -> None:
        self.work.put(fn)

    def drain(self, timeout: float | None = 2 * TIMEOUT_S) -> None:
        super().drain(timeout)


class _Hub:
    def __init__(self, world: int, slot_bytes: int) -> None:
        flag_bytes = ce_flag_offset(CE_RING - 1, CE_STAGES - 1, MAX_RANKS - 1) + 4
        self.world = world
        self.slots = [torch.zeros(slot_bytes, dtype=torch.uint8) for _ in range(world)]
        self.flags = [torch.zeros(flag_bytes, dtype=torch.uint8) for _ in range(world)]
        self.barrier = threading.Barrier(world, timeout=TIMEOUT_S)


class _FakeCopyEngines:
    """What ``overlap/_tile_signal.py`` uses of ``CopyEngines``, on real CPU addresses."""

    def __init__(self, pm: _FakePeerMemory) -> None:
        self.pm = pm
        self.streams = (_Stream(f"push{pm.rank}"), _Stream(f"pull{pm.rank}"))

    def open(self) -> None:
        self.pm.hub.barrier.wait()

    def close(self) -> None:
        hub = self.pm.hub
        hub.barrier.wait()  # every rank is done with this call's flags
        with _CV:
            hub.flags[self.pm.rank].zero_()
        hub.barrier.wait()

    def wait(self, stream: _Stream, slot: int, stage: int, value: int, *, kernel: bool | None = None,
             source: int | None = None) -> None:
        pm = self.pm
        for q in range(pm.world):
            if q != pm.rank and source in (None, q):
                addr = pm.flag_pointers[pm.rank] + ce_flag_offset(slot, stage, q)
                stream.put(lambda addr=addr, q=q: _wait32(addr, value, f"rank {pm.rank} slot {slot} stage {stage} "
                                                          f"from {q}"))

    def signal(self, stream: _Stream, peer: int, slot: int, stage: int, value: int) -> None:
        addr = self.pm.flag_pointers[peer] + ce_flag_offset(slot, stage, self.pm.rank)
        stream.put(lambda: _store32(addr, value))

    def push(self, stream: _Stream, peer: int, offset: int, src: int, nbytes: int) -> None:
        assert 0 <= offset and offset + nbytes <= self.pm.slot_bytes, (offset, nbytes)
        stream.put(lambda: ctypes.memmove(self.pm.slot_pointers[peer] + offset, src, nbytes))

    def take(self, stream: _Stream, offset: int, dst: int, nbytes: int) -> None:
        assert 0 <= offset and offset + nbytes <= self.pm.slot_bytes, (offset, nbytes)
        stream.put(lambda: ctypes.memmove(dst, self.pm.slot_pointers[self.pm.rank] + offset, nbytes))


class _FakePeerMemory:
    """What ``overlap/_tile_signal.py`` uses of ``PeerMemory``."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world
        self.slot_bytes = hub.slots[0].numel()
        self.slot_pointers = tuple(t.data_ptr() for t in hub.slots)
        self.flag_pointers = tuple(t.data_ptr() for t in hub.flags)
        self.device = torch.device("cpu")
        self.device_index = -1
        self._err_dev = torch.zeros(4, dtype=torch.int32)
        self.main = _Stream(f"main{rank}")
        self.gather = _Stream(f"gather{rank}")
        self.copy_engines = _FakeCopyEngines(self)

    def streams(self) -> list[_Stream]:
        return [self.main, *self.copy_engines.streams, self.gather]


class _Streams:
    """``_tile_signal._Streams`` here: the rank's worker threads."""

    def __init__(self, pm: _FakePeerMemory) -> None:
        self.pm = pm
        self.main, (self.push, self.pull), self.gather = pm.main, pm.copy_engines.streams, pm.gather
        self.ps, self.ls, self.gs = self.push, self.pull, self.gather

    def fork(self) -> None:
        reached = threading.Event()

        def after_main() -> None:
            if not reached.wait(TIMEOUT_S):
                raise TimeoutError("a side stream waited for the compute stream's earlier work")

        self.main.put(reached.set)
        for side in (self.push, self.pull, self.gather):
            side.put(after_main)

    def join(self) -> None:
        for st in self.pm.streams():
            st.drain()


def _kernel(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *, counters: torch.Tensor | None = None,
            group_rows: int = T.TILE_ROWS, first: int = 0, meta: torch.Tensor | None = None,
            staging: torch.Tensor | None = None, err: torch.Tensor | None = None, **_: Any) -> torch.Tensor | None:
    """``tile_mm`` as a job on the calling rank's compute stream (see the module's note)."""
    pm = _LOCAL.pm
    m, n = a.shape[0], b.shape[1]
    counts = T.tiles(m, n, group_rows)
    groups, es = len(counts), a.element_size()
    assert meta is not None and out is not None and err is not None and meta.shape[0] == groups
    rows_meta = meta.tolist()
    a, b = a.clone(), b.clone()

    def run() -> None:
        for i in range(groups):
            g = (first + i) % groups
            lo = g * group_rows
            part = a[lo:lo + group_rows] @ b
            sel, off, *sources = rows_meta[g]
            for s in range(0, len(sources), 3):
                src, flag, need = sources[s:s + 3]
                if src:
                    _wait32(flag, need, f"rank {pm.rank} group {g} source {s // 3}", err.data_ptr())
                    buf = (ctypes.c_char * (part.numel() * es)).from_address(src)
                    part = part + torch.frombuffer(buf, dtype=a.dtype).view(part.shape)
            base = (out if sel == 0 else staging).data_ptr()  # type: ignore[union-attr]
            ctypes.memmove(base + off * es, part.contiguous().data_ptr(), part.numel() * es)
            if counters is not None:
                _store32(counters.data_ptr() + 4 * g, counts[g])

    pm.main.put(run)
    return out


def use_fake_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-ins in ``overlap._tile_signal`` for a test's duration."""
    monkeypatch.setattr(S, "_Streams", _Streams)
    monkeypatch.setattr(S, "_capturing", lambda: False)
    monkeypatch.setattr(S, "_synchronize", lambda device: _LOCAL.pm.main.drain())
    monkeypatch.setattr(S._launch, "wait_value", lambda stream, addr, value: stream.put(
        lambda: _wait32(addr, value, f"counter at {addr:#x}")))
    monkeypatch.setattr(T, "supported", lambda a, b: "")
    monkeypatch.setattr(T, "tile_mm", _kernel)


def run_ranks(world: int, slot_bytes: int, fn: Any) -> list[Any]:
    """``fn(pm, rank)`` on one thread per rank; its result per rank. A rank's failure aborts the others."""
    hub = _Hub(world, slot_bytes)

    def make(rank: int) -> _FakePeerMemory:
        pm = _LOCAL.pm = _FakePeerMemory(hub, rank)
        return pm

    return _fake_peer.run_threads(world, make, fn, lambda pm: pm.streams(), hub.barrier.abort, TIMEOUT_S * 4)
