"""Handles returned by collectives called with ``async_op=True``.

Every handle has ``torch.distributed.Work``'s surface: ``wait(timeout=None)``, ``is_completed()``,
``is_success()``, ``exception()``, ``result()`` (the call's output tensors), ``synchronize()``,
``get_future()`` (a ``torch.futures.Future`` of ``result()``) and ``source_rank()`` (which, as
torch's, only a receive answers: none of these is one), and is a context manager that waits on
exit. Which one you get depends on how the call runs: the backend's own ``Work`` (native), a
CUDA event recorded after the enqueued schedule (point-to-point algorithms on GPUs, where nothing
blocks the host), a future of the communicator's worker thread (point-to-point algorithms on
CPU backends, whose transfers block), or, for a list form that copies its result into the
caller's list, one of those wrapped so that the copy runs when it is waited on (``ThenWork``).
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

    _outputs: list[torch.Tensor] = []

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

    def exception(self) -> BaseException | None:
        """What the collective raised, once completed (None while running or on success)."""
        return None

    def is_success(self) -> bool:
        """Whether it completed without an error."""
        return self.is_completed() and self.exception() is None

    def result(self) -> list[torch.Tensor]:
        """The call's output tensors (what ``torch.distributed.Work.result`` returns)."""
        return list(self._outputs)

    def synchronize(self) -> None:
        """As ``wait()``: on GPUs the current stream waits; on CPUs the host does."""
        self.wait()

    def source_rank(self) -> int:
        raise RuntimeError("source_rank() may only be called on a recv work: a collective has no single source "
                           "(torch.distributed.Work says the same of its collectives' handles)")

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future completed with ``result()`` when the collective is (on GPUs: ordered on the
        current stream), or with its exception."""
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the future's reader
            fut.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types it as the result
        else:
            fut.set_result(self.result())
        return fut

    def __enter__(self) -> Work:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wait()


class TorchWork(Work):
    """The backend's own handle, whose methods answer (``get_future`` included)."""

    __slots__ = ("_work",)

    def __init__(self, work: Any) -> None:
        self._work = work

    def exception(self) -> BaseException | None:
        if not self.is_completed() or self._work.is_success():
            return None
        try:
            return self._work.exception()  # type: ignore[no-any-return]
        except TypeError:  # torch 2.11 cannot hand its exception_ptr to Python
            return RuntimeError("the backend's collective failed (torch 2.11 cannot say how: wait() raises it)")

    def is_success(self) -> bool:
        return bool(self._work.is_success())

    def result(self) -> list[torch.Tensor]:
        return list(self._work.result())

    def synchronize(self) -> None:
        self._work.synchronize()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._work.get_future()  # type: ignore[no-any-return]

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            return bool(self._work.wait())
        return bool(self._work.wait(datetime.timedelta(seconds=timeout)))

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class FutureWork(Work):
    """A call running on the communicator's worker thread."""

    __slots__ = ("_future", "_outputs")

    def __init__(self, future: Future[None], outputs: list[torch.Tensor]) -> None:
        self._future = future
        self._outputs = outputs

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """Completed from the worker thread when the call is, without blocking here."""
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()

        def done(f: Future[None]) -> None:
            exc = f.exception()
            if exc is not None:
                fut.set_exception(exc)  # type: ignore[arg-type]  # torch's stub types it as the result
            else:
                fut.set_result(list(self._outputs))
        self._future.add_done_callback(done)
        return fut

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.result(timeout=timeout)
        except _FutureTimeout:
            raise TimeoutError(f"collective did not complete within {timeout} s") from None
        return True

    def is_completed(self) -> bool:
        return self._future.done()


class EventWork(Work):
    """A call enqueued on the GPUs, its end marked by a CUDA event."""

    __slots__ = ("_event", "_outputs")

    def __init__(self, event: torch.cuda.Event, outputs: list[torch.Tensor]) -> None:
        self._event = event
        self._outputs = outputs

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """Completed at once, ordered on the current stream: it waits for the call's event, and a
        CUDA-aware future makes its readers' streams wait for the current one."""
        devices: list[int | str | torch.device] = sorted({t.device for t in self._outputs if t.is_cuda}, key=str)
        fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future(devices=devices)
        torch.cuda.current_stream().wait_event(self._event)
        fut.set_result(list(self._outputs))
        return fut

    def wait(self, timeout: float | None = None) -> bool:
        torch.cuda.current_stream().wait_event(self._event)
        return True

    def is_completed(self) -> bool:
        return bool(self._event.query())


class ThenWork(Work):
    """A call whose caller-side step (copying a flat result into the caller's list of tensors,
    ``collectives/_lists.py``) runs once the call it wraps is done: in ``wait()``, or in
    ``is_completed()`` when that finds it done, so that no reader sees the list before the copy."""

    __slots__ = ("_inner", "_step", "_outputs")

    def __init__(self, inner: Work, step: Any, outputs: list[torch.Tensor]) -> None:
        self._inner = inner
        self._step = step
        self._outputs = outputs

    def _finish(self) -> None:
        step, self._step = self._step, None
        if step is not None:
            step()

    def wait(self, timeout: float | None = None) -> bool:
        self._inner.wait(timeout)
        self._finish()
        return True

    def is_completed(self) -> bool:
        if not self._inner.is_completed():
            return False
        if self._inner.exception() is None:
            self._finish()
        return True

    def exception(self) -> BaseException | None:
        return self._inner.exception()

    def is_success(self) -> bool:
        return self.is_completed() and self._inner.is_success()
