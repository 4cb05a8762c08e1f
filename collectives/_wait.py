"""Every wait of a collective, bounded by the call's timeout.

A collective's default bound is its group's timeout (``collectives.init(timeout=...)`` or
``init_process_group``). :func:`call_timeout` tightens it for the calls made inside a ``with``
block on this thread: the backend's own collectives are then started asynchronously and waited
for with that bound, and so is every point-to-point step of our algorithms. A wait that runs out
raises, and the dispatch point turns it into ``CollectiveTimeout`` naming the ranks that never
entered the call. (torch.distributed's verbs take no timeout argument; a ``with`` block keeps our
verbs' signatures identical to theirs.)
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .errors import InvalidArgumentError

__all__ = ["call_timeout", "limit", "wait"]

_LOCAL = threading.local()


@contextmanager
def call_timeout(seconds: float | datetime.timedelta) -> Iterator[None]:
    """Bound every collective called on this thread inside the block by ``seconds``."""
    t = seconds if isinstance(seconds, datetime.timedelta) else datetime.timedelta(seconds=seconds)
    if t.total_seconds() <= 0:
        raise InvalidArgumentError("seconds", seconds, "is not a positive duration", "pass e.g. 30")
    before = getattr(_LOCAL, "timeout", None)
    _LOCAL.timeout = t
    try:
        yield
    finally:
        _LOCAL.timeout = before


def limit() -> datetime.timedelta | None:
    """The bound of a ``call_timeout`` block around this call, or None (the group's own timeout)."""
    return getattr(_LOCAL, "timeout", None)


def wait(work: Any) -> None:
    """``work.wait()``, bounded by the current ``call_timeout`` if there is one."""
    t = getattr(_LOCAL, "timeout", None)
    if t is None:
        work.wait()
    else:
        work.wait(t)
