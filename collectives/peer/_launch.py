"""Compiling and launching ``kernels.cu``: pointers, sizes and a stream in, nothing else.

The module is compiled by NVRTC (through CuPy) on first use for the current device, never at
import. Launches go to torch's current stream, so they order with the caller's work and are
captured by ``torch.cuda.graph`` like any other kernel.

Design note: a launch is on the path of every small collective, whose whole budget is a few
microseconds of host time. CuPy's ``RawKernel.__call__`` converts its arguments on every call
(about 6 us on the 2xH200 machine's CPUs), so launches go through the driver's
``cuLaunchKernel`` directly (ctypes), with the arguments written into a parameter block that
is built once per entry point and communicator; CuPy only compiles and loads the module.

Driver calls act on the calling thread's current context. A thread that has made no CUDA runtime
call of its own (autograd's device thread running a backward on device 0 is one: torch skips
setting a device that already reads as current) has none, and the driver answers
``CUDA_ERROR_INVALID_CONTEXT``; the launch then makes the device's primary context (the one
torch and CuPy use) current on that thread and tries once more.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

__all__ = ["Kernel", "THREADS", "current_stream", "copy_async", "write_value"]

_INVALID_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: no context is current on this thread

THREADS = 512  # must match __launch_bounds__ in kernels.cu
_SOURCE = Path(__file__).with_name("kernels.cu")


@functools.cache
def _module(device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawModule(code=_SOURCE.read_text(), options=("--std=c++17",))


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


def _raw_stream_fn() -> Any:
    # torch's own accessor of the current cudaStream_t (what its compiled kernels launch on);
    # the public route builds a Stream object per call.
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda device: torch.cuda.current_stream(device).cuda_stream


current_stream = _raw_stream_fn()


@functools.cache
def _function(name: str, device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return _module(device).get_function(name).kernel  # the loaded CUfunction (compiles on first use)


class Kernel:
    """One entry point of ``kernels.cu`` bound to one context: launched with its other arguments on a stream.

    The context (``struct Ctx``, passed by value) is copied into the parameter block once; a launch
    writes the ``nargs`` 8-byte arguments that follow it and calls ``cuLaunchKernel``. Not
    thread-safe: one communicator's calls come from one thread at a time.
    """

    __slots__ = ("name", "_device", "_fn", "_fnp", "_ctx", "_args", "_params", "_launch", "_n", "_streams")

    def __init__(self, name: str, device: int, ctx: bytes, nargs: int = 4) -> None:
        self.name = name
        self._device = device
        self._fn = _function(name, device)
        self._ctx = ctypes.create_string_buffer(ctx, len(ctx))
        self._args = (ctypes.c_uint64 * nargs)()
        self._n = nargs
        base = ctypes.addressof(self._args)
        self._params = (ctypes.c_void_p * (nargs + 1))(ctypes.addressof(self._ctx), *(base + 8 * i for i in range(nargs)))
        self._launch = _driver()
        self._fnp = ctypes.c_void_p(self._fn.ptr)
        self._streams: dict[int, ctypes.c_void_p] = {}

    def __call__(self, blocks: int, stream: int, *args: int) -> None:
        a = self._args
        for i, v in enumerate(args):
            a[i] = v
        s = self._streams.get(stream)
        if s is None:
            s = self._streams[stream] = ctypes.c_void_p(stream)
        rc = self._launch(self._fnp, _GRIDS[blocks], _ONE, _ONE, _THREADS, _ONE, _ONE, _ZERO, s, self._params, None)
        if rc == _INVALID_CONTEXT:
            bind_context(self._device)
            rc = self._launch(self._fnp, _GRIDS[blocks], _ONE, _ONE, _THREADS, _ONE, _ONE, _ZERO, s, self._params, None)
        if rc:
            raise RuntimeError(f"cuLaunchKernel({self.name}) failed with CUDA driver error {rc}")


@functools.cache
def _memops() -> tuple[Any, Any]:
    lib = ctypes.CDLL("libcuda.so.1")
    cp = lib.cuMemcpyDtoDAsync_v2
    cp.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    cp.restype = ctypes.c_int
    wv = lib.cuStreamWriteValue32_v2
    wv.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wv.restype = ctypes.c_int
    return cp, wv


def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``nbytes`` from ``src`` to ``dst`` (device or peer-mapped addresses) on ``stream``, by a copy engine."""
    rc = _memops()[0](dst, src, nbytes, stream)
    if rc == _INVALID_CONTEXT:
        bind_context()
        rc = _memops()[0](dst, src, nbytes, stream)
    if rc:
        raise RuntimeError(f"cuMemcpyDtoDAsync failed with CUDA driver error {rc}")


def write_value(stream: int, addr: int, value: int) -> None:
    """Write ``value`` (32 bits) at ``addr`` once the stream's earlier work is done and visible."""
    rc = _memops()[1](stream, addr, value, 0)
    if rc == _INVALID_CONTEXT:
        bind_context()
        rc = _memops()[1](stream, addr, value, 0)
    if rc:
        raise RuntimeError(f"cuStreamWriteValue32 failed with CUDA driver error {rc}")
