"""The peer algorithms' runners (``PeerAlgorithm.runner``, ``collectives/algos/_peer.py``), the
launch path and ``PeerMemory``'s launch API on machines without GPUs: which launch a repeated call
makes, when a prepared parameter block is kept, reused and dropped.

A repeat on the same tensors must launch exactly what the general method launched for them
(same entry point, grid and arguments), so each case below records the general call first and
compares. Kernels and the driver are stand-ins that log; the values the kernels compute are
checked on the GPUs (``tests/gpu_peer_check.py``, ``prepared_repeats``).
"""

from __future__ import annotations

import gc
import sys
import types
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from collectives import algos
from collectives.algos import _peer as P
from collectives.algos.two_shot import two_shot_piece
from collectives.errors import CollectiveTimeout, UnsupportedError
from collectives.peer import _launch, _layout as L, copy_engines as CE
from collectives.peer import memory as M


class _Kernel:
    def __init__(self, name: str, log: list[Any]) -> None:
        self.name, self.fn, self.log = name, 1000 + len(name), log

    def __call__(self, blocks: int, stream: int, *args: int) -> None:
        self.log.append((self.name, blocks, args))

    def prepare(self, *args: int) -> Any:
        return SimpleNamespace(params=args)


@pytest.fixture
def pm(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A two-rank PeerMemory of rank 0 with 1 MiB sets; ``pm.log`` lists the launches."""
    log: list[Any] = []
    kernels: dict[Any, _Kernel] = {}
    p = object.__new__(M.PeerMemory)
    p.world, p.rank, p.closed, p.device_index, p.device = 2, 0, False, -1, torch.device("cpu")
    p._states, p._block_bytes, p._max_blocks = {}, 8 << 10, M.MAX_BLOCKS
    p.set_bytes, p.ll_max_bytes, p.timeout_s = 1 << 20, M.ONE_SHOT_LL_MAX_BYTES, 1.0
    p._err_np = np.zeros(8, dtype=np.int32)  # the host-mapped record (peer.cuh, struct Ctx)
    p.comm = SimpleNamespace(global_ranks=(0, 1))
    p.copy_engines = CE.CopyEngines(p, (SimpleNamespace(), SimpleNamespace()))  # type: ignore[arg-type]

    def kernel(kind: str, dtype: Any, vec: bool, nargs: int = 4, bases: Any = None, source: Any = None) -> _Kernel:
        name = f"{kind}_{M._TAGS[dtype]}_{'vec' if vec else 'scalar'}"
        return kernels.setdefault((kind, dtype, vec), _Kernel(name, log))

    p.kernel = kernel
    monkeypatch.setattr(_launch, "current_stream", lambda index: 7)
    monkeypatch.setattr(_launch, "launch",
                        lambda fn, blocks, stream, params, name="", device=None: log.append((name, blocks, params)))
    p.log = log
    return p


def _runner(pm: Any, op: str, algorithm: str, **kw: Any) -> Any:
    return algos.peer(algorithm).runner(pm, op, **kw)


def _ready(pm: Any) -> Any:
    """The live runners' prepared launches."""
    return pm.state(P.PeerState).ready


def _twice(pm: Any, run: Any, out: torch.Tensor, inp: torch.Tensor) -> tuple[Any, Any]:
    """The general call's launches, then the repeat's."""
    pm.log.clear()
    run(out, inp)
    first = list(pm.log)
    pm.log.clear()
    run(out, inp)
    return first, list(pm.log)


@pytest.mark.parametrize("algorithm,n,offset,kernel", [
    ("one_shot", 100, 0, "one_shot_ll_bf16_vec"),  # low-latency words
    ("one_shot", 100, 1, "one_shot_bf16_scalar"),  # unaligned: the scalar entry point
    ("one_shot", 200_000, 0, "one_shot_bf16_vec"),  # above the words' limit, one piece
    ("two_shot", 1001, 0, "two_shot_bf16_vec"),
])
def test_all_reduce_repeat_launches_what_the_general_call_did(pm: Any, algorithm: str, n: int, offset: int,
                                                              kernel: str) -> None:
    x = torch.empty(n + offset, dtype=torch.bfloat16)[offset:]
    run = _runner(pm, "all_reduce", algorithm)
    first, again = _twice(pm, run, x, x)
    assert len(first) == 1 and first[0][0] == kernel
    assert again == first
    assert first[0][2][:2] == (x.data_ptr(), x.data_ptr())


@pytest.mark.parametrize("op,m,dtype,kernel", [
    ("reduce_scatter", 3000, torch.float32, "reduce_scatter_ll_f32_vec"),
    ("reduce_scatter", 4097, torch.float16, "reduce_scatter_f16_scalar"),  # odd: not whole words
    ("all_gather", 3000, torch.float32, "all_gather_ll_f32_vec"),
])
def test_shard_repeat_launches_what_the_general_call_did(pm: Any, op: str, m: int, dtype: torch.dtype,
                                                         kernel: str) -> None:
    small, big = torch.empty(m, dtype=dtype), torch.empty(2 * m, dtype=dtype)
    out, inp = (small, big) if op == "reduce_scatter" else (big, small)
    run = _runner(pm, op, "one_shot")
    first, again = _twice(pm, run, out, inp)
    assert len(first) == 1 and first[0][0] == kernel
    assert again == first
    assert first[0][2][:2] == (inp.data_ptr(), out.data_ptr())
    other = torch.empty_like(inp)  # another input, the same output: planned again, not the kept block
    first2, again2 = _twice(pm, run, out, other)
    assert first2 == again2 and first2[0][2][0] == other.data_ptr()


def test_calls_of_several_pieces_are_not_kept(pm: Any) -> None:
    n = 3 * two_shot_piece(pm.set_bytes, pm.world, 2)
    x = torch.empty(n, dtype=torch.bfloat16)
    run = _runner(pm, "all_reduce", "two_shot")
    first, again = _twice(pm, run, x, x)
    assert len(first) == 3 and again == first
    assert not any(_ready(pm))


def test_a_new_grid_drops_the_kept_blocks(pm: Any) -> None:
    x = torch.empty(61_440, dtype=torch.float32)  # 240 KiB: 30 blocks of 8 KiB
    run = _runner(pm, "all_reduce", "one_shot")
    first, _ = _twice(pm, run, x, x)
    pm.block_bytes = 4 << 10
    assert not any(_ready(pm))
    after, again = _twice(pm, run, x, x)
    assert after[0][1] == 2 * first[0][1] and again == after


def test_kept_launches_carry_a_one_kernel_graph_for_the_compiled_runner(pm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[Any, ...]] = []

    class Graph:
        def __init__(self, fn: int, blocks: int, params: Any) -> None:
            made.append((fn, blocks, params))
            self.handle = 0x6EA9 + len(made)

    monkeypatch.setattr(_launch, "OneKernelGraph", Graph)
    monkeypatch.setattr(P, "_GRAPHS_FAILED", [])
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    x, y, z = (torch.empty(100, dtype=torch.bfloat16) for _ in range(3))
    run = _runner(pm, "all_reduce", "one_shot")
    _twice(pm, run, x, x)
    assert len(run.ready[x.data_ptr()]) == 4 and not made  # the Python runner's: no graph
    run.ready.graphs = True  # what the compiled runner asks for
    first, again = _twice(pm, run, y, y)
    entry = run.ready[y.data_ptr()]
    fn, blocks, prepared, name, handle, graph = entry
    assert made == [(fn, blocks, prepared.params)] and handle == graph.handle and again == first
    capturing[0] = True  # first met inside a capture: no graph is made there
    _twice(pm, run, z, z)
    assert len(run.ready[z.data_ptr()]) == 4 and len(made) == 1
    capturing[0] = False

    def broken(*args: Any) -> None:
        raise RuntimeError("CUDA driver error 801")

    monkeypatch.setattr(_launch, "OneKernelGraph", broken)
    run.ready.clear()
    with pytest.warns(RuntimeWarning, match="COMMOPS_GRAPH_LAUNCH=0"):
        _twice(pm, run, x, x)
    assert len(run.ready[x.data_ptr()]) == 4 and P._GRAPHS_FAILED
    monkeypatch.setattr(_launch, "OneKernelGraph", Graph)
    run.ready.clear()
    _twice(pm, run, y, y)  # after a failure none is tried again
    assert len(run.ready[y.data_ptr()]) == 4 and len(made) == 1


def test_a_reported_timeout_raises_instead_of_launching(pm: Any) -> None:
    x = torch.empty(64, dtype=torch.float32)
    run = _runner(pm, "all_reduce", "one_shot")
    _twice(pm, run, x, x)
    pm.error_record[:4] = (1, 0, 0, 1)  # a kernel gave up waiting for rank 1
    pm.log.clear()
    with pytest.raises(CollectiveTimeout):
        run(x, x)
    assert pm.log == []


def test_average_and_copy_engine_take_the_general_method(pm: Any) -> None:
    _runner(pm, "all_reduce", "one_shot", average=True)
    _runner(pm, "all_reduce", "copy_engine")
    _runner(pm, "all_reduce", "one_shot", prepared=False)
    assert len(_ready(pm)) == 0


def test_launch_binds_the_context_once_on_invalid_context(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    bound: list[int] = []

    def driver(*args: int) -> None:
        calls.append(args[0])
        if len(calls) == 1:
            raise _launch._DriverError(_launch._INVALID_CONTEXT)

    monkeypatch.setattr(_launch, "_launch_fn", driver)
    monkeypatch.setattr(_launch, "bind_context", lambda device=None: bound.append(1))
    _launch.launch(5, 1, 0, 0)
    assert calls == [5, 5] and bound == [1]


def test_launch_names_the_kernel_and_the_driver_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def driver(*args: int) -> None:
        raise _launch._DriverError(700)

    monkeypatch.setattr(_launch, "_launch_fn", driver)
    with pytest.raises(RuntimeError, match=r"cuLaunchKernel\(one_shot_bf16_vec\).*error 700"):
        _launch.launch(5, 1, 0, 0, "one_shot_bf16_vec")


def test_a_dropped_runner_takes_its_blocks_with_it(pm: Any) -> None:
    x = torch.empty(64, dtype=torch.float32)
    run = _runner(pm, "all_reduce", "one_shot")
    _twice(pm, run, x, x)
    assert len(_ready(pm)) == 1 and any(_ready(pm))
    assert list(run.ready) == [x.data_ptr()]  # what launch/tune_peer.py reads
    del run
    gc.collect()
    assert len(_ready(pm)) == 0


def test_a_module_is_the_header_then_one_source_compiled_once_per_device_and_sources(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    compiled: list[tuple[int, str]] = []
    current = [0]

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            current[0] = self.index

        def __exit__(self, *exc: Any) -> None:
            pass

    class RawModule:
        def __init__(self, code: str, options: tuple[str, ...]) -> None:
            compiled.append((current[0], code))

        def get_function(self, name: str) -> Any:
            return SimpleNamespace(kernel=SimpleNamespace(name=name))

    cupy = types.ModuleType("cupy")
    cupy.cuda = SimpleNamespace(Device=Device)  # type: ignore[attr-defined]
    cupy.RawModule = RawModule  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    _launch._module.cache_clear()
    _launch._function.cache_clear()
    rows = tmp_path / "rows.cu"
    rows.write_text("// rows\n")
    try:
        for device, name, source in ((0, "ce_fence", None), (0, "ce_wait", None), (0, "rows_post", rows),
                                     (1, "ce_fence", None), (0, "rows_ids", rows)):
            assert _launch._function(name, device, _launch.sources_of(source)).name == name
    finally:
        _launch._module.cache_clear()
        _launch._function.cache_clear()
    header, kernels = _launch.HEADER.read_text(), _launch.KERNELS.read_text()
    collectives = f'#line 1 "peer.cuh"\n{header}\n#line 1 "kernels.cu"\n{kernels}\n'
    assert compiled == [(0, collectives), (0, f'#line 1 "peer.cuh"\n{header}\n#line 1 "rows.cu"\n// rows\n\n'),
                        (1, collectives)]


def test_first_launch_takes_cupys_launcher_or_falls_back_to_ctypes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
    driver = types.ModuleType("cupy.cuda.driver")
    driver.CUDADriverError = type("CUDADriverError", (RuntimeError,), {})  # type: ignore[attr-defined]
    cuda.driver = driver  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.driver", driver)
    monkeypatch.setattr(_launch, "_ctypes_launch", lambda *args: calls.append("ctypes"))
    monkeypatch.setattr(_launch, "_launch_errors", _launch._launch_errors)  # restored afterwards
    monkeypatch.setattr(_launch, "_launch_fn", _launch._first_launch)
    _launch.launch(5, 1, 0, 0)  # this CuPy has no launchKernel
    assert calls == ["ctypes"] and _launch._launch_fn is _launch._ctypes_launch
    driver.launchKernel = lambda *args: calls.append("cupy")  # type: ignore[attr-defined]
    monkeypatch.setattr(_launch, "_launch_fn", _launch._first_launch)
    _launch.launch(5, 1, 0, 0)
    _launch.launch(5, 1, 0, 0)
    assert calls == ["ctypes", "cupy", "cupy"] and driver.CUDADriverError in _launch._launch_errors


def test_launch_binds_the_kernels_own_device(monkeypatch: pytest.MonkeyPatch) -> None:
    bound: list[Any] = []
    failed = [True]

    def driver(*args: int) -> None:
        if failed.pop() if failed else False:
            raise _launch._DriverError(_launch._INVALID_CONTEXT)

    monkeypatch.setattr(_launch, "_launch_fn", driver)
    monkeypatch.setattr(_launch, "bind_context", lambda device=None: bound.append(device))
    _launch.launch(5, 1, 0, 0, "k", 3)
    assert bound == [3]


def test_a_released_section_names_the_peer_behind(pm: Any) -> None:
    # the section watchdog's record (collectives/peer/_watchdog.py): stage 20, no block, peer 1
    pm.error_record[:4] = (1, L.STREAM_WAIT, -1, 1)
    with pytest.raises(CollectiveTimeout) as info:
        pm.check()
    assert info.value.missing == [1] and "copy-engine section" in str(info.value) and "block" not in str(info.value)
    pm.error_record[:4] = (1, 10, 3, 1)  # a kernel's own timeout still names its block and flag
    with pytest.raises(CollectiveTimeout, match="block 3 for the flag 'chunk pushed"):
        pm.check()


def test_sections_and_barriers_tell_the_fence_apart(pm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # ce_fence's mode bits (kernels.cu): the watchdog counts only sections, so a plain barrier
    # (the MoE transport's) must open none, and only opening one starts the watchdog
    started: list[Any] = []
    monkeypatch.setattr(CE, "SectionWatchdog", lambda *args: SimpleNamespace(start=lambda: started.append(args)))
    fence = []
    pm.kernel = lambda kind, *a, **k: (lambda blocks, stream, *args: fence.append((kind, args)))
    pm.barrier()
    pm.barrier(clear=True)
    assert fence == [("ce_fence", (0,)), ("ce_fence", (L.FENCE_CLEAR,))] and started == []
    fence.clear()
    ce = pm.copy_engines
    ce.open()
    ce.close()
    ce.open()
    assert fence == [("ce_fence", (L.FENCE_OPEN,)), ("ce_fence", (L.FENCE_CLEAR | L.FENCE_CLOSE,)),
                     ("ce_fence", (L.FENCE_OPEN,))]
    assert len(started) == 1 and ce.sections == 1  # one watchdog, started by the first section


def test_stream_waits_only_inside_a_section(pm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # the watchdog bounds stream waits only while a section is open: outside one, ce_wait waits
    # with its bounded kernel, and a stream wait asked for there is refused before anything runs
    monkeypatch.setattr(CE, "SectionWatchdog", lambda *args: SimpleNamespace(start=lambda: None))
    pm.flag_pointers = (1 << 20, 2 << 20)
    log: list[Any] = []
    pm.kernel = lambda kind, *a, **k: (lambda blocks, stream, *args: log.append((kind, args)))
    monkeypatch.setattr(_launch, "wait_value", lambda stream, address, value: log.append(("wait_value", address,
                                                                                          value)))
    ce = pm.copy_engines
    ce.wait(5, 1, CE.CE_PULLED, 3)
    assert log == [("ce_wait", (1, CE.CE_PULLED, 3))]
    with pytest.raises(UnsupportedError, match="kernel.*outside a copy-engine section.*kernel=True"):
        ce.wait(5, 1, CE.CE_PULLED, 3, kernel=False)
    log.clear()
    ce.open()
    ce.wait(5, 1, CE.CE_PULLED, 3)  # one stream wait per peer (one peer here): rank 1's flag at rank 0
    ce.wait(5, 1, CE.CE_PULLED, 4, kernel=True)
    ce.close()
    ce.wait(5, 1, CE.CE_PULLED, 5)
    flag = (1 << 20) + L.ce_flag_offset(1, CE.CE_PULLED, 1)
    assert log == [("ce_fence", (L.FENCE_OPEN,)), ("wait_value", flag, 3), ("ce_wait", (1, CE.CE_PULLED, 4)),
                   ("ce_fence", (L.FENCE_CLEAR | L.FENCE_CLOSE,)), ("ce_wait", (1, CE.CE_PULLED, 5))]


def test_memory_operations_bind_a_context_once_and_report_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    # the copy, the flag write and the stream wait: arguments reach the driver in order (the
    # wait with CU_STREAM_WAIT_VALUE_GEQ), an invalid-context status binds one and calls again,
    # any other status raises naming the call
    calls: list[Any] = []
    status = [0]

    def op(i: int) -> Any:
        def call(*args: int) -> int:
            calls.append((i, args))
            rc, status[0] = status[0], 0
            return rc
        return call

    bound: list[int] = []
    monkeypatch.setattr(_launch, "_memops", lambda: (op(0), op(1), op(2)))
    monkeypatch.setattr(_launch, "bind_context", lambda device=None: bound.append(1))
    _launch.copy_async(10, 20, 30, 7)
    _launch.write_value(7, 40, 5)
    _launch.wait_value(7, 40, 6)
    assert calls == [(0, (10, 20, 30, 7)), (1, (7, 40, 5, 0)), (2, (7, 40, 6, 0))] and bound == []
    calls.clear()
    status[0] = _launch._INVALID_CONTEXT
    _launch.wait_value(7, 44, 2)
    assert calls == [(2, (7, 44, 2, 0))] * 2 and bound == [1]
    status[0] = 1
    with pytest.raises(RuntimeError, match="cuStreamWriteValue32 failed with CUDA driver error 1"):
        _launch.write_value(7, 40, 5)


def test_kernels_are_made_once_per_source(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    made: list[tuple[Any, ...]] = []

    class Kernel:
        def __init__(self, name: str, device: int, ctx: bytes, nargs: int, sources: tuple[Any, ...]) -> None:
            made.append((name, device, nargs, sources))

    monkeypatch.setattr(_launch, "Kernel", Kernel)
    p = object.__new__(M.PeerMemory)
    p.device_index, p._ctx, p._kernels = 3, b"ctx", {}
    p._err_np = np.zeros(8, dtype=np.int32)
    own = tmp_path / "own.cu"
    k = p.kernel("ce_fence", None, False, 1)
    assert p.kernel("ce_fence", None, False, 1) is k  # kept
    p.kernel("one_shot", torch.bfloat16, True)
    p.kernel("rows_sum", torch.float16, False, 6, source=own)
    assert made == [("ce_fence", 3, 1, (_launch.HEADER, _launch.KERNELS)),
                    ("one_shot_bf16_vec", 3, 4, (_launch.HEADER, _launch.KERNELS)),
                    ("rows_sum_f16_scalar", 3, 6, (_launch.HEADER, own))]
    p._err_np[:4] = (1, 0, 0, 1)
    p.comm, p.world, p.rank, p.timeout_s = SimpleNamespace(global_ranks=(0, 1)), 2, 0, 1.0
    with pytest.raises(CollectiveTimeout):  # after a timeout no kernel is handed out
        p.kernel("ce_fence", None, False, 1)


def test_peer_names_the_peer_algorithms_only() -> None:
    assert {n for n in algos.REGISTRY if isinstance(algos.REGISTRY[n], algos.PeerAlgorithm)} == \
        {"one_shot", "two_shot", "copy_engine"}
    assert algos.peer("two_shot") is algos.REGISTRY["two_shot"]
    with pytest.raises(UnsupportedError, match="not a peer-memory algorithm"):
        algos.peer("ring")
    with pytest.raises(UnsupportedError, match="not a peer-memory reduce-scatter"):
        algos.peer("two_shot").reduce_scatter(None, torch.empty(1), torch.empty(2))  # type: ignore[arg-type]

