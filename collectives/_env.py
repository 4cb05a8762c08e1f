"""Every environment variable commops reads, declared once with its type, default and meaning.

Variables share the ``COMMOPS_`` prefix and are read lazily (never at import) and cached; library
code never writes ``os.environ``. Launcher variables (``RANK``, ``LOCAL_RANK``, ...) are not here:
only :mod:`collectives.bootstrap` reads them, to start torch.distributed the way the launcher asks.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["EnvVar", "NVTX", "VARIABLES"]

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    doc: str

    def get(self) -> T:
        return _read(self)  # type: ignore[return-value]

    def is_set(self) -> bool:
        """Whether the environment sets this variable (its default is then not in use)."""
        return self.name in os.environ


def _parse(raw: str, default: object) -> object:
    if isinstance(default, bool):
        return raw.strip().lower() not in ("0", "false", "no", "off", "")
    if isinstance(default, int):
        return int(raw)
    if isinstance(default, float):
        return float(raw)
    return raw


@functools.cache
def _read(var: EnvVar) -> object:  # type: ignore[type-arg]
    raw = os.environ.get(var.name)
    return var.default if raw is None else _parse(raw, var.default)


NVTX: EnvVar[str] = EnvVar(
    "COMMOPS_NVTX", "auto",
    "NVTX ranges named after op, algorithm and bytes around every collective on CUDA tensors: "
    "'1' always, '0' never, 'auto' (default) while an NVTX tool such as Nsight Systems is attached "
    "(it sets NVTX_INJECTION64_PATH). A range costs about 13 us of host time per call on the "
    "2xH200 machine (bench/results/), which is why it is not always on.",
)
MPI_MASTER_ADDR: EnvVar[str] = EnvVar(
    "COMMOPS_MASTER_ADDR", "",
    "Under mpiexec: the address the other ranks use to reach rank 0's store "
    "(default: 127.0.0.1 when every rank is on one host, else rank 0's host name).",
)

TOPOLOGY: EnvVar[str] = EnvVar(
    "COMMOPS_TOPOLOGY", "",
    "Path of a topology JSON file that replaces discovery (topology.discover).",
)

CALIBRATION: EnvVar[str] = EnvVar(
    "COMMOPS_CALIBRATION", "",
    "Path of a calibration file (launch/calibrate.py) for algorithm='auto'; default: a shipped one "
    "in topology/calibrations/ that matches the backend, device and node count, if any.",
)

TUNED: EnvVar[str] = EnvVar(
    "COMMOPS_TUNED", "",
    "Path of a tuned table (bench CLI --tune) whose measured choices algorithm='auto' follows first.",
)

PEER_BYTES: EnvVar[int] = EnvVar(
    "COMMOPS_PEER_BYTES", 64 << 20,
    "Bytes of each rank's peer-memory slot buffer (collectives/peer), allocated on the first "
    "peer-memory call of a communicator; larger messages run in pieces of at most this.",
)
PEER_TIMEOUT_S: EnvVar[float] = EnvVar(
    "COMMOPS_PEER_TIMEOUT_S", 60.0,
    "Seconds a peer-memory kernel waits for a peer's flag before it gives up and records which "
    "peer did not arrive (raised as CollectiveTimeout on the next call or PeerMemory.check()).",
)

OVERLAP_TUNED: EnvVar[str] = EnvVar(
    "COMMOPS_OVERLAP_TUNED", "",
    "Path of a tuned table (launch/bench_overlap.py --tune, launch/bench_moe.py --tune) whose measured "
    "strategies the overlap operators' strategy='auto' and MoEDispatcher.forward_pipelined(chunks='auto') follow.",
)

TRACE_DIR: EnvVar[str] = EnvVar(
    "COMMOPS_TRACE_DIR", "",
    "Directory for the flight recorder's dumps (one JSON file per rank), written when a collective "
    "raises, on SIGUSR1 or SIGTERM, or on collectives.dump_trace(); read by python -m collectives.diagnose.",
)

DEBUG: EnvVar[bool] = EnvVar(
    "COMMOPS_DEBUG", False,
    "Debug check mode: before every collective the ranks compare a fingerprint of the call (op, "
    "algorithm, shapes, dtype, reduce op, root, sequence number) through the store, and all raise "
    "CollectiveMismatch naming the disagreement (collectives/debug.py; costs a store round trip per call).",
)

RECORDER: EnvVar[bool] = EnvVar(
    "COMMOPS_RECORDER", True,
    "The flight recorder (collectives/recorder.py): on by default; '0' turns it off (its cost per "
    "call is in the README).",
)

NATIVE: EnvVar[bool] = EnvVar(
    "COMMOPS_NATIVE", True,
    "The compiled fast path for repeated small GPU collectives (collectives/_native.py): built with "
    "the system C compiler on the first repeatable GPU call and cached in COMMOPS_CACHE_DIR; '0' keeps "
    "the Python fast path, which does the same work.",
)
GRAPH_LAUNCH: EnvVar[bool] = EnvVar(
    "COMMOPS_GRAPH_LAUNCH", True,
    "The compiled fast path launches a repeated one-kernel call as a one-node CUDA graph "
    "(cuGraphLaunch), which costs the host less than cuLaunchKernel (collectives/peer/_launch.py); "
    "'0' launches the kernel.",
)
CACHE_DIR: EnvVar[str] = EnvVar(
    "COMMOPS_CACHE_DIR", "",
    "Where compiled helpers are kept (default: $XDG_CACHE_HOME/commops, else ~/.cache/commops).",
)

VARIABLES = (NVTX, MPI_MASTER_ADDR, TOPOLOGY, CALIBRATION, TUNED, PEER_BYTES, PEER_TIMEOUT_S, OVERLAP_TUNED,
             TRACE_DIR, DEBUG, RECORDER, NATIVE, GRAPH_LAUNCH, CACHE_DIR)


@functools.cache
def nvtx_enabled() -> bool:
    mode = NVTX.get().strip().lower()
    if mode == "auto":
        return bool(os.environ.get("NVTX_INJECTION64_PATH"))
    return mode not in ("0", "false", "no", "off", "")
