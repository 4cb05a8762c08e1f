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

Waits on the store (debug check mode, the settings check) follow the same rule through
:func:`bound_s` and :func:`store_gather`: the ``call_timeout`` block's bound, else the
communicator's timeout, else the group's own. The store's reads come only after a bounded wait
has seen every key, because a read of a missing key waits out the store's own timeout (five
minutes on a ``FileStore``, the group's on torchrun's ``TCPStore``) whatever the call's bound.
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.distributed_c10d as c10d

from . import _native
from .errors import CollectiveTimeout, InvalidArgumentError

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["call_timeout", "limit", "wait", "bound_s", "store_gather"]


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


def bound_s(comm: Communicator) -> float:
    """Seconds a call on ``comm`` may wait for its peers: the ``call_timeout`` block's bound if one
    is open on this thread, else ``comm.timeout_s`` (``collectives.init(timeout=...)``), else the
    timeout the group's backend was built with (``init_process_group`` / ``new_group``), else
    torch's default for the backend (30 minutes for Gloo)."""
    t = _LOCAL.timeout
    if t is not None:
        return t.total_seconds()
    if comm.timeout_s is not None:
        return float(comm.timeout_s)
    return group_timeout_s(comm)


def group_timeout_s(comm: Communicator) -> float:
    """The timeout ``comm``'s process group was created with, in seconds."""
    for device_type in comm.device_types:
        try:
            # each backend keeps its options; torch has no public reader of the group's timeout
            return float(comm.group._get_backend(torch.device(device_type)).options._timeout.total_seconds())
        except (AttributeError, RuntimeError):  # a backend without options (MPI), or none for that device
            continue
    return float(c10d._get_default_timeout(comm.backend).total_seconds())  # type: ignore[arg-type]


def store_gather(store: Any, prefix: str, rank: int, value: str, ranks: Sequence[int], seconds: float, op: str,
                 what: str) -> list[str]:
    """Write ``value`` under ``prefix/rank`` and return every rank's value in rank order.

    One write, one wait bounded by ``seconds`` and one read of every key (``multi_get``): the read
    comes after the wait has seen every key, so that nothing here waits past the bound (see the
    module docstring).

    Args:
        store: the store the ranks share (the default store).
        prefix: the keys' prefix, the same on every rank and distinct for each exchange.
        rank: this rank's index among ``ranks``.
        value: what this rank writes.
        ranks: the global ranks of the group, in group order; named in the error.
        seconds: the bound.
        op, what: the call and the exchange, for the error's text.
    Raises:
        CollectiveTimeout: a rank's key did not appear within ``seconds``; names those ranks.
    """
    store.set(f"{prefix}/{rank}", value)
    keys = [f"{prefix}/{r}" for r in range(len(ranks))]
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except Exception as exc:  # noqa: BLE001 - the store's timeout (its type differs by store): say who is missing
        try:
            missing = [ranks[r] for r, k in enumerate(keys) if not store.check([k])]
        except Exception:  # noqa: BLE001 - the store itself is gone: no rank can be told apart
            missing = []
        why = f"rank(s) {missing} did not reach it" if missing else f"the store did not answer ({exc})"
        # "Timed out": the words torch's own timeouts use, which callers and torch's tests match
        raise CollectiveTimeout(op, missing, f"{what}: {why} within {seconds:g} s (Timed out after "
                                f"{seconds:g} s)") from exc
    return [v.decode() for v in store.multi_get(keys)]


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


_native.provide("wait", sys.modules[__name__])  # what the compiled fast path reads (_native.py)
