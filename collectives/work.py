"""Handles returned by collectives called with ``async_op=True``.

Every handle has ``wait(timeout=None)`` and ``is_completed()`` and is a context manager that waits
on exit. Which one you get depends on how the call runs: the backend's own ``Work`` (native), a
CUDA event recorded after the enqueued schedule (point-to-point algorithms on GPUs, where nothing
blocks the host), or a future of the communicator's worker thread (point-to-point algorithms on
CPU backends, whose transfers block).
"""

from __future__ import annotations

import datetime
from concurrent.futures import Future
from concurrent.futures import TimeoutError as _FutureTimeout
from typing import Any

import torch

__all__ = ["Work"]


class Work:
    """Handle of one asynchronous collective."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block (CPU) or order the current stream (GPU) until the collective is done.

        Args:
            timeout: seconds to wait at most; ``None`` uses the group's timeout.
        Returns:
            True once done. Raises ``TimeoutError`` if ``timeout`` passes first.
        """
        raise NotImplementedError

    def is_completed(self) -> bool:
        raise NotImplementedError

    def __enter__(self) -> Work:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wait()


class TorchWork(Work):
    __slots__ = ("_work",)

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            return bool(self._work.wait())
        return bool(self._work.wait(datetime.timedelta(seconds=timeout)))

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class FutureWork(Work):
    __slots__ = ("_future",)

    def __init__(self, future: Future[None]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.result(timeout=timeout)
        except _FutureTimeout:
            raise TimeoutError(f"collective did not complete within {timeout} s") from None
        return True

    def is_completed(self) -> bool:
        return self._future.done()


class EventWork(Work):
    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self, timeout: float | None = None) -> bool:
        torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return bool(self._event.query())
