"""The bound on the stream waits of copy-engine sections.

Design note. An operator's copy-engine section (``CopyEngines.open`` ... ``close``) orders
its streams with stream memory waits (``cuStreamWaitValue32``) on flags that its peers write.
Such a wait takes no SM. A one-block spinning kernel beside a GEMM slowed the GEMM by 7-23% on
2xH200, and a stream wait by nothing measurable (GEMMs of 2048-8192 x 2048-4096 x 8192, bf16,
2026-11-30). But a stream wait has no timeout. This watchdog gives it one:

* The open and close barriers count sections in host-mapped memory. The GPU writes the counts,
  so CUDA-graph replays count too. A plain barrier (``PeerMemory.barrier``) opens nothing.
* A section that stays open without progress for the peer-memory timeout makes the watchdog
  release every wait of this rank. A kernel that reports a timeout does the same.
* The release sets this rank's copy-engine flags far ahead and sets the device error word, so
  that queued kernels return at once. It also records the peer whose signals were the furthest
  behind.
* The host learns of it as it learns of a kernel's timeout: ``PeerMemory.check()`` raises
  ``CollectiveTimeout`` and names that peer.

After a release the peer memory is unusable, as after any peer-memory timeout.
"""

from __future__ import annotations

import inspect
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["SectionWatchdog"]

# the host-mapped record's words (peer.cuh, struct Ctx): failed, stage, block, peer, opened, closed
FAILED, OPENED, CLOSED = 0, 4, 5


class SectionWatchdog:
    """Watches a host-mapped record (a sequence of ints updated by the GPU) and calls
    ``release(stuck)`` once: ``stuck`` is True when a section made no progress for ``timeout_s``,
    False when a kernel reported a timeout first.

    ``release`` is held weakly when it is a bound method, so the watchdog does not keep its
    owner alive. ``observe()`` is one look, and the thread started by ``start()`` calls it every
    ``poll_s`` seconds. Tests drive ``observe()`` with their own clock.
    """

    def __init__(self, record: Any, timeout_s: float, release: Callable[[bool], None], *,
                 poll_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.record = record
        self.timeout_s = timeout_s
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.01, timeout_s / 20))
        self._release: Callable[[], Callable[[bool], None] | None] = (
            weakref.WeakMethod(release) if inspect.ismethod(release) else lambda: release)  # type: ignore[arg-type]
        self._clock = clock
        self._seen: tuple[int, int] | None = None
        self._since = 0.0
        self.released: bool | None = None  # None until it releases; then whether a section was stuck
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def observe(self) -> bool:
        """One look at the record; returns True when this look released the waits."""
        if self.released is not None:
            return False
        failed = int(self.record[FAILED]) != 0
        opened, closed = int(self.record[OPENED]), int(self.record[CLOSED])
        if not failed:
            if opened <= closed:  # no section open
                self._seen = None
                return False
            now = self._clock()
            if self._seen != (opened, closed):  # progress since the last look
                self._seen, self._since = (opened, closed), now
                return False
            if now - self._since < self.timeout_s:
                return False
        release = self._release()
        if release is None:  # the owner is gone
            self._stop.set()
            return False
        self.released = not failed
        release(not failed)
        return True

    def start(self) -> None:
        """Start watching on a daemon thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="commops-peer-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.observe():
                return
