"""Compiling and launching the peer-memory kernels: pointers, sizes and a stream in, nothing else.

A module is one source compiled after the common header ``peer.cuh`` (types, flags, the
barrier, packs, ``struct Ctx``): ``kernels.cu`` for the collectives, or another source that
ships its own kernels against the same context (``overlap/moe/rows.cu``, the MoE row kernels).
The header and the source are concatenated into one text, each behind a ``#line`` directive
that names its file (an ``#include`` would need an include path that NVRTC resolves the same
way wherever the package is installed). Each module is compiled by NVRTC (through CuPy) on first
use for the current device, never at import, and kept per (device, sources). commops writes no
file for it; CuPy keeps the compiled binary in its own cache (``CUPY_CACHE_DIR``, default
``~/.cupy/kernel_cache``, which should be private to the user; ``CUPY_CACHE_IN_MEMORY=1`` keeps
it in memory). Launches go to torch's current stream, so they order with the caller's work and
are captured by ``torch.cuda.graph`` like any other kernel.

Design note: a launch is on the path of every small collective, whose whole budget is a few
microseconds of host time. CuPy's ``RawKernel.__call__`` converts its arguments on every call
(about 6 us on the 2xH200 machine's CPUs), so launches go to the driver's ``cuLaunchKernel``
with the arguments written into a parameter block that is built once per entry point and
communicator; CuPy only compiles and loads the module. The call into the driver is CuPy's
compiled ``launchKernel``, with ctypes as the fallback where CuPy lacks it: in a probe on the
2xH200 host (2026-11-30, not kept) it took 5.1 us per launch against 7.0 us through ctypes; the
bare launch is 3.6 us in ``bench/results/gpu_2xh200_peer_host.json``, on a faster host. A caller that repeats the same
arguments (the same tensor, again and again, as small all-reduces in a decode loop do) can keep
a prepared block (``Kernel.prepare``) and launch it with no argument writes at all. The compiled
runner (``collectives/_fastpath.c``) goes one step further and launches such a block as a
one-node CUDA graph (``OneKernelGraph``): the driver takes about half the host time for
``cuGraphLaunch`` that it takes for ``cuLaunchKernel``, whatever the parameter block's size.

Driver calls act on the calling thread's current context. A thread that has made no CUDA runtime
call of its own (autograd's device thread running a backward on device 0 is one: torch skips
setting a device that already reads as current) has none, and the driver answers
``CUDA_ERROR_INVALID_CONTEXT``; the launch then makes the device's primary context (the one
torch and CuPy use) current on that thread and tries once more.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from pathlib import Path
from typing import Any

import torch

from .. import _native

__all__ = ["Kernel", "OneKernelGraph", "THREADS", "HEADER", "KERNELS", "sources_of", "compile_module", "current_stream",
           "copy_async", "write_value", "launch"]

_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context is current on this thread

THREADS = 512  # must match __launch_bounds__ in the sources
HEADER = Path(__file__).with_name("peer.cuh")  # compiled in front of every source
KERNELS = Path(__file__).with_name("kernels.cu")  # the collectives' kernels


def sources_of(source: Path | None = None) -> tuple[Path, ...]:
    """The texts of one module, in order: the header, then ``source`` (default ``kernels.cu``)."""
    return (HEADER, KERNELS if source is None else source)


def _code(sources: tuple[Path, ...]) -> str:
    return "".join(f'#line 1 "{f.name}"\n{f.read_text()}\n' for f in sources)


@functools.cache
def _module(device: int, sources: tuple[Path, ...]) -> Any:
    import cupy  # deferred: CuPy (and its CUDA libraries) loads on first use, never at import

    with cupy.cuda.Device(device):
        return cupy.RawModule(code=_code(sources), options=("--std=c++17",))


def compile_module(device: int, entry: str, source: Path | None = None) -> None:
    """Compile and load the module of ``source`` (default ``kernels.cu``) for ``device`` now, if
    it is not yet, as a first launch would: CuPy compiles a module when its first function is
    looked up (``entry``, one of its entry points), not when it is made."""
    _function(entry, device, sources_of(source))


@functools.cache
def _driver() -> Any:
    # No argtypes: every argument is passed as a ready ctypes object (converting Python ints on
    # each call is most of what a ctypes call costs).
    f = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
    f.restype = ctypes.c_int
    return f


@functools.cache
def _primary_context(device: int) -> ctypes.c_void_p:
    lib = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    rc = lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(device))
    if rc == 0:
        rc = lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)  # held for the life of the process
    if rc:
        raise RuntimeError(f"cannot get the primary context of CUDA device {device}: driver error {rc}")
    return ctx


def bind_context(device: int | None = None) -> None:
    """Make ``device``'s primary context (default: torch's current device) current on this thread."""
    d = torch.cuda.current_device() if device is None else device
    rc = ctypes.CDLL("libcuda.so.1").cuCtxSetCurrent(_primary_context(d))
    if rc:
        raise RuntimeError(f"cuCtxSetCurrent for CUDA device {d} failed with CUDA driver error {rc}")


_ONE, _ZERO, _THREADS = ctypes.c_uint(1), ctypes.c_uint(0), ctypes.c_uint(THREADS)
_GRIDS = [ctypes.c_uint(i) for i in range(4097)]


class _DriverError(RuntimeError):
    def __init__(self, status: int) -> None:
        super().__init__(f"CUDA driver error {status}")
        self.status = status


def _ctypes_launch(fn: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, stream: int,
                   params: int, extra: int) -> None:
    rc = _driver()(ctypes.c_void_p(fn), _GRIDS[gx], _ONE, _ONE, _THREADS, _ONE, _ONE, _ZERO,
                   ctypes.c_void_p(stream), ctypes.c_void_p(params), None)
    if rc:
        raise _DriverError(rc)


def _first_launch(*args: int) -> None:
    """Pick the launcher on first use (CuPy's compiled ``launchKernel``, else ctypes), then launch."""
    global _launch_fn, _launch_errors
    try:
        from cupy.cuda import driver  # deferred: as in _module

        _launch_fn, _launch_errors = driver.launchKernel, (_DriverError, driver.CUDADriverError)
    except (ImportError, AttributeError):  # both or neither
        _launch_fn = _ctypes_launch
    _launch_fn(*args)


# cuLaunchKernel(fn, grid x/y/z, block x/y/z, shared bytes, stream, params, extra), raising on a bad status
_launch_fn: Any = _first_launch
_launch_errors: tuple[type[BaseException], ...] = (_DriverError,)


def launch(fn: int, blocks: int, stream: int, params: int, name: str = "kernel", device: int | None = None) -> None:
    """Launch the loaded function ``fn`` on ``blocks`` x ``THREADS`` threads on ``stream`` with the
    parameter block at address ``params`` (an array of pointers to each argument); ``device``, where
    ``fn`` is loaded (default: torch's current one), is whose context a thread without one gets."""
    try:
        _launch_fn(fn, blocks, 1, 1, THREADS, 1, 1, 0, stream, params, 0)
    except _launch_errors as exc:
        status = getattr(exc, "status", None)
        if status != _INVALID_CONTEXT:
            raise RuntimeError(f"cuLaunchKernel({name}) failed with CUDA driver error {status}") from exc
        bind_context(device)
        try:
            _launch_fn(fn, blocks, 1, 1, THREADS, 1, 1, 0, stream, params, 0)
        except _launch_errors as again:
            raise RuntimeError(f"cuLaunchKernel({name}) failed with CUDA driver error "
                               f"{getattr(again, 'status', None)}") from again


def _raw_stream_fn() -> Any:
    # torch's own accessor of the current cudaStream_t (what its compiled kernels launch on);
    # the public route builds a Stream object per call.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


current_stream = _raw_stream_fn()


@functools.cache
def _function(name: str, device: int, sources: tuple[Path, ...]) -> Any:
    import cupy  # deferred: as in _module

    with cupy.cuda.Device(device):
        return _module(device, sources).get_function(name).kernel  # the loaded CUfunction (compiles on first use)


class Prepared:
    """A parameter block of one kernel with its arguments in place: ``launch(kernel.fn, blocks,
    stream, prepared.params)``. It holds the block, so it must live as long as its address is used."""

    __slots__ = ("params", "_keep")

    def __init__(self, params: int, keep: tuple[Any, ...]) -> None:
        self.params = params
        self._keep = keep


class Kernel:
    """One entry point of a module (``sources``: the header, then the source that defines it)
    bound to one context: launched with its other arguments on a stream.

    The context (``struct Ctx``, passed by value) is copied into the parameter block once; a launch
    writes the ``nargs`` 8-byte arguments that follow it and calls ``cuLaunchKernel``. Not
    thread-safe: one communicator's calls come from one thread at a time. ``prepare`` builds a
    block of its own for one set of arguments, launched with no writes at all.
    """

    __slots__ = ("name", "_device", "_fn", "fn", "_ctx", "_args", "_params", "params", "_n")

    def __init__(self, name: str, device: int, ctx: bytes, nargs: int = 4,
                 sources: tuple[Path, ...] = (HEADER, KERNELS)) -> None:
        self.name = name
        self._device = device
        self._fn = _function(name, device, sources)
        self.fn = int(self._fn.ptr)
        self._ctx = ctypes.create_string_buffer(ctx, len(ctx))
        self._n = nargs
        self._args, self._params = self._block()
        self.params = ctypes.addressof(self._params)

    def _block(self) -> tuple[Any, Any]:
        args = (ctypes.c_uint64 * self._n)()
        base = ctypes.addressof(args)
        params = (ctypes.c_void_p * (self._n + 1))(ctypes.addressof(self._ctx), *(base + 8 * i for i in range(self._n)))
        return args, params

    def __call__(self, blocks: int, stream: int, *args: int) -> None:
        a = self._args
        for i, v in enumerate(args):
            a[i] = v
        launch(self.fn, blocks, stream, self.params, self.name, self._device)

    def prepare(self, *args: int) -> Prepared:
        """A parameter block of its own holding ``args`` (and this kernel's context)."""
        block, params = self._block()
        for i, v in enumerate(args):
            block[i] = v
        return Prepared(ctypes.addressof(params), (block, params, self._ctx))


class _NodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2 (kern and ctx left NULL: the function's own)
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.cache
def _graph_api() -> dict[str, Any]:
    lib = ctypes.CDLL("libcuda.so.1")
    api = {name: getattr(lib, name) for name in ("cuGraphCreate", "cuGraphAddKernelNode_v2", "cuGraphInstantiateWithFlags",
                                                 "cuGraphDestroy", "cuGraphExecDestroy", "cuGraphLaunch",
                                                 "cuStreamIsCapturing")}
    for f in api.values():
        f.restype = ctypes.c_int
    return api


def graph_addresses() -> tuple[int, int]:
    """The driver's ``cuGraphLaunch`` and ``cuStreamIsCapturing``, for the compiled fast path."""
    api = _graph_api()
    return tuple(int(ctypes.cast(api[n], ctypes.c_void_p).value or 0)  # type: ignore[return-value]
                 for n in ("cuGraphLaunch", "cuStreamIsCapturing"))


class OneKernelGraph:
    """One kernel launch (a function, its grid and a prepared parameter block) as an executable
    CUDA graph of one node, for calls that repeat it: ``cuGraphLaunch`` of it costs the host
    about 1.1-1.5 us where ``cuLaunchKernel`` costs 2.8-3.2 (a bare C loop of each on the 2xH200
    host, 2026-12-01). It runs the same kernel with the same arguments, ordered on the stream it
    is launched on like the kernel would be (and behind its own previous launch). It cannot be
    launched into a stream being captured: there the kernel is launched instead. Like ``Kernel``
    it is not for two threads at once (one communicator's calls come from one thread at a time).
    The arguments
    are copied into the node when it is made; the graph is freed at once (the executable does not
    need it) and the executable with this object (in flight, it is freed when it completes)."""

    __slots__ = ("handle",)

    def __init__(self, fn: int, blocks: int, params: int) -> None:
        self.handle = 0
        api = _graph_api()
        graph, node, exe = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        p = _NodeParams(fn, (blocks, 1, 1), (THREADS, 1, 1), 0, params, None, None, None)
        rc = api["cuGraphCreate"](ctypes.byref(graph), ctypes.c_uint(0))
        if rc:
            raise RuntimeError(f"cuGraphCreate failed with CUDA driver error {rc}")
        try:
            rc = api["cuGraphAddKernelNode_v2"](ctypes.byref(node), graph, None, ctypes.c_size_t(0), ctypes.byref(p))
            if not rc:
                rc = api["cuGraphInstantiateWithFlags"](ctypes.byref(exe), graph, ctypes.c_ulonglong(0))
            if rc:
                raise RuntimeError(f"making a one-kernel CUDA graph failed with CUDA driver error {rc}")
        finally:
            api["cuGraphDestroy"](graph)
        self.handle = int(exe.value or 0)

    def __del__(self) -> None:
        if self.handle:
            try:
                _graph_api()["cuGraphExecDestroy"](ctypes.c_void_p(self.handle))
            except Exception:  # interpreter shutdown: the driver library may be gone
                pass
            self.handle = 0


@functools.cache
def _memops() -> tuple[Any, Any, Any]:
    lib = ctypes.CDLL("libcuda.so.1")
    cp = lib.cuMemcpyDtoDAsync_v2
    cp.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    cp.restype = ctypes.c_int
    wv = lib.cuStreamWriteValue32_v2
    wv.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wv.restype = ctypes.c_int
    wt = lib.cuStreamWaitValue32_v2
    wt.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wt.restype = ctypes.c_int
    return cp, wv, wt


def _memop(which: int, name: str, *args: int) -> None:
    """Call ``_memops()[which]`` (the driver's ``name``); a thread with no current context binds
    one and calls again; any other error status raises."""
    rc = _memops()[which](*args)
    if rc == _INVALID_CONTEXT:
        bind_context()
        rc = _memops()[which](*args)
    if rc:
        raise RuntimeError(f"{name} failed with CUDA driver error {rc}")


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``nbytes`` from ``src`` to ``dst`` (device or peer-mapped addresses) on ``stream``, by a copy engine."""
    _memop(0, "cuMemcpyDtoDAsync", dst, src, nbytes, stream)


def write_value(stream: int, addr: int, value: int) -> None:
    """Write ``value`` (32 bits) at ``addr`` once the stream's earlier work is done and visible."""
    _memop(1, "cuStreamWriteValue32", stream, addr, value, 0)


_WAIT_GEQ = 0  # CU_STREAM_WAIT_VALUE_GEQ: until (int32)(*addr - value) >= 0


def wait_value(stream: int, addr: int, value: int) -> None:
    """Hold ``stream`` until the 32-bit word at ``addr`` is >= ``value`` (compared cyclically). A
    stream memory operation: no kernel, no SM; it has no bound of its own, which is the caller's
    to provide (``collectives.peer._watchdog``)."""
    _memop(2, "cuStreamWaitValue32", stream, addr, value, _WAIT_GEQ)


_native.provide("launch", sys.modules[__name__])  # what the compiled fast path reads (_native.py)
