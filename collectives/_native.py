"""The compiled fast path (``_fastpath.c``): built on first use, loaded, and wired to the objects it reads.

Design note. A repeated small all-reduce on peer memory is a few microseconds of GPU time and,
through the Python fast path, 8-12 us of host time on the 2xH200 machine's CPUs, of which the
kernel launch is under 5 (``bench/results/gpu_2xh200_peer_host.json``); torch's own
symmetric-memory op, compiled, costs 7-10. The rest is the interpreter running a few dozen
attribute reads and calls. ``_fastpath.c`` runs the same reads and calls from C, on the same
tables (``Communicator._fast``, the runners' prepared launches, the flight recorder's ring), so
it needs no bookkeeping of its own and either path can serve any call. Most of what is left is
torch's and Python's own attribute machinery, which C reaches through the same C API: on a 2-core
CPU the verb's cost over a launch fell from 2.0 to 1.25 us (a launch stand-in doing nothing; that
timing script was not kept), not to nothing. ``launch/bench_fastpath_host.py`` times one build of
``_fastpath.c`` against another's (a base revision's and the working tree's) in one process.

What it reads is defined once, in Python: :func:`configure` hands the C the objects and tables
the Python fast path uses, and the C builds from them rather than from copies of its own. The
recorder's entry is laid out by ``recorder.FIELDS`` (the C looks up each value's position by
name), a group's progress by ``recorder._PROGRESS_SEQ``, ``comm._fast``'s key by
``dispatch._FAST_KEY`` and ``_FAST_KEY_OUT_OF_PLACE`` (which facts of a call, in which order),
``_FAST_BY_VALUE`` (the reduce ops keyed by value) and ``_FAST_RUNNER``; a change to one of them
is made there alone. The C refuses (ValueError, naming it) a field or fact it has no code to
fill or read, and :func:`configure_cuda` then falls back to Python, warning. The checks that are
code (attribute reads and calls: contiguity, device, dtype, ``comm.debug``, ...) are written in
both ``dispatch_tensors`` and ``fast_dispatch``, on the same objects; ``_fastpath.c``'s header
lists them. Tried and rejected: generating a C header from ``FIELDS`` at build time (the layout
would then be fixed per compiled object, a second thing for the build's hash to cover, while a
tuple read at configure costs nothing per call).

It is a plain CPython extension (no torch or CUDA headers: the driver's ``cuLaunchKernel`` is
passed in as an address), compiled with the C compiler Python was built with, the way Triton
builds its launchers, into ``COMMOPS_CACHE_DIR``, and loaded from there on later runs. Where
there is no compiler, or ``COMMOPS_NATIVE=0``, the Python fast path serves every call;
:func:`status` says which.

Loading a compiled file runs its code, so nothing is loaded that another local user could have
planted or changed. The cache directory must be this user's: it is created 0700 where missing,
and an existing one must be a directory (not a symbolic link) owned by this user that neither
its group nor others can write. An object is named ``_fastpath_<tag>_<sha256><suffix>``: the tag
hashes the source, the interpreter and the compiler (a change to any of them builds anew), the
sha256 is the object's own bytes. It is opened without following a symbolic link, checked
through that descriptor (a regular file, this user's, writable by nobody else, its bytes hashing
to its name) and loaded through the same descriptor (``/proc/self/fd/N``), so that what was
checked is what runs even if the path changes meanwhile. A refused directory (another user's,
group- or world-writable, a link) is not used: the process warns once, naming it and why, builds
into a private ``tempfile.mkdtemp`` directory and removes that once the object is loaded (each
process then builds: about a second on a 2-core CPU). A refused object in a good directory is
warned about, removed and rebuilt.

Tried and rejected: raising on a refused cache (the Python path would then serve, a few
microseconds slower per call, for a reason the user may not see); a sidecar file with the
object's hash (two ranks building at once could leave one's hash beside the other's object; a
name that states its content cannot disagree with it). The hash guards against a truncated or
altered file; against other users, the owner and mode checks do. The peer-memory kernels
(``peer/_launch.py``) are compiled by CuPy and the grouped GEMM by Triton, each keeping its own
cache (``CUPY_CACHE_DIR``, ``TRITON_CACHE_DIR``; in the home directory by default); commops
writes and loads no other compiled file.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d

from . import _env
from .errors import UnsafePathError

__all__ = ["load", "build", "status", "configure", "configure_cuda"]

_SOURCE = Path(__file__).with_name("_fastpath.c")
_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"module": None, "why": "not loaded yet (no repeated GPU call so far)", "tried": False}
_WARNED: set[str] = set()  # refusals already warned about (once per path and reason)
# Descriptors of loaded objects, never closed: the dynamic loader knows a library by the name it
# was opened under (/proc/self/fd/N), and a later load under a reused N would get the old library.
_LOADED_FDS: list[int] = []


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


def _name_stem(cc: list[str]) -> str:
    """``_fastpath_<tag>``: the tag hashes the source, the interpreter and the compiler command."""
    tag = hashlib.sha256(_SOURCE.read_bytes() + sys.version.encode() + " ".join(cc).encode()).hexdigest()[:16]
    return f"_fastpath_{tag}"


def _writable_by_others(mode: int) -> bool:
    return bool(mode & (stat.S_IWGRP | stat.S_IWOTH))


def _private_dir(directory: Path) -> Path:
    """``directory``, created 0700 if missing; raises UnsafePathError unless it is a directory (not
    a link) of this user's that its group and others cannot write."""
    try:
        directory.mkdir(mode=0o700, parents=True)
        os.chmod(directory, 0o700)  # ours, just made: whatever the umask left
    except FileExistsError:
        pass
    st = os.lstat(directory)
    fix = f"remove {directory} or set COMMOPS_CACHE_DIR to a directory of your own (created 0700)"
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError("cache directory", directory, "is a symbolic link, which another user may have made "
                              "or may change", f"set COMMOPS_CACHE_DIR to the directory it points to, or {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError("cache directory", directory, "is not a directory", fix)
    _owned("cache directory", directory, st, fix, "put files there", f"chmod go-w {directory}, or {fix}")
    return directory


def _owned(what: str, path: Path, st: os.stat_result, fix: str, others_can: str, mode_fix: str) -> None:
    """Raise UnsafePathError unless ``st`` (of ``path``) is this user's and nobody else may write it."""
    if st.st_uid != os.geteuid():
        raise UnsafePathError(what, path, f"belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})", fix)
    if _writable_by_others(st.st_mode):
        raise UnsafePathError(what, path, f"has mode {stat.S_IMODE(st.st_mode):o}: its group or other users can "
                              f"{others_can}", mode_fix)


def _open_checked(path: Path) -> int:
    """A descriptor of ``path``, at its start, once ``path`` has passed the checks (a regular
    file, not a link, this user's, writable by nobody else, its bytes hashing to the hash its name
    ends in); raises UnsafePathError (or OSError: missing) otherwise. The caller closes it."""
    fix = f"remove {path}; the next run builds it anew"
    try:
        # not blocking: a FIFO of that name would otherwise hold the open forever
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):  # ELOOP: the open refused to follow it
            raise UnsafePathError("compiled object", path, "is a symbolic link", fix) from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError("compiled object", path, "is not a regular file", fix)
        _owned("compiled object", path, st, fix, "change it", fix)
        digest = hashlib.sha256()
        while chunk := os.read(fd, 1 << 20):
            digest.update(chunk)
        found = digest.hexdigest()
        stated = path.name.split(".")[0].rpartition("_")[2]
        if found != stated:
            raise UnsafePathError("compiled object", path, f"holds bytes whose sha256 is {found[:16]}..., not the "
                                  f"{stated[:16]}... its name states (truncated or altered)", fix)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _warn_once(exc: UnsafePathError, then: str) -> None:
    key = f"{exc.path}: {exc.problem}"
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"commops: the compiled fast path is not loaded from {exc}; {then}", RuntimeWarning,
                      stacklevel=3)


def build(directory: Path | None = None) -> Path:
    """Compile ``_fastpath.c`` into ``directory`` (default: the cache) unless a good object is
    there already (the module docstring says what passes); the path of the object.

    Raises:
        UnsafePathError: ``directory`` is not private to this user (nothing is built there).
        RuntimeError: the compiler failed (its output is in the message).
    """
    cc = _compiler()
    include = sysconfig.get_paths()["include"]
    stem, suffix = _name_stem(cc), importlib.machinery.EXTENSION_SUFFIXES[0]
    directory = _private_dir(_cache_dir() if directory is None else directory)
    for candidate in sorted(directory.glob(f"{stem}_*{suffix}")):
        try:
            os.close(_open_checked(candidate))
            return candidate
        except UnsafePathError as exc:
            _warn_once(exc, "removing it and building anew")
            with contextlib.suppress(OSError):  # our directory: we may remove what is in it
                os.unlink(candidate)
        except FileNotFoundError:  # removed since the listing
            pass
    # each process builds into a file of its own and renames it into place: ranks that start
    # together may all build, and none loads a half-written file
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=directory)
    os.close(fd)
    cmd = [*cc, "-O2", "-shared", "-fPIC", "-I", include, str(_SOURCE), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o700)  # the linker's mode follows the umask, which may let the group write
        digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
        target = directory / f"{stem}_{digest}{suffix}"
        os.replace(tmp, target)  # replaces a refused file (or link) of that name, never writes through it
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _import(path: Path) -> ModuleType:
    """Load the object at ``path`` once it has passed the checks, through the descriptor that was
    checked; raises UnsafePathError (nothing of it runs) if it does not."""
    fd = _open_checked(path)
    where = f"/proc/self/fd/{fd}"
    if not os.path.exists(where):  # no /proc: by its path, just checked
        os.close(fd)
        where = str(path)
    else:
        _LOADED_FDS.append(fd)
    loader = importlib.machinery.ExtensionFileLoader("collectives._fastpath", where)
    spec = importlib.util.spec_from_file_location("collectives._fastpath", where, loader=loader)
    if spec is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    module.__file__ = str(path)
    return module


def _build_and_import() -> ModuleType:
    """Build into the cache (or, where the cache is refused, into a private directory removed
    after loading) and load."""
    try:
        directory = _private_dir(_cache_dir())
    except UnsafePathError as exc:
        private = Path(tempfile.mkdtemp(prefix="commops-native-"))
        _warn_once(exc, f"building into {private} instead, for this process only")
        try:
            return _import(build(private))
        finally:
            shutil.rmtree(private, ignore_errors=True)  # loaded: the mapping outlives the file
    return _import(build(directory))


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
                _STATE["module"] = _build_and_import()
                _STATE["why"] = "loaded"
            except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as exc:
                _unavailable(exc)
        _STATE["tried"] = True
    return _STATE["module"]


def _unavailable(exc: BaseException) -> None:
    """No compiled fast path in this process, because of ``exc``: say so (:func:`status`, a warning)."""
    _STATE["module"], _STATE["why"] = None, f"not available: {exc}"
    warnings.warn(f"commops: the compiled fast path is not available ({str(exc)[:300]}); repeated small GPU "
                  "collectives take the Python path, a few microseconds slower each. COMMOPS_NATIVE=0 asks for "
                  "the Python path and silences this.", RuntimeWarning, stacklevel=3)


def status() -> str:
    """Whether the compiled fast path serves this process's calls, and if not, why."""
    return str(_STATE["why"])


# The modules whose objects the compiled module reads (dispatch's tables and hooks, the
# communicators, _wait's bounds, the flight recorder and its layout, the CUDA launcher), handed in
# by each of them when it is imported (``provide``). Their attributes are read when the module is
# configured, as they are then. This module imports none of them, so that each can import it.
_OWNERS: dict[str, ModuleType] = {}


def provide(role: str, module: ModuleType) -> None:
    """Name ``module`` as the one the compiled fast path reads ``role``'s objects from."""
    _OWNERS[role] = module


def _owner(role: str) -> ModuleType:
    module = _OWNERS.get(role)
    if module is None:  # the module did not provide itself: an internal error
        raise AssertionError(f"the compiled fast path has no {role!r} module to read from")
    return module


def configure(module: ModuleType, *, current_device: Any, current_stream: Any, launch_address: int,
              py_launch: Any, threads: int, device_flag: str = "is_cuda", graph_launch_address: int = 0,
              capturing_address: int = 0) -> None:
    """Hand ``module`` the objects the Python fast path reads. It takes tensors whose
    ``device_flag`` attribute is true and whose ``get_device()`` is ``current_device()``; the device
    accessors and the launchers are arguments so that tests can give CPU stand-ins. Prepared
    launches that carry a one-kernel graph are launched as that graph where both
    ``graph_launch_address`` (``cuGraphLaunch``) and ``capturing_address`` (``cuStreamIsCapturing``)
    are given."""
    d, c, w, r = (_owner(role) for role in ("dispatch", "communicator", "wait", "recorder"))
    module.configure(tensor_type=torch.Tensor, hooks=d._HOOKS, local=w._LOCAL, open_bounds=w._OPEN,
                     profiling=d._profiling, nvtx=_env.nvtx_enabled(), current_device=current_device,
                     current_stream=current_stream, recorder=r.RECORDER, skipped=tuple(r._SKIPPED), fail=d._failed,
                     py_launch=py_launch, launch_address=launch_address, threads=threads, device_flag=device_flag,
                     comms=c._COMMS.data, world=c._WORLD, c10d=c10d, fields=r.FIELDS, progress_seq=r._PROGRESS_SEQ,
                     fast_key=d._FAST_KEY, fast_key_out_of_place=d._FAST_KEY_OUT_OF_PLACE, by_value=d._FAST_BY_VALUE,
                     runner_index=d._FAST_RUNNER, graph_launch_address=graph_launch_address,
                     capturing_address=capturing_address)


def configure_cuda() -> ModuleType | None:
    """:func:`load`, configured for CUDA (torch's current device and stream, the driver's launch)."""
    module = load()
    if module is None or _STATE.get("configured"):
        return module
    launcher, validate = _owner("launch"), _owner("validate")
    try:
        address = ctypes.cast(ctypes.CDLL("libcuda.so.1").cuLaunchKernel, ctypes.c_void_p).value
    except (OSError, AttributeError) as exc:
        _STATE["module"], _STATE["why"] = None, f"not available: no CUDA driver ({exc})"
        return None
    graph_launch = capturing = 0
    if _env.GRAPH_LAUNCH.get():
        try:
            graph_launch, capturing = launcher.graph_addresses()
        except (OSError, AttributeError):  # a driver without them: kernel launches
            pass
    try:
        configure(module, current_device=validate._current_device, current_stream=launcher.current_stream,
                  launch_address=int(address or 0), py_launch=launcher.launch, threads=launcher.THREADS,
                  graph_launch_address=graph_launch, capturing_address=capturing)
    except ValueError as exc:  # a definition the compiled module cannot follow (the message says which)
        _unavailable(exc)
        return None
    _STATE["configured"] = True
    return module
