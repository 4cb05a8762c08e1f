"""Every environment variable commops reads, declared once with its type, default and meaning.

Variables share the ``COMMOPS_`` prefix and are read lazily and cached (only ``COMMOPS_RECORDER``
at import, by the flight recorder, so a bad value of it makes ``import collectives`` raise);
library code never writes ``os.environ``. Launcher variables (``RANK``, ``LOCAL_RANK``, ...) are not here:
only :mod:`collectives.bootstrap` reads them, to start torch.distributed the way the launcher asks.

Values are parsed strictly. A switch takes 1/0, true/false, yes/no, on/off, enable/disable or
enabled/disabled (any case, spaces around ignored); a number takes what ``int``/``float`` read.
Anything else raises :class:`~collectives.errors.InvalidSettingError` naming the variable, the
value and what it accepts, where the setting is first read. An empty value counts as unset (the
default). Design note: a switch used to be on for any value outside a short list of "off"
words, so ``COMMOPS_RECORDER=disable`` left the recorder on without a word; a setting that
silently means the opposite of what was written is worse than one that refuses to start.

Those that the ranks of a group act on together (peer bytes, tuned tables, topology override, debug
mode, calibration) must be the same on every rank: :mod:`collectives._agree` checks them before a
communicator's first collective.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import InvalidSettingError

__all__ = ["EnvVar", "NVTX", "VARIABLES", "TRUE_WORDS", "FALSE_WORDS"]

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    doc: str

    def get(self) -> T:
        return _read(self)  # type: ignore[return-value]

    def is_set(self) -> bool:
        """Whether the environment sets this variable to a value (its default is then not in use)."""
        return bool(os.environ.get(self.name, "").strip())


TRUE_WORDS = ("1", "true", "yes", "on", "enable", "enabled")
FALSE_WORDS = ("0", "false", "no", "off", "disable", "disabled")


def _switch(name: str, raw: str, extra: tuple[str, ...] = ()) -> bool | str:
    """``raw`` (the value of variable ``name``) as a switch: True or False, or one of ``extra``
    (lower-cased) where it is one of those. Raises InvalidSettingError for anything else."""
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    if word in extra:
        return word
    accepted = "/".join(extra + TRUE_WORDS) + " or " + "/".join(FALSE_WORDS)
    raise InvalidSettingError(name, raw, f"is not a switch commops reads (it accepts {accepted}, any case)",
                              f"set {name}=1 to turn it on or {name}=0 to turn it off, or unset it for the default")


def _parse(var: EnvVar, raw: str) -> object:  # type: ignore[type-arg]
    default = var.default
    if not raw.strip() and not isinstance(default, str):
        return default  # empty: as if unset
    if isinstance(default, bool):  # before int: a bool is an int
        return _switch(var.name, raw)
    for kind, what in ((int, "a whole number"), (float, "a number")):
        if isinstance(default, kind):
            try:
                return kind(raw)
            except ValueError:
                raise InvalidSettingError(var.name, raw, f"is not {what}",
                                          f"set {var.name} to {what} such as {default!r}, or unset it for that "
                                          "default") from None
    return raw


@functools.cache
def _read(var: EnvVar) -> object:  # type: ignore[type-arg]
    raw = os.environ.get(var.name)
    return var.default if raw is None else _parse(var, raw)


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
    "Path of a topology JSON file that replaces discovery (Communicator.topology).",
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
    "peer-memory call of a communicator; larger messages run in pieces of at most this. Must be the "
    "same on every rank (collectives/_agree.py raises SettingsMismatch otherwise).",
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

KERNELS_TUNED: EnvVar[str] = EnvVar(
    "COMMOPS_KERNELS_TUNED", "",
    "Path of a kernel table (launch/tune_kernels.py) whose measured launch configurations the Triton "
    "kernels take (overlap/_kernel_tuning.py); shapes it lacks take the cost model's pick.",
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
CHECK_AFTER_S: EnvVar[float] = EnvVar(
    "COMMOPS_CHECK_AFTER_S", 2.0,
    "Seconds a collective on a CPU backend waits for its peers before the waiting ranks compare the "
    "pending call's fingerprint through the store (collectives/_watch.py); a difference raises "
    "CollectiveMismatch on them at once instead of waiting out the timeout. Costs nothing before then.",
)
CACHE_DIR: EnvVar[str] = EnvVar(
    "COMMOPS_CACHE_DIR", "",
    "Where compiled helpers are kept (default: $XDG_CACHE_HOME/commops, else ~/.cache/commops).",
)

VARIABLES = (NVTX, MPI_MASTER_ADDR, TOPOLOGY, CALIBRATION, TUNED, PEER_BYTES, PEER_TIMEOUT_S, OVERLAP_TUNED,
             KERNELS_TUNED, TRACE_DIR, DEBUG, RECORDER, NATIVE, GRAPH_LAUNCH, CHECK_AFTER_S, CACHE_DIR)


@functools.cache
def nvtx_enabled() -> bool:
    """Whether collectives on CUDA tensors get NVTX ranges (``COMMOPS_NVTX``: a switch or 'auto')."""
    mode = _switch(NVTX.name, NVTX.get().strip() or NVTX.default, extra=("auto",))
    if mode == "auto":
        return bool(os.environ.get("NVTX_INJECTION64_PATH"))
    return bool(mode)
