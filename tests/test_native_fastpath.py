"""The compiled fast path (collectives/_fastpath.c) against what the Python fast path does.

On CPU, with stand-ins: the driver's launch is a ctypes callback that records its arguments,
torch's current CUDA device reads -1 (what ``get_device()`` gives a CPU tensor) and the current
stream is a made-up handle. The tables are the real ones: a communicator's ``_fast``, a runner's
prepared launches, the flight recorder's ring.
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import collectives as C
from collectives import _native
from collectives.recorder import FIELDS, RECORDER, _site

STREAM = 0x5EED
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_void_p)


class Params:
    """What ``_launch.Kernel.prepare`` returns, as far as a launch reads it."""

    def __init__(self, params: int) -> None:
        self.params = params


def _setup(tmp: str) -> tuple:  # type: ignore[type-arg]
    module = _native._import(_native.build(Path(tmp)))
    launches: list[tuple] = []  # type: ignore[type-arg]
    py_launches: list[tuple] = []  # type: ignore[type-arg]
    rc = [0]

    def fake_launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):  # noqa: ANN001, ANN202
        launches.append((fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra))
        return rc[0]

    cb = LAUNCH(fake_launch)
    _native.configure(module, current_device=lambda: -1, current_stream=lambda device: STREAM,
                      launch_address=ctypes.cast(cb, ctypes.c_void_p).value,
                      py_launch=lambda *a: py_launches.append(a), threads=512, device_flag="is_cpu")
    return module, cb, launches, py_launches, rc


def body_native(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    out: dict = {}  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as tmp:
        module, cb, launches, py_launches, rc = _setup(tmp)
        comm = C.get_communicator()
        err = torch.zeros(8, dtype=torch.int32)
        slow_calls: list[tuple] = []  # type: ignore[type-arg]
        x = torch.randn(37)
        sum_op = C.ReduceOp.SUM
        ready = {x.data_ptr(): (0xF00D, 7, Params(0xBEEF), "one_shot_all_reduce")}
        runner = module.Runner(ready, err.data_ptr(), 3, lambda o, i: slow_calls.append((o.data_ptr(), i.data_ptr())), True)
        key = ("all_reduce", "auto", id(sum_op), x.dtype, x.numel())
        comm._fast.clear()
        comm._fast[key] = (runner, sum_op)

        # a repeat: one launch, counted and recorded like the Python path's
        seq0, next0 = comm.seq, RECORDER._next
        line = sys._getframe().f_lineno + 1
        got = module.fast_dispatch(comm, "all_reduce", x, x, sum_op, "auto")
        out["ran"] = got is None
        out["launch"] = launches[-1] if launches else None
        out["seq"] = comm.seq - seq0
        entry = dict(zip(FIELDS, RECORDER._ring[next0 % RECORDER.capacity]))
        entry["callsite"] = _site(entry["callsite"])
        out["entry"] = {k: (list(v) if isinstance(v, torch.Size) else v) for k, v in entry.items()
                        if k not in ("t_enqueue", "t_end", "group_ranks", "dtype")}
        out["entry_dtype"] = entry["dtype"] is x.dtype
        out["entry_times"] = entry["t_enqueue"] <= entry["t_end"]
        out["line"] = (__file__, line)
        # a call from another line, then from the first again: each entry names its own line
        sites = []
        for _ in range(2):
            for which in range(2):
                n_rec = RECORDER._next
                if which == 0:
                    module.fast_dispatch(comm, "all_reduce", x, x, sum_op, "auto")
                else:
                    module.fast_dispatch(comm, "all_reduce", x, x, sum_op, "auto")
                sites.append(_site(RECORDER._ring[n_rec % RECORDER.capacity][FIELDS.index("callsite")]))
        out["sites"] = sites
        out["group"] = comm._group_name

        # the verbs' way in finds the communicator as get_communicator does
        n0 = len(launches)
        out["verb_default"] = module.fast_verb("all_reduce", x, x, sum_op, None, False, "auto") is None
        out["verb_world"] = module.fast_verb("all_reduce", x, x, sum_op, comm.group, False, "auto") is None
        sub = dist.new_group([0])
        out["verb_unknown_group"] = module.fast_verb("all_reduce", x, x, sum_op, sub, False, "auto") is NotImplemented
        sub_comm = C.get_communicator(sub)
        sub_comm._fast[key] = (runner, sum_op)
        seq_sub = sub_comm.seq
        out["verb_subgroup"] = module.fast_verb("all_reduce", x, x, sum_op, sub, False, "auto") is None \
            and sub_comm.seq == seq_sub + 1
        out["verb_async"] = module.fast_verb("all_reduce", x, x, sum_op, None, True, "auto") is NotImplemented
        out["verb_launches"] = len(launches) - n0

        # what it leaves to Python: nothing launched, nothing counted
        n, seq1 = len(launches), comm.seq
        misses = {
            "other count": (torch.randn(38), sum_op),
            "not contiguous": (torch.randn(74)[::2], sum_op),
            "other reduce op": (x, C.ReduceOp.AVG),
            "other dtype": (x.double(), sum_op),
        }
        out["misses"] = {k: module.fast_dispatch(comm, "all_reduce", t, t, op, "auto") is NotImplemented
                         for k, (t, op) in misses.items()}
        hook = lambda *a: None  # noqa: E731
        C.add_trace_hook(hook)
        out["misses"]["trace hook"] = module.fast_dispatch(comm, "all_reduce", x, x, sum_op, "auto") is NotImplemented
        C.remove_trace_hook(hook)
        with C.call_timeout(5):
            out["misses"]["call_timeout"] = module.fast_dispatch(comm, "all_reduce", x, x, sum_op, "auto") is NotImplemented
        out["miss_launches"], out["miss_seq"] = len(launches) - n, comm.seq - seq1

        # the runner's own misses go to the Python runner: an unknown address, a reported timeout
        y = torch.randn(37)
        runner(y, y)
        err[0] = 1
        runner(x, x)
        err[0] = 0
        out["slow"] = slow_calls == [(y.data_ptr(), y.data_ptr()), (x.data_ptr(), x.data_ptr())]
        # a failed launch goes to the Python launcher with the same arguments
        rc[0] = 201
        runner(x, x)
        rc[0] = 0
        out["py_launch"] = py_launches[-1] if py_launches else None

        # a runner that raises: the entry says failed and the error reaches the caller
        def boom(o: torch.Tensor, i: torch.Tensor) -> None:
            raise RuntimeError("kernel said no")

        comm._fast[key] = (boom, sum_op)
        nxt = RECORDER._next
        try:
            module.fast_dispatch(comm, "all_reduce", x, x, sum_op, "auto")
            out["raised"] = None
        except RuntimeError as exc:
            out["raised"] = str(exc)
        out["failed_state"] = RECORDER._ring[nxt % RECORDER.capacity][FIELDS.index("state")]

        # out of place (reduce-scatter's signature), with the recorder off
        comm._fast[key] = (runner, sum_op)
        big, small = torch.randn(74), torch.randn(37)
        ready[(small.data_ptr(), big.data_ptr())] = (0xCAFE, 3, Params(0xD00D), "reduce_scatter")
        rs = module.Runner(ready, err.data_ptr(), 3, lambda o, i: slow_calls.append("rs"), False)
        comm._fast[("reduce_scatter", "one_shot", "sum", small.dtype, 37, 74)] = (rs, "sum")
        RECORDER.enabled, nxt = False, RECORDER._next
        try:
            out["rs"] = module.fast_dispatch(comm, "reduce_scatter", small, big, "sum", "one_shot") is None
        finally:
            RECORDER.enabled = True
        out["rs_launch"] = launches[-1][:2] + launches[-1][8:10]
        out["rs_unrecorded"] = RECORDER._next == nxt
        out["rs_wrong_input_dtype"] = module.fast_dispatch(comm, "reduce_scatter", small, big.double(), "sum",
                                                           "one_shot") is NotImplemented

        # no references gained or lost over many calls (once the ring is full of such calls, a
        # call's entry replaces an equal one)
        objs = [x, comm, sum_op, runner, ready, x.dtype, "all_reduce", "auto", comm._group_name, comm.global_ranks]
        for _ in range(RECORDER.capacity):
            module.fast_dispatch(comm, "all_reduce", x, x, sum_op, "auto")
        before = [sys.getrefcount(o) for o in objs]
        for _ in range(RECORDER.capacity + 7):
            module.fast_dispatch(comm, "all_reduce", x, x, sum_op, "auto")
        out["refcounts"] = [sys.getrefcount(o) for o in objs] == before
        comm._fast.clear()
        del cb
    return out


def test_compiled_fast_path_matches_the_python_one(worlds) -> None:  # noqa: ANN001
    [r] = worlds(1).run(body_native)
    assert r["ran"] and r["seq"] == 1
    assert r["launch"] == (0xF00D, 7, 1, 1, 512, 1, 1, 0, STREAM, 0xBEEF, None)
    e = r["entry"]
    assert (e["group"], e["seq"] > 0, e["op"], e["algorithm"], e["in_shape"], e["out_shape"], e["root"], e["state"]) \
        == (r["group"], True, "all_reduce", "auto", [37], [37], None, "completed")
    assert e["reduce_op"] is not None and r["entry_dtype"] and r["entry_times"]
    assert e["callsite"] == "{}:{}".format(*r["line"])
    first, second = r["sites"][:2]
    assert first != second and first.startswith(__file__ + ":") and r["sites"] == [first, second] * 2
    assert r["verb_default"] and r["verb_world"] and r["verb_unknown_group"] and r["verb_subgroup"] and r["verb_async"]
    assert r["verb_launches"] == 3
    assert r["misses"] == {k: True for k in r["misses"]} and len(r["misses"]) == 6
    assert r["miss_launches"] == 0 and r["miss_seq"] == 0
    assert r["slow"]
    assert r["py_launch"] is not None and r["py_launch"][0] == 0xF00D and r["py_launch"][2] == STREAM \
        and r["py_launch"][3] == 0xBEEF and r["py_launch"][4] == "one_shot_all_reduce" and r["py_launch"][5] == 3
    assert r["raised"] == "kernel said no" and r["failed_state"] == "failed"
    assert r["rs"] and r["rs_launch"] == (0xCAFE, 3, STREAM, 0xD00D) and r["rs_unrecorded"]
    assert r["rs_wrong_input_dtype"]
    assert r["refcounts"]


def body_layout(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    from collectives import recorder

    out: dict = {}  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as tmp:
        module, cb, launches, py_launches, rc = _setup(tmp)
        out["layout"] = module.layout()
        comm = C.get_communicator()
        x, sum_op = torch.randn(5), C.ReduceOp.SUM
        ready = {x.data_ptr(): (0xF00D, 7, Params(0xBEEF), "one_shot_all_reduce")}
        err = torch.zeros(8, dtype=torch.int32)
        comm._fast.clear()
        comm._fast[("all_reduce", "auto", id(sum_op), x.dtype, x.numel())] = \
            (module.Runner(ready, err.data_ptr(), 3, lambda o, i: None, True), sum_op)

        def configure(fields: tuple[str, ...]) -> None:
            saved = recorder.FIELDS
            recorder.FIELDS = fields  # what _native.configure hands over, and nothing else
            try:
                _native.configure(module, current_device=lambda: -1, current_stream=lambda device: STREAM,
                                  launch_address=ctypes.cast(cb, ctypes.c_void_p).value,
                                  py_launch=lambda *a: None, threads=512, device_flag="is_cpu")
            finally:
                recorder.FIELDS = saved

        # the entry follows FIELDS' order: reversed, each value lands under its own name
        configure(FIELDS[::-1])
        out["reversed_layout"] = module.layout()["fields"]
        nxt = RECORDER._next
        out["reversed_ran"] = module.fast_dispatch(comm, "all_reduce", x, x, sum_op, "auto") is None
        e = dict(zip(FIELDS[::-1], RECORDER._ring[nxt % RECORDER.capacity]))
        out["reversed_entry"] = (e["op"], e["algorithm"], list(e["in_shape"]), e["root"], e["state"],
                                 e["seq"] == comm.seq, e["t_enqueue"] <= e["t_end"])
        RECORDER._ring[nxt % RECORDER.capacity][:] = [None] * len(FIELDS)
        refused = {}
        for what, fields in {"unknown": (*FIELDS, "nbytes"), "missing": tuple(f for f in FIELDS if f != "root"),
                             "twice": (*FIELDS, "op")}.items():
            try:
                configure(fields)
                refused[what] = None
            except ValueError as exc:
                refused[what] = str(exc)
        out["refused"] = refused
        out["refused_keeps_layout"] = module.layout()["fields"] == out["reversed_layout"]
        configure(FIELDS)
        out["restored"] = module.layout()["fields"]
        comm._fast.clear()
        del cb
    return out


def test_compiled_entry_follows_recorder_fields(worlds) -> None:  # noqa: ANN001
    """The compiled path writes the flight recorder's entry where ``recorder.FIELDS`` says, and
    refuses a layout it cannot fill."""
    from collectives.recorder import _PROGRESS_SEQ

    [r] = worlds(1).run(body_layout)
    assert (r["layout"]["fields"], r["layout"]["progress_seq"]) \
        == ({name: i for i, name in enumerate(FIELDS)}, _PROGRESS_SEQ)
    assert r["reversed_layout"] == {name: len(FIELDS) - 1 - i for i, name in enumerate(FIELDS)}
    assert r["reversed_ran"] and r["reversed_entry"] == ("all_reduce", "auto", [5], None, "completed", True, True)
    assert "'nbytes', a field it does not fill" in r["refused"]["unknown"]
    assert "has no root" in r["refused"]["missing"]
    assert "'op', a second time" in r["refused"]["twice"]
    assert r["refused_keeps_layout"]
    assert r["restored"] == r["layout"]["fields"]


def test_compiled_key_follows_dispatch(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The compiled path keys ``comm._fast`` as ``dispatch._fast_key`` does, from the tables
    ``dispatch`` defines, and refuses a key fact it does not read."""
    from collectives import dispatch

    module, cb, *_ = _setup(str(tmp_path))
    layout = module.layout()
    assert (layout["fast_key"], layout["fast_key_out_of_place"], layout["by_value"], layout["runner_index"]) \
        == (dispatch._FAST_KEY, dispatch._FAST_KEY_OUT_OF_PLACE, dispatch._FAST_BY_VALUE, dispatch._FAST_RUNNER)
    x, small, big = torch.randn(37), torch.randn(37), torch.randn(74)
    sum_op = C.ReduceOp.SUM
    calls = [("all_reduce", x, x, sum_op, "auto"), ("all_reduce", x, x, "sum", "one_shot"),
             ("all_gather", big, small, None, "auto"), ("reduce_scatter", small, big, "avg", "one_shot"),
             ("reduce_scatter", small, big.double(), sum_op, "auto"), ("all_gather", big, [small], None, "auto")]

    def facts(op, out, inp, rop, algorithm):  # noqa: ANN001, ANN202 - what each name of the tables means
        by_value = rop is None or type(rop) is str
        return {"op": op, "algorithm": algorithm, "reduce_op": rop if by_value else id(rop), "dtype": out.dtype,
                "numel": out.numel(), "input_numel": inp.numel() if isinstance(inp, torch.Tensor) else None}

    for op, out, inp, rop, algorithm in calls:
        python = dispatch._fast_key(op, algorithm, rop, out, inp)
        assert module.fast_key(op, out, inp, rop, algorithm) == python
        spec = dispatch._FAST_KEY if out is inp else dispatch._FAST_KEY_OUT_OF_PLACE
        f = facts(op, out, inp, rop, algorithm)
        assert python == (tuple(f[n] for n in spec) if isinstance(inp, torch.Tensor) else None)

    def configure() -> None:
        _native.configure(module, current_device=lambda: -1, current_stream=lambda device: STREAM,
                          launch_address=ctypes.cast(cb, ctypes.c_void_p).value, py_launch=lambda *a: None,
                          threads=512, device_flag="is_cpu")

    # another order, another by-value rule: the compiled key follows what configure hands it
    monkeypatch.setattr(dispatch, "_FAST_KEY", ("numel", "dtype", "op"))
    monkeypatch.setattr(dispatch, "_FAST_KEY_OUT_OF_PLACE", ("input_numel", "algorithm", "reduce_op"))
    monkeypatch.setattr(dispatch, "_FAST_BY_VALUE", (type(None),))
    configure()
    assert module.fast_key("all_reduce", x, x, "sum", "auto") == (37, x.dtype, "all_reduce")
    s = "sum"
    assert module.fast_key("reduce_scatter", small, big, s, "one_shot") == (74, "one_shot", id(s))
    monkeypatch.setattr(dispatch, "_FAST_KEY", (*dispatch._FAST_KEY, "device"))
    with pytest.raises(ValueError, match=r"_FAST_KEY\[3\] is 'device', a fact of a call the compiled fast path"):
        configure()
    assert module.layout()["fast_key"] == ("numel", "dtype", "op")  # refused: left as it was
    monkeypatch.undo()
    configure()
    assert module.fast_key("all_reduce", x, x, sum_op, "auto") == dispatch._fast_key("all_reduce", "auto", sum_op, x, x)
    del cb


GRAPH_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
IS_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


def body_graph_launch(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    out: dict = {}  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as tmp:
        module = _native._import(_native.build(Path(tmp)))
        launches: list[tuple] = []  # type: ignore[type-arg]
        graphs: list[tuple] = []  # type: ignore[type-arg]
        py_launches: list[tuple] = []  # type: ignore[type-arg]
        state = {"graph_rc": 0, "capture_rc": 0, "capturing": 0}

        def fake_launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):  # noqa: ANN001, ANN202
            launches.append((fn, gx, stream, params))
            return 0

        def fake_graph(exe, stream):  # noqa: ANN001, ANN202
            graphs.append((exe, stream))
            return state["graph_rc"]

        def fake_capturing(stream, status):  # noqa: ANN001, ANN202
            status[0] = state["capturing"]
            return state["capture_rc"]

        cbs = LAUNCH(fake_launch), GRAPH_LAUNCH(fake_graph), IS_CAPTURING(fake_capturing)
        address = [ctypes.cast(cb, ctypes.c_void_p).value for cb in cbs]

        def configure(graph_launch: int, capturing: int) -> None:
            _native.configure(module, current_device=lambda: -1, current_stream=lambda device: STREAM,
                              launch_address=address[0], py_launch=lambda *a: py_launches.append(a), threads=512,
                              device_flag="is_cpu", graph_launch_address=graph_launch, capturing_address=capturing)

        err = torch.zeros(8, dtype=torch.int32)
        x, y = torch.randn(37), torch.randn(37)
        ready = {x.data_ptr(): (0xF00D, 7, Params(0xBEEF), "one_shot_all_reduce", 0x6EA9, object()),
                 y.data_ptr(): (0xF00D, 7, Params(0xBEEF), "one_shot_all_reduce")}  # no graph: the kernel
        runner = module.Runner(ready, err.data_ptr(), 3, lambda o, i: None, True)

        def step(t: torch.Tensor) -> tuple[int, int, int]:
            n = len(launches), len(graphs), len(py_launches)
            runner(t, t)
            return len(launches) - n[0], len(graphs) - n[1], len(py_launches) - n[2]

        configure(address[1], address[2])
        out["graph"] = step(x), graphs[-1]
        out["no_graph_in_entry"] = step(y)
        state["capturing"] = 1
        out["capturing"] = step(x), launches[-1]
        state["capturing"], state["capture_rc"] = 0, 900  # cannot tell: the kernel
        out["capture_unknown"] = step(x)
        state["capture_rc"], state["graph_rc"] = 0, 201  # a failed graph launch: the Python launcher's kernel
        out["graph_failed"] = step(x), py_launches[-1][:4]
        state["graph_rc"] = 0
        configure(address[1], 0)  # no way to ask about captures: no graphs
        out["no_capture_query"] = step(x)
        configure(0, 0)
        out["unconfigured"] = step(x)
        del cbs
    return out


def test_compiled_runner_launches_prepared_graphs_outside_captures(worlds) -> None:  # noqa: ANN001
    [r] = worlds(1).run(body_graph_launch)
    assert r["graph"] == ((0, 1, 0), (0x6EA9, STREAM))
    assert r["no_graph_in_entry"] == (1, 0, 0)
    assert r["capturing"] == ((1, 0, 0), (0xF00D, 7, STREAM, 0xBEEF))
    assert r["capture_unknown"] == (1, 0, 0)
    assert r["graph_failed"] == ((0, 1, 1), (0xF00D, 7, STREAM, 0xBEEF))
    assert r["no_capture_query"] == (1, 0, 0) and r["unconfigured"] == (1, 0, 0)


def test_build_failure_is_reported(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="failed"):
        _native.build(tmp_path)


def test_a_missing_compiler_falls_back_visibly(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(_native, "_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(_native, "_STATE", {"module": None, "why": "", "tried": False})
    with pytest.warns(RuntimeWarning, match="COMMOPS_NATIVE=0"):
        assert _native.load() is None
    assert _native.status().startswith("not available")
    assert _native.load() is None  # tried once: no second build, no second warning


def test_compiler_choice(monkeypatch) -> None:  # noqa: ANN001
    import sysconfig

    monkeypatch.setenv("CC", "my-cc -O1")
    assert _native._compiler() == ["my-cc", "-O1"]  # asked for: used as given
    monkeypatch.delenv("CC")
    real = sysconfig.get_config_var
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: "no-such-cc-anywhere -pthread" if name == "CC" else real(name))
    assert _native._compiler() == ["cc"]  # Python's own compiler is not on this machine


def body_host_cost(rank: int, world: int) -> list:  # type: ignore[type-arg]
    from bench.fastpath_host import fastpath_host_cost

    return [(r.entry, r.base_us, r.head_us, r.ratio, r.rounds, r.calls)
            for r in fastpath_host_cost(C.get_communicator(), "HEAD", calls=20, rounds=3)]


def test_host_cost_benchmark_runs(worlds) -> None:  # noqa: ANN001
    """The smallest run of ``launch/bench_fastpath_host.py``: HEAD's build against the working tree's."""
    [r] = worlds(1).run(body_host_cost)
    assert [e[0] for e in r] == ["fast_verb", "fast_dispatch", "verb"]
    assert all(e[1] > 0 and e[2] > 0 and e[3] > 0 and e[4:] == (3, 20) for e in r)
