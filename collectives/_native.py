"""The compiled fast path (``_fastpath.c``): built on first use, loaded, and wired to the objects it reads.

Design note. A repeated small all-reduce on peer memory is a few microseconds of GPU time and,
through the Python fast path, 8-12 us of host time on the 2xH200 machine's CPUs, of which the
kernel launch is under 5 (``bench/results/gpu_2xh200_peer_host.json``); torch's own
symmetric-memory op, compiled, costs 7-10. The rest is the interpreter running a few dozen
attribute reads and calls. ``_fastpath.c`` runs the same reads and calls from C, on the same
tables (``Communicator._fast``, the runners' prepared launches, the flight recorder's ring), so
it needs no bookkeeping of its own and either path can serve any call. Most of what is left is
torch's and Python's own attribute machinery, which C reaches through the same C API: on a 2-core
CPU the verb's cost over a launch fell from 2.0 to 1.25 us (a launch stand-in doing nothing; a
timing script, not kept), not to nothing.

It is a plain CPython extension (no torch or CUDA headers: the driver's ``cuLaunchKernel`` is
passed in as an address), compiled with the C compiler Python was built with, the way Triton
builds its launchers, into ``COMMOPS_CACHE_DIR`` under a name that hashes the source, the
interpreter and the compiler, and loaded from there on later runs. Where there is no compiler,
or ``COMMOPS_NATIVE=0``, the Python fast path serves every call; :func:`status` says which.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from . import _env

__all__ = ["load", "build", "status", "configure", "configure_cuda"]

_SOURCE = Path(__file__).with_name("_fastpath.c")
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"module": None, "why": "not loaded yet (no repeated GPU call so far)", "tried": False}


def _compiler() -> list[str]:
    """``$CC`` if set; else the compiler Python was built with, where this machine has it; else ``cc``."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    built_with = shlex.split(sysconfig.get_config_var("CC") or "")
    if built_with and shutil.which(built_with[0]):
        return built_with
    return ["cc"]


def _cache_dir() -> Path:
    configured = _env.CACHE_DIR.get()
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "commops"


def build(directory: Path | None = None) -> Path:
    """Compile ``_fastpath.c`` into ``directory`` (default: the cache) unless it is there already;
    the path of the extension. Raises ``RuntimeError`` with the compiler's output on failure."""
    source = _SOURCE.read_bytes()
    cc = _compiler()
    include = sysconfig.get_paths()["include"]
    tag = hashlib.sha256(source + sys.version.encode() + " ".join(cc).encode()).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    directory = _cache_dir() if directory is None else directory
    target = directory / f"_fastpath_{tag}{suffix}"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    # each process builds into a file of its own and renames it into place: ranks that start
    # together may all build, and none loads a half-written file
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=directory)
    os.close(fd)
    cmd = [*cc, "-O2", "-shared", "-fPIC", "-I", include, str(_SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("collectives._fastpath", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> ModuleType | None:
    """The compiled module (built on the first call of the process if needed), or None where it
    cannot be had (:func:`status` says why). Tried once per process."""
    if _STATE["tried"]:
        return _STATE["module"]
    with _LOCK:
        if _STATE["tried"]:
            return _STATE["module"]
        if not _env.NATIVE.get():
            _STATE["why"] = "off (COMMOPS_NATIVE=0)"
        else:
            try:
                _STATE["module"] = _import(build())
                _STATE["why"] = "loaded"
            except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as exc:
                _STATE["why"] = f"not available: {exc}"
                warnings.warn(f"commops: the compiled fast path is not available ({str(exc)[:300]}); repeated "
                              "small GPU collectives take the Python path, a few microseconds slower each. "
                              "COMMOPS_NATIVE=0 asks for the Python path and silences this.", RuntimeWarning,
                              stacklevel=2)
        _STATE["tried"] = True
    return _STATE["module"]


def status() -> str:
    """Whether the compiled fast path serves this process's calls, and if not, why."""
    return str(_STATE["why"])


def configure(module: ModuleType, *, current_device: Any, current_stream: Any, launch_address: int,
              py_launch: Any, threads: int, device_flag: str = "is_cuda", graph_launch_address: int = 0,
              capturing_address: int = 0) -> None:
    """Hand ``module`` the objects the Python fast path reads. It takes tensors whose
    ``device_flag`` attribute is true and whose ``get_device()`` is ``current_device()``; the device
    accessors and the launchers are arguments so that tests can give CPU stand-ins. Prepared
    launches that carry a one-kernel graph are launched as that graph where both
    ``graph_launch_address`` (``cuGraphLaunch``) and ``capturing_address`` (``cuStreamIsCapturing``)
    are given."""
    import torch

    import torch.distributed.distributed_c10d as c10d

    from .communicator import _COMMS, _WORLD
    from .dispatch import _HOOKS, _failed, _profiling
    from ._wait import _LOCAL, _OPEN
    from .recorder import _SKIPPED, RECORDER

    module.configure(tensor_type=torch.Tensor, hooks=_HOOKS, local=_LOCAL, open_bounds=_OPEN, profiling=_profiling,
                     nvtx=_env.nvtx_enabled(), current_device=current_device, current_stream=current_stream,
                     recorder=RECORDER, skipped=tuple(_SKIPPED), fail=_failed, py_launch=py_launch,
                     launch_address=launch_address, threads=threads, device_flag=device_flag,
                     comms=_COMMS.data,  # type: ignore[attr-defined]  # weak reference -> communicator
                     world=_WORLD, c10d=c10d, graph_launch_address=graph_launch_address,
                     capturing_address=capturing_address)


def configure_cuda() -> ModuleType | None:
    """:func:`load`, configured for CUDA (torch's current device and stream, the driver's launch)."""
    module = load()
    if module is None or _STATE.get("configured"):
        return module
    from ._validate import _current_device
    from .peer import _launch

    try:
        address = ctypes.cast(ctypes.CDLL("libcuda.so.1").cuLaunchKernel, ctypes.c_void_p).value
    except (OSError, AttributeError) as exc:
        _STATE["module"], _STATE["why"] = None, f"not available: no CUDA driver ({exc})"
        return None
    graph_launch = capturing = 0
    if _env.GRAPH_LAUNCH.get():
        try:
            graph_launch, capturing = _launch.graph_addresses()
        except (OSError, AttributeError):  # a driver without them: kernel launches
            pass
    configure(module, current_device=_current_device, current_stream=_launch.current_stream,
              launch_address=int(address or 0), py_launch=_launch.launch, threads=_launch.THREADS,
              graph_launch_address=graph_launch, capturing_address=capturing)
    _STATE["configured"] = True
    return module
