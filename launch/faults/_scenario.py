"""What every fault scenario shares: start the group, inject, record what each rank saw.

A scenario runs under torchrun (3 ranks or more; the culprit is the last rank) with
``COMMOPS_TRACE_DIR`` set; every rank writes ``outcome_rank<R>.json`` there (what it raised and how
long after the fault it noticed), and the flight recorder's dumps land beside it.
``FAULT_TIMEOUT_S`` (default 5) is the group's collective timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
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


def _start_together(bound_s: float = 120.0) -> None:
    """Wait until every rank of this torchrun job has started (bounded), on the launcher's store.

    The group's timeout is the scenario's collective timeout, a few seconds, and the rendezvous
    inside ``init`` waits under it too; ranks that take longer than that to import torch on a
    loaded machine would fail there, before any fault is injected. Starting together keeps that
    wait short."""
    import torch.distributed as dist

    addr, port, world = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), os.environ.get("WORLD_SIZE")
    if not (addr and port and world):
        return
    store = dist.TCPStore(addr, int(port), int(world), is_master=False,
                          timeout=datetime.timedelta(seconds=bound_s))
    key = "commops_fault_scenario_started"
    store.add(key, 1)
    deadline = time.time() + bound_s
    while store.add(key, 0) < int(world):
        if time.time() > deadline:
            raise TimeoutError(f"only {store.add(key, 0)} of {world} ranks started within {bound_s:g} s")
        time.sleep(0.02)


def run(name: str, inject: str, expect: str, body: Callable[[C.Communicator, int, Any], Any], *, debug: bool = False,
        warmup: int = 3) -> int:
    """Start, announce, run ``warmup`` good calls, then ``body(comm, culprit, device)`` inside a
    ``call_timeout`` of the scenario's timeout (which bounds NCCL's waits on the host too);
    record the outcome."""
    timeout = float(os.environ.get("FAULT_TIMEOUT_S", "5"))
    trace = os.environ.get("COMMOPS_TRACE_DIR") or f"/tmp/commops-fault-{name}"
    _start_together()
    comm = C.init(timeout=datetime.timedelta(seconds=timeout), trace_dir=trace, debug=debug)
    # Record a stop by the launcher as this rank's outcome (the dump below is written either way).
    signal.signal(signal.SIGTERM, _stop)
    culprit = comm.size - 1
    if comm.rank == 0:
        print(f"[{name}] inject: {inject}\n[{name}] expect: {expect}", flush=True)
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if comm.backend_for("cuda") else torch.device("cpu")
    for _ in range(warmup):
        C.all_reduce(torch.ones(8, device=device))
    outcome: dict[str, Any] = {"rank": comm.rank, "culprit": culprit, "raised": None}
    t0 = time.time()
    try:
        try:
            with C.call_timeout(timeout):
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
        outcome.update(raised=type(exc).__name__, message=str(exc), missing=getattr(exc, "missing", None))
    except Exception as exc:  # noqa: BLE001 - what the backend raised, recorded for the matrix
        outcome.update(raised=type(exc).__name__, message=str(exc)[:500])
    outcome["detect_s"] = time.time() - t0
    C.dump_trace(f"{name} ends", trace)
    Path(trace, f"outcome_rank{comm.rank}.json").write_text(json.dumps(outcome))
    print(f"[{name}] rank {comm.rank}: {outcome.get('raised') or 'no error'} after {outcome['detect_s']:.1f} s", flush=True)
    return 1 if outcome["raised"] else 0
