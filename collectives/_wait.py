"""Every wait of a collective, bounded by the call's timeout.

A collective's default bound is its group's timeout (``collectives.init(timeout=...)`` or
``init_process_group``). :func:`call_timeout` tightens it for the calls made inside a ``with``
block on this thread: the backend's own collectives are then started asynchronously and waited
for with that bound, and so is every point-to-point step of our algorithms. A wait that runs out
raises, and the dispatch point turns it into ``CollectiveTimeout`` naming the ranks that never
entered the call. (torch.distributed's verbs take no timeout argument; a ``with`` block keeps our
verbs' signatures identical to theirs.)

On CUDA, NCCL's ``Work.wait`` only orders the current stream, so a peer that never arrives would
surface later, in whatever synchronises next, and only once NCCL's watchdog gives up. Inside a
``call_timeout`` block a synchronous CUDA collective therefore also waits on the host for its GPU
work (an event polled until the bound): the block trades the asynchrony of CUDA calls for a bound
that holds where the call is made, which is what a fault reproduction or a health check wants.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["call_timeout", "limit", "wait"]

class _Local(threading.local):
    # a class default: reading it on a thread that never set one raises nothing (limit() is on
    # every collective's path, and a missed attribute costs an exception inside getattr)
    timeout: datetime.timedelta | None = None


_LOCAL = _Local()
# call_timeout blocks open on any thread: while none is, no thread has a bound to read (the
# compiled fast path, collectives/_fastpath.c, skips the thread-local lookup then)
_OPEN = [0]
_OPEN_LOCK = threading.Lock()  # ``_OPEN[0] += 1`` is a read and a write: threads could lose a count


@contextmanager
def call_timeout(seconds: float | datetime.timedelta) -> Iterator[None]:
    """Bound every collective called on this thread inside the block by ``seconds``."""
    t = seconds if isinstance(seconds, datetime.timedelta) else datetime.timedelta(seconds=seconds)
    if t.total_seconds() <= 0:
        raise InvalidArgumentError("seconds", seconds, "is not a positive duration", "pass e.g. 30")
    before = _LOCAL.timeout
    _LOCAL.timeout = t
    with _OPEN_LOCK:
        _OPEN[0] += 1
    try:
        yield
    finally:
        with _OPEN_LOCK:
            _OPEN[0] -= 1
        _LOCAL.timeout = before


def limit() -> datetime.timedelta | None:
    """The bound of a ``call_timeout`` block around this call, or None (the group's own timeout)."""
    return _LOCAL.timeout


def wait(work: Any, cuda: bool = False) -> None:
    """``work.wait()``, bounded by the current ``call_timeout`` if there is one; with ``cuda``
    (the call's tensors are on the GPU) the host also waits, within that bound, until the GPU has
    done the work."""
    t = _LOCAL.timeout
    if t is None:
        work.wait()
        return
    if cuda:
        # NCCL's wait(timeout) may hold the host inside C++ until the watchdog gives up, deaf to
        # the bound and to signals; the plain wait only orders the stream, then we poll.
        work.wait()
        gpu_done(t.total_seconds(), t.total_seconds())
    else:
        work.wait(t)


def gpu_done(seconds: float, bound: float) -> None:
    """Wait on the host until the current CUDA stream's work so far is done; ``TimeoutError`` after
    ``seconds``. Polls an event (with a growing sleep, at most 1 ms) so that signals are handled
    while it waits."""
    import torch

    event = torch.cuda.Event()
    event.record()
    deadline = time.monotonic() + max(0.0, seconds)
    delay = 2e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the collective's GPU work did not finish within the call's bound of {bound:g} s "
                               "(timed out)")
        time.sleep(delay)
        delay = min(2 * delay, 1e-3)
