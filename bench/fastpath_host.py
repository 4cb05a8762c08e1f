"""The compiled fast path's host cost per call: a base revision's build against the working tree's, in one process.

Design note. Both modules are built from source here: the base revision's ``_fastpath.c`` by
that revision's own ``_native.py`` (both read with ``git show`` into a private temporary
directory, the ``_native.py`` loaded as a module of the installed ``collectives`` package so
that its ``configure`` hands the base C the objects it expects), the working tree's by the
working tree's. Each is configured with the CPU stand-ins of ``tests/test_native_fastpath.py``
(tensors whose ``is_cpu`` is true, torch's current device read as -1, what ``get_device()``
gives a CPU tensor), except that the launch is a C function compiled here that returns 0 and
the current device and stream are builtins: a ctypes callback costs about a microsecond, most
of what is measured, and a lambda a tenth of one, the same on both sides. The two modules then
take turns on the same communicator, tensor and flight recorder: a round times one block of
``calls`` calls of each (the order flipped every round), with the ``comm._fast`` entry holding
that module's own prepared runner. Each block must have run every call (``comm.seq`` moved by
``calls``): a side that misses, and so returns early, fails loudly instead of looking fast.

The third entry, ``verb``, is ``collectives.all_reduce`` itself: the base revision's source of
that function (defined over the working tree's package, so that the rest of the path is the
same) against the working tree's, both reaching the working tree's build through
``dispatch._native_verb``: what the verb's own Python adds to a repeated call.

The per-call figures are medians over rounds; ``ratio`` is the median over rounds of head's
time over base's in the same round (:func:`bench.harness.paired_ratio`), with its 10th and 90th
percentiles. Tried and rejected: two processes, one per build, alternately (each process's
share of a loaded 2-core machine differs from the other's; in one process both see the same
stretch of it), and timing the builds through ``collectives.all_reduce`` (its Python frame, shared,
would dilute the difference: the ``verb`` entry measures that frame itself).
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

import collectives as C
from collectives import _native, dispatch
from collectives.dispatch import _fast_key

from .harness import paired_ratio

__all__ = ["HostCostRecord", "fastpath_host_cost", "format_host_cost"]

_REPO = Path(__file__).resolve().parent.parent
_NOOP_LAUNCH = "int noop_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, " \
               "unsigned bz, unsigned shared, void *stream, void **params, void **extra) { return 0; }\n"


@dataclass
class HostCostRecord:
    """One entry point of the compiled module, ``base`` against the working tree (``head``)."""

    entry: str  # "fast_verb" (the verbs' way in), "fast_dispatch" (dispatch_tensors') or "verb" (collectives.all_reduce)
    base: str  # the base revision, as given
    base_us: float  # median per-call microseconds over rounds
    head_us: float
    ratio: float  # median over rounds of head / base in the same round
    ratio_p10: float
    ratio_p90: float
    base_us_p10: float
    base_us_p90: float
    head_us_p10: float
    head_us_p90: float
    rounds: int
    calls: int


def _git_show(rev: str, path: str, repo: Path) -> str:
    done = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{path}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git show {rev}:{path} failed: {done.stderr.strip()}")
    return done.stdout


def _base_native(rev: str, repo: Path, where: Path) -> ModuleType:
    """``rev``'s ``collectives/_native.py`` as a module of the ``collectives`` package, its
    ``_fastpath.c`` beside it (its ``build`` compiles the file next to it)."""
    (where / "_fastpath.c").write_text(_git_show(rev, "collectives/_fastpath.c", repo))
    src = where / "_native.py"
    src.write_text(_git_show(rev, "collectives/_native.py", repo))
    name = f"collectives._native_at_{rev.replace('~', '_').replace('^', '_')}"
    spec = importlib.util.spec_from_file_location(name, src)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {src}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    owners = getattr(module, "_OWNERS", None)
    if owners is not None:  # a revision whose modules name themselves to _native (provide): to the loaded one too
        owners.update(_native._OWNERS)
    return module


def _noop_launch(where: Path) -> tuple[ctypes.CDLL, int]:
    """A launch that does nothing, compiled: the library (keep it) and the function's address."""
    src, lib = where / "noop_launch.c", where / "noop_launch.so"
    src.write_text(_NOOP_LAUNCH)
    cmd = [*_native._compiler(), "-O2", "-shared", "-fPIC", str(src), "-o", str(lib)]
    subprocess.run(cmd, check=True, capture_output=True)
    dll = ctypes.CDLL(str(lib))
    return dll, int(ctypes.cast(dll.noop_launch, ctypes.c_void_p).value or 0)


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if len(values) > 1 \
        else values[0]


def fastpath_host_cost(comm: C.Communicator, base: str, *, calls: int = 200, rounds: int = 2001,
                       repo: Path | None = None) -> list[HostCostRecord]:
    """Per-call host time of the compiled fast path built from ``base``'s source and from the
    working tree's, for a repeated in-place all-reduce of 37 float32 elements (CPU tensors,
    stand-ins for the device, the stream and the launch: see the module docstring), through
    ``fast_verb`` and ``fast_dispatch``. ``comm`` is the default group's communicator (one
    rank suffices: nothing is communicated). The flight recorder records every call, as it
    does by default.

    Raises:
        RuntimeError: ``git show`` or a build failed, or a module did not run every call.
    """
    repo = _REPO if repo is None else repo
    x = torch.randn(37)
    sum_op = C.ReduceOp.SUM
    err = torch.zeros(8, dtype=torch.int32)
    key = _fast_key("all_reduce", "auto", sum_op, x, x)  # the working tree's: a base keyed otherwise misses, loudly

    def slow(o: torch.Tensor, i: torch.Tensor) -> None:
        raise RuntimeError("the prepared runner missed its ready launch")

    with tempfile.TemporaryDirectory(prefix="commops-fastpath-bench-") as tmp:
        where = Path(tmp)
        (where / "base").mkdir(mode=0o700)
        (where / "head").mkdir(mode=0o700)
        dll, launch = _noop_launch(where)
        base_native = _base_native(base, repo, where / "base")
        modules = {"base": base_native._import(base_native.build(where / "base")),
                   "head": _native._import(_native.build(where / "head"))}
        configures = {"base": base_native.configure, "head": _native.configure}
        entries: dict[str, tuple[Any, ...]] = {}
        for side, module in modules.items():
            configures[side](module, current_device=(-1).__int__, current_stream=int, launch_address=launch,
                             py_launch=slow, threads=512, device_flag="is_cpu")
            ready = {x.data_ptr(): (0xF00D, 7, _Params(0xBEEF), "one_shot_all_reduce")}
            entries[side] = (module.Runner(ready, err.data_ptr(), 0, slow, True), sum_op)
        saved = dict(comm._fast)
        saved_verb = dispatch._native_verb
        try:
            out = []
            for entry in ("fast_verb", "fast_dispatch", "verb"):
                if entry == "verb":  # both verbs over the working tree's build: only their Python differs
                    dispatch._native_verb = modules["head"].fast_verb
                    calls_of = {"base": _verb_loop(_base_verb(base, repo), x, sum_op),
                                "head": _verb_loop(C.all_reduce, x, sum_op)}
                    entries["base"] = entries["head"]
                else:
                    calls_of = {side: _caller(entry, getattr(m, entry), comm, x, sum_op) for side, m in modules.items()}
                per = _in_rounds(calls_of, entries, comm, key, calls, rounds)
                ratios = [h / b for h, b in zip(per["head"], per["base"], strict=True)]
                out.append(HostCostRecord(
                    entry, base, statistics.median(per["base"]), statistics.median(per["head"]),
                    paired_ratio(per, "head", "base"), _percentile(ratios, 0.1), _percentile(ratios, 0.9),
                    _percentile(per["base"], 0.1), _percentile(per["base"], 0.9),
                    _percentile(per["head"], 0.1), _percentile(per["head"], 0.9), rounds, calls))
        finally:
            dispatch._native_verb = saved_verb
            comm._fast.clear()
            comm._fast.update(saved)
        del dll
    return out


def _base_verb(rev: str, repo: Path) -> Callable[..., Any]:
    """``rev``'s ``collectives.all_reduce``: its source, defined over the working tree's package
    (its module's names), so that only the verb's own code differs from the working tree's."""
    tree = ast.parse(_git_show(rev, "collectives/__init__.py", repo))
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "all_reduce"]
    if not found:
        raise RuntimeError(f"{rev}'s collectives/__init__.py defines no all_reduce")
    namespace = dict(vars(C))
    exec(compile(ast.Module(body=found, type_ignores=[]), f"{rev}:collectives/__init__.py", "exec"), namespace)
    return namespace["all_reduce"]  # type: ignore[no-any-return]


def _verb_loop(verb: Callable[..., Any], x: torch.Tensor, reduce_op: Any) -> Callable[[int], None]:
    def loop(n: int) -> None:
        for _ in range(n):
            verb(x, reduce_op)
    return loop


class _Params:
    """What ``_launch.Kernel.prepare`` returns, as far as a launch reads it."""

    def __init__(self, params: int) -> None:
        self.params = params


def _caller(entry: str, fn: Callable[..., Any], comm: C.Communicator, x: torch.Tensor,
            reduce_op: Any) -> Callable[[int], None]:
    """A loop of ``n`` calls of ``fn`` (``fast_verb`` or ``fast_dispatch``) on ``x``."""
    if entry == "fast_verb":
        def loop(n: int) -> None:
            for _ in range(n):
                fn("all_reduce", x, x, reduce_op, None, False, "auto")
    else:
        def loop(n: int) -> None:
            for _ in range(n):
                fn(comm, "all_reduce", x, x, reduce_op, "auto")
    return loop


def _in_rounds(loops: dict[str, Callable[[int], None]], entries: dict[str, tuple[Any, ...]], comm: C.Communicator,
               key: tuple[Any, ...], calls: int, rounds: int) -> dict[str, list[float]]:
    """Microseconds per call of each side in each round (one block each, the order flipped every round)."""
    per: dict[str, list[float]] = {side: [] for side in loops}
    sides = list(loops)
    for side in sides:  # warm up, and check that each side runs the call
        comm._fast[key] = entries[side]
        _block(loops[side], comm, calls // 10 + 1, side)
    for i in range(rounds):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            comm._fast[key] = entries[side]
            per[side].append(_block(loops[side], comm, calls, side) * 1e6)
    return per


def _block(loop: Callable[[int], None], comm: C.Communicator, calls: int, side: str) -> float:
    seq = comm.seq
    t0 = time.perf_counter()
    loop(calls)
    t = (time.perf_counter() - t0) / calls
    if comm.seq != seq + calls:
        raise RuntimeError(f"{side}: {comm.seq - seq} of {calls} calls ran; the others went back to Python "
                           "(a key or check that differs between the builds?)")
    return t


def format_host_cost(records: list[HostCostRecord]) -> str:
    """A table: per entry point, base and head per-call microseconds and their paired ratio."""
    lines = ["| entry | base µs (p10–p90) | head µs (p10–p90) | head / base (p10–p90) | rounds × calls |",
             "| --- | --- | --- | --- | --- |"]
    for r in records:
        lines.append(f"| {r.entry} | {r.base_us:.3f} ({r.base_us_p10:.3f}–{r.base_us_p90:.3f}) | "
                     f"{r.head_us:.3f} ({r.head_us_p10:.3f}–{r.head_us_p90:.3f}) | "
                     f"{r.ratio:.3f} ({r.ratio_p10:.3f}–{r.ratio_p90:.3f}) | {r.rounds} × {r.calls} |")
    return "\n".join(lines)

