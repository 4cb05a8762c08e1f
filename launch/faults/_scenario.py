"""What every fault scenario shares: start the group, inject, record what each rank saw.

A scenario runs under torchrun (3 ranks or more; the culprit is the last rank); every rank
writes ``outcome_rank<R>.json`` into the trace directory (what it raised and how long after the
fault it noticed), and the flight recorder's dumps land beside it. ``FAULT_TIMEOUT_S`` (default
5) is the group's collective timeout.

The trace directory is ``COMMOPS_TRACE_DIR`` where set (``run_all.py`` sets it), and kept.
Otherwise rank 0 makes a private one (``tempfile.mkdtemp``: a new random name, mode 0700), tells
the other ranks through the launcher's store, and removes it once every rank has finished its
record (or a bound has passed: a crashed rank never does). A fixed ``/tmp/commops-fault-NAME``,
as first written, let another local user create that path first, as a link or a directory of
theirs, and receive or redirect every rank's files.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

import collectives as C  # noqa: E402

__all__ = ["run"]


class LauncherStop(Exception):
    """SIGTERM: the launcher stopped this rank, which torchrun does to every rank once one exits."""


_ARMED = [True]  # a SIGTERM raises until the fault's call is over; after it, the rank finishes its record


def _stop(*_: Any) -> None:
    if _ARMED[0]:
        _ARMED[0] = False
        raise LauncherStop("SIGTERM: the launcher stopped this rank (another rank exited)")


_STARTED = "commops_fault_scenario_started"  # the launcher's store keys, one run per torchrun job
_TRACE = "commops_fault_scenario_trace_dir"
_FINISHED = "commops_fault_scenario_finished"


def _launcher_store(bound_s: float = 120.0) -> Any:
    """The torchrun job's store (``MASTER_ADDR``/``MASTER_PORT``), or None outside torchrun."""
    import torch.distributed as dist

    addr, port, world = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), os.environ.get("WORLD_SIZE")
    if not (addr and port and world):
        return None
    return dist.TCPStore(addr, int(port), int(world), is_master=False, timeout=datetime.timedelta(seconds=bound_s))


def _start_together(store: Any, world: int, bound_s: float = 120.0) -> None:
    """Wait until every rank of this torchrun job has started (bounded), on the launcher's store.

    The group's timeout is the scenario's collective timeout, a few seconds, and the rendezvous
    inside ``init`` waits under it too; ranks that take longer than that to import torch on a
    loaded machine would fail there, before any fault is injected. Starting together keeps that
    wait short."""
    if store is None:
        return
    store.add(_STARTED, 1)
    deadline = time.time() + bound_s
    while store.add(_STARTED, 0) < world:
        if time.time() > deadline:
            raise TimeoutError(f"only {store.add(_STARTED, 0)} of {world} ranks started within {bound_s:g} s")
        time.sleep(0.02)


def trace_dir(name: str, rank: int, store: Any) -> tuple[str, bool]:
    """The scenario's trace directory and whether this rank made it (and so removes it, see
    :func:`finish`): ``COMMOPS_TRACE_DIR`` if set; else a private directory made by rank 0 (or
    by a rank with no store to share it through) and read by the others from ``store``."""
    given = os.environ.get("COMMOPS_TRACE_DIR")
    if given:
        return given, False
    if rank == 0 or store is None:
        made = tempfile.mkdtemp(prefix=f"commops-fault-{name}-")
        if store is not None:
            store.set(_TRACE, made)
        return made, True
    return store.get(_TRACE).decode(), False


def finish(trace: str, made: bool, store: Any, world: int, bound_s: float = 20.0, wait_all: bool = False) -> None:
    """Count this rank's record as written; the rank that made ``trace`` then waits (at most
    ``bound_s``: a crashed rank never counts, and the launcher stops the rest within 30 s) for
    every rank's and removes it."""
    try:
        if store is not None:
            store.add(_FINISHED, 1)
        deadline = time.time() + bound_s
        # (``wait_all``: every rank waits, so that a rank that failed at once does not exit, and
        # have torchrun stop the others, before they have seen its failure)
        while (made or wait_all) and store is not None and store.add(_FINISHED, 0) < world \
                and time.time() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the launcher's store is gone (the job is ending): remove now
        pass
    if made:
        shutil.rmtree(trace, ignore_errors=True)
        print(f"removed {trace} (set COMMOPS_TRACE_DIR to keep the dumps and outcomes)", flush=True)


def run(name: str, inject: str, expect: str, body: Callable[[C.Communicator, int, Any], Any], *, debug: bool = False,
        warmup: int = 3, long_timeout: bool = False) -> int:
    """Start, announce, run ``warmup`` good calls, then ``body(comm, culprit, device)`` inside a
    ``call_timeout`` of the scenario's timeout (which bounds NCCL's waits on the host too);
    record the outcome. With ``long_timeout`` the group keeps torch's default of 30 minutes and
    no ``call_timeout`` bounds the call: what ends the wait must be the library's own detection."""
    timeout = 1800.0 if long_timeout else float(os.environ.get("FAULT_TIMEOUT_S", "5"))
    store = _launcher_store()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _start_together(store, world)
    trace, made = trace_dir(name, int(os.environ.get("RANK", "0")), store)
    comm = C.init(timeout=datetime.timedelta(seconds=timeout), trace_dir=trace, debug=debug)
    # Record a stop by the launcher as this rank's outcome (the dump below is written either way).
    signal.signal(signal.SIGTERM, _stop)
    culprit = comm.size - 1
    if comm.rank == 0:
        print(f"[{name}] inject: {inject}\n[{name}] expect: {expect}\n[{name}] trace directory: {trace}"
              + (" (removed at the end)" if made else ""), flush=True)
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if comm.backend_for("cuda") else torch.device("cpu")
    for _ in range(warmup):
        C.all_reduce(torch.ones(8, device=device))
    t0 = time.time()
    outcome: dict[str, Any] = {"rank": comm.rank, "culprit": culprit, "raised": None, "fault_at": t0}
    try:
        try:
            with C.call_timeout(timeout) if not long_timeout else contextlib.nullcontext():
                body(comm, culprit, device)
                if device.type == "cuda":
                    torch.cuda.synchronize()
        finally:
            # Disarmed first, with no call before it (a handler runs at a call's entry): a SIGTERM
            # from here on, which the launcher sends once another rank has exited, no longer cuts
            # this rank's dump and outcome short.
            _ARMED[0] = False
        outcome["result"] = "returned"
    except C.CommopsError as exc:
        outcome.update(raised=type(exc).__name__, message=str(exc), missing=getattr(exc, "missing", None),
                       field=getattr(exc, "field", None), sides=getattr(exc, "sides", None))
    except Exception as exc:  # noqa: BLE001 - what the backend raised, recorded for the matrix
        outcome.update(raised=type(exc).__name__, message=str(exc)[:500])
    outcome["detect_s"] = time.time() - t0
    C.dump_trace(f"{name} ends", trace)
    Path(trace, f"outcome_rank{comm.rank}.json").write_text(json.dumps(outcome))
    print(f"[{name}] rank {comm.rank}: {outcome.get('raised') or 'no error'} after {outcome['detect_s']:.1f} s", flush=True)
    finish(trace, made, store, world, wait_all=long_timeout)
    return 1 if outcome["raised"] else 0
