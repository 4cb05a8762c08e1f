"""A stand-in for ``PeerMemory`` and its ``CopyEngines`` on CPU threads, for the copy-engine
bookkeeping tests of ``overlap/_copy_engine.py``.

Every rank is a thread: copies are ``memmove`` into shared CPU buffers, flags live under a
condition variable, the compute stream runs on the rank's thread and each copy stream is a
worker thread that runs what is queued on it in order (so a wait on a copy stream holds that
stream only, as on a GPU). ``use_fake_streams`` puts the matching stream helper into
``overlap._copy_engine``; ``run_ranks`` runs one function per rank.

Every GEMM the operators call first waits until the calling rank's copy streams are idle: a
host call on a GPU can block until the device is idle (torch.addmm did on 2×H200), and an
operator that queued a wait for a signal its peer has not issued yet then hangs. Here it fails
within ``SYNC_TIMEOUT_S`` instead.
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
SYNC_TIMEOUT_S = 5.0
_LOCAL = threading.local()  # the calling rank's stand-in (run_ranks)


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

    def drain(self, timeout: float | None = None) -> None:
        with self.work.all_tasks_done:
            if not self.work.all_tasks_done.wait_for(lambda: not self.work.unfinished_tasks, timeout):
                raise TimeoutError(f"{self.name} still busy after {timeout} s at a device sync: a queued wait "
                                   "needs a signal its peer has not issued")
        if self.errors:
            raise self.errors[0]


MAIN = "main"


def _on(stream: Any, fn: Any) -> None:
    if stream == MAIN:
        fn()
    else:
        stream.work.put(fn)


class _FakeCopyEngines:
    """What ``overlap/_copy_engine.py`` uses of ``CopyEngines``."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world
        self.slot_bytes = hub.slots[0].numel()
        self.streams = (_Stream(f"push{rank}"), _Stream(f"pull{rank}"))
        self.slot_pointers = tuple(t.data_ptr() for t in hub.slots)

    def open(self) -> None:
        self.hub.barrier.wait()

    def close(self) -> None:
        self.hub.barrier.wait()
        with self.hub.cv:
            for key in [k for k in self.hub.flags if k[0] == self.rank]:
                del self.hub.flags[key]

    def wait(self, stream: Any, slot: int, stage: int, value: int, *, kernel: bool | None = None) -> None:
        def ready() -> bool:
            return all(self.hub.flags.get((self.rank, slot, stage, q), 0) >= value
                       for q in range(self.world) if q != self.rank)

        def wait() -> None:
            with self.hub.cv:
                if not self.hub.cv.wait_for(ready, timeout=TIMEOUT_S):
                    raise TimeoutError(f"rank {self.rank} waited for slot {slot} stage {stage} >= {value}: "
                                       f"{self.hub.flags}")

        _on(stream, wait)

    def signal(self, stream: Any, peer: int, slot: int, stage: int, value: int) -> None:
        def signal() -> None:
            with self.hub.cv:
                self.hub.flags[(peer, slot, stage, self.rank)] = value
                self.hub.cv.notify_all()

        _on(stream, signal)

    def push(self, stream: Any, peer: int, offset: int, src: int, nbytes: int) -> None:
        assert 0 <= offset and offset + nbytes <= self.slot_bytes, (offset, nbytes)
        _on(stream, lambda: ctypes.memmove(self.slot_pointers[peer] + offset, src, nbytes))

    def take(self, stream: Any, offset: int, dst: int, nbytes: int) -> None:
        assert 0 <= offset and offset + nbytes <= self.slot_bytes, (offset, nbytes)
        _on(stream, lambda: ctypes.memmove(dst, self.slot_pointers[self.rank] + offset, nbytes))


class _FakePeerMemory:
    """What ``overlap/_copy_engine.py`` uses of ``PeerMemory``."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world
        self.slot_bytes = hub.slots[0].numel()
        self.device = torch.device("cpu")
        self.copy_engines = _FakeCopyEngines(hub, rank)

    def slot_view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        es = torch.empty((), dtype=dtype).element_size()
        n = 1
        for d in shape:
            n *= d
        assert offset % es == 0 and offset + n * es <= self.slot_bytes, (offset, shape)
        return self.hub.slots[self.rank][offset:offset + n * es].view(dtype).view(shape)


class _Streams:
    def __init__(self, pm: Any) -> None:
        self.push, self.pull = pm.copy_engines.streams
        self.main, self.ms, self.ps, self.ls = MAIN, MAIN, self.push, self.pull

    def after_main(self, side: Any) -> None:
        pass  # the compute stream's work is done when the rank's thread gets here

    def join(self, *sides: Any) -> None:
        for side in sides:
            side.drain()


class _SyncingTorch:
    """``torch`` as ``overlap._copy_engine`` sees it here: a GEMM first waits (bounded) until the
    calling rank's copy streams are idle (see the module's note)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def _device_sync() -> None:
        for st in _LOCAL.pm.copy_engines.streams:
            st.drain(SYNC_TIMEOUT_S)

    def matmul(self, *args: Any, **kwargs: Any) -> Any:
        self._device_sync()
        return torch.matmul(*args, **kwargs)

    def addmm(self, *args: Any, **kwargs: Any) -> Any:
        self._device_sync()
        return torch.addmm(*args, **kwargs)


def use_fake_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Put the stand-in's stream helper into ``overlap._copy_engine``, and its GEMMs behind a device
    sync (for a test's duration)."""
    monkeypatch.setattr(CE, "_Streams", _Streams)
    monkeypatch.setattr(CE, "torch", _SyncingTorch())


def run_threads(world: int, make: Any, fn: Any, streams: Any, abort: Any, join_s: float) -> list[Any]:
    """``fn(make(rank), rank)`` on one thread per rank; its result per rank. ``streams(pm)``: the
    rank's stream threads, stopped at the end; ``abort()`` releases the others when one fails."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        pm = make(rank)
        try:
            results[rank] = fn(pm, rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            abort()
        finally:
            for st in streams(pm):
                st.work.put(None)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def run_ranks(world: int, slot_bytes: int, fn: Any) -> list[Any]:
    hub = _Hub(world, slot_bytes)

    def make(rank: int) -> _FakePeerMemory:
        pm = _LOCAL.pm = _FakePeerMemory(hub, rank)
        return pm

    return run_threads(world, make, fn, lambda pm: pm.copy_engines.streams, hub.barrier.abort, TIMEOUT_S * 3)
