"""Settings that must agree across ranks (``collectives/_agree.py``), on Gloo with three ranks.

One rank is given a different value of one setting (its environment, with the settings' cache
cleared, or an attribute of its communicator); the group's first call must raise
``SettingsMismatch`` on every rank with the same text naming the setting, the ranks and their
values, before any trace hook or torch.distributed call saw it. Equal settings pass, and the
check costs one store exchange per communicator, not one per call. On GPUs (marker ``gpu``):
peer memory sized from the agreed ``COMMOPS_PEER_BYTES`` (``tests/gpu_settings_check.py`` under
torchrun), one case per family of its checks.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import collectives as C
from collectives import _env
from tests import gpu_settings_check
from tests._checks import NO_MULTICAST, ScriptRun, run_script

# isend and irecv are left as they are: P2POp accepts only those very functions (our schedules
# send through batch_isend_irecv, counted here).
_SENDS = ("all_reduce", "all_gather_into_tensor", "all_to_all_single", "broadcast", "reduce", "batch_isend_irecv",
          "send", "recv", "all_gather", "all_gather_object")


@contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set these variables in this rank for the block, with the settings' cache cleared around it."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    _env._read.cache_clear()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _env._read.cache_clear()


@contextmanager
def _counting_sends() -> Iterator[list[str]]:
    """The trace hooks' "start" events and torch.distributed's sends entered inside the block."""
    seen: list[str] = []
    hook = lambda event, call, detail: seen.append(f"hook {event} {call.op}")  # noqa: E731
    saved = {n: getattr(dist, n) for n in _SENDS if hasattr(dist, n)}

    def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            seen.append(f"torch {name}")
            return fn(*a, **k)
        return wrapper

    C.add_trace_hook(hook)
    for n, fn in saved.items():
        setattr(dist, n, counting(n, fn))
    try:
        yield seen
    finally:
        C.remove_trace_hook(hook)
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _files(directory: str) -> dict[str, str]:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tuned = {"meta": {"world": 99}, "entries": []}  # measured on another world size: never followed
    out = {"tuned": d / "tuned.json", "overlap": d / "overlap_tuned.json", "topology": d / "topology.json",
           "calibration": d / "calibration.json"}
    for name, path in out.items():
        if not path.exists():
            # Every rank writes them: through a file of its own, renamed, so that no rank reads
            # (or digests) one half written by another.
            part = path.with_suffix(f".{os.getpid()}")
            part.write_text(json.dumps(tuned if name != "topology" else {"nodes": [[0, 1, 2]]}))
            os.replace(part, path)
    return {k: str(v) for k, v in out.items()}


# case -> (what the last rank changes, the setting's name in the error, words of the two sides)
CASES = {
    "peer_bytes": ("env", "COMMOPS_PEER_BYTES", "134217728", str(64 << 20)),
    "tuned": ("env", "COMMOPS_TUNED", "tuned.json' (sha256 ", "unset"),
    "overlap_tuned": ("env", "COMMOPS_OVERLAP_TUNED", "overlap_tuned.json' (sha256 ", "unset"),
    "kernels_tuned": ("env", "COMMOPS_KERNELS_TUNED", "overlap_tuned.json' (sha256 ", "unset"),
    "set_tuned": ("attr", "set_tuned", "a table (sha256 ", "none"),
    "topology": ("env", "COMMOPS_TOPOLOGY", "topology.json' (sha256 ", "unset"),
    "debug_env": ("env", "debug mode (COMMOPS_DEBUG / comm.debug)", "on", "off"),
    "debug_attr": ("attr", "debug mode (COMMOPS_DEBUG / comm.debug)", "on", "off"),
    "calibration": ("env", "COMMOPS_CALIBRATION", "calibration.json' (sha256 ", "unset"),
}


def _variables(case: str, files: dict[str, str]) -> dict[str, str]:
    return {"peer_bytes": {"COMMOPS_PEER_BYTES": str(128 << 20)}, "tuned": {"COMMOPS_TUNED": files["tuned"]},
            "overlap_tuned": {"COMMOPS_OVERLAP_TUNED": files["overlap"]},
            "kernels_tuned": {"COMMOPS_KERNELS_TUNED": files["overlap"]},
            "topology": {"COMMOPS_TOPOLOGY": files["topology"]}, "debug_env": {"COMMOPS_DEBUG": "1"},
            "calibration": {"COMMOPS_CALIBRATION": files["calibration"]}}.get(case, {})


def _differ(rank: int, world: int, case: str, directory: str) -> dict[str, object]:
    files = _files(directory)
    odd = rank == world - 1
    out: dict[str, object] = {"raised": None}
    with _environ(_variables(case, files) if odd else {}):
        g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=30))
        comm = C.get_communicator(g)
        if odd and case == "set_tuned":
            comm.set_tuned({"meta": {"world": 99}, "entries": []})
        if odd and case == "debug_attr":
            comm.debug = True
        t0 = time.monotonic()
        with _counting_sends() as seen:
            try:
                C.all_reduce(torch.ones(4), group=g)
            except C.SettingsMismatch as exc:
                out.update(raised="SettingsMismatch", message=str(exc), setting=exc.setting, differ=exc.differ)
        out["seconds"], out["seen"], out["seq"] = time.monotonic() - t0, seen, comm.seq
    dist.barrier()
    C.destroy(g)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_a_setting_that_differs_on_one_rank_raises_on_every_rank_before_sending(worlds, case: str,  # noqa: ANN001
                                                                                tmp_path: Path) -> None:
    world = 3
    results = worlds(world).run(_differ, case, str(tmp_path), timeout=120)
    _, setting, odd_value, usual_value = CASES[case]
    assert all(r["raised"] == "SettingsMismatch" for r in results), results
    assert len({r["message"] for r in results}) == 1, results  # the same text on every rank
    assert all(r["seen"] == [] and r["seq"] == 0 for r in results), results  # nothing sent, no call counted
    assert all(r["seconds"] < 5.0 for r in results), [r["seconds"] for r in results]
    res = results[0]
    assert res["setting"] == setting and list(res["differ"]) == [setting], res  # type: ignore[call-overload]
    sides = res["differ"][setting]  # type: ignore[index]
    assert [ranks for ranks in sides.values()] == [[0, 1], [2]], sides
    usual, odd = list(sides)
    assert usual_value in usual and odd_value in odd, sides
    msg = str(res["message"])
    assert f"{setting}: rank(s) [0, 1] have {usual}; rank(s) [2] have {odd}" in msg, msg
    assert "Fix:" in msg


def _agreeing(rank: int, world: int, directory: str) -> dict[str, object]:
    from collectives import _agree

    files = _files(directory)
    # The same settings everywhere; the last rank reads the same tuned table from a copy of its own.
    copy = Path(directory, f"tuned_copy{rank}.json")
    copy.write_text(Path(files["tuned"]).read_text())
    same = {"COMMOPS_PEER_BYTES": str(32 << 20), "COMMOPS_TUNED": str(copy) if rank == world - 1 else files["tuned"]}
    exchanges: list[str] = []
    real = _agree.store_gather

    def counted(*a: Any, **k: Any) -> list[str]:
        exchanges.append(a[1])
        return real(*a, **k)

    _agree.store_gather = counted  # type: ignore[assignment]
    try:
        with _environ(same):
            per_comm = []
            for _ in range(2):
                g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=30))
                comm = C.get_communicator(g)
                comm.debug = True  # on every rank: agrees, and its per-call exchange is debug.py's own
                before = len(exchanges)
                x = torch.ones(4)
                for _ in range(5):
                    C.all_reduce(x, group=g)
                per_comm.append(len(exchanges) - before)
                agreed = comm._settings
                dist.barrier()
                C.destroy(g)
    finally:
        _agree.store_gather = real  # type: ignore[assignment]
    return {"per_comm": per_comm, "value": x.tolist(), "peer_bytes": agreed.peer_bytes if agreed else None,
            "debug": agreed.debug if agreed else None}


def test_equal_settings_pass_with_one_exchange_per_communicator(worlds, tmp_path: Path) -> None:  # noqa: ANN001
    world = 3
    for res in worlds(world).run(_agreeing, str(tmp_path), timeout=120):
        assert res["per_comm"] == [1, 1], res  # five calls on each of two communicators
        assert res["value"] == [float(world ** 5)] * 4, res
        assert res["peer_bytes"] == 32 << 20 and res["debug"] is True, res


_LATE_CALLS = {"all_reduce": lambda g: C.all_reduce(torch.ones(4), group=g),
               "all_reduce ring": lambda g: C.all_reduce(torch.ones(1000), group=g, algorithm="ring"),
               "barrier": lambda g: C.barrier(group=g)}


def _late(rank: int, world: int) -> dict[str, dict[str, object]]:
    """Each call first on a fresh group whose own timeout is 300 s, the last rank never making it."""
    got: dict[str, dict[str, object]] = {}
    for name, call in _LATE_CALLS.items():
        g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=300))
        out: dict[str, object] = {"raised": None}
        t0 = time.monotonic()
        if rank != world - 1:
            try:
                with C.call_timeout(3.0):
                    call(g)
            except C.CollectiveTimeout as exc:
                out.update(raised="CollectiveTimeout", missing=exc.missing, message=str(exc))
        out["seconds"] = time.monotonic() - t0
        got[name] = out
        dist.barrier()
        C.destroy(g)
    return got


def test_the_settings_check_is_bounded_by_the_calls_timeout(worlds) -> None:  # noqa: ANN001
    world = 3
    for rank_res in worlds(world).run(_late, timeout=120)[:-1]:
        for name, res in rank_res.items():
            assert res["raised"] == "CollectiveTimeout" and res["missing"] == [world - 1], (name, res)
            assert 2.5 < res["seconds"] < 8.0, (name, res)
            # ours names who did not arrive; torch's words too, which its callers and tests match
            assert "did not reach it" in res["message"] and "Timed out" in res["message"], (name, res)


@pytest.fixture(scope="module")
def peer_bytes_run(tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    """``tests/gpu_settings_check.py`` on two ranks (sharing a GPU where there is one), with no
    ``COMMOPS_PEER_BYTES`` of its own."""
    with pytest.MonkeyPatch.context() as mp:  # the script's environment is this one's, less that
        mp.delenv("COMMOPS_PEER_BYTES", raising=False)
        return run_script("tests/gpu_settings_check.py", 2, tmp_path_factory.mktemp("settings") / "checks.json",
                          env=NO_MULTICAST, timeout=600)


@pytest.mark.gpu
@pytest.mark.timeout(660)  # the script's own limit reports first, with its output
@pytest.mark.parametrize("family", gpu_settings_check.families())
def test_peer_memory_is_sized_from_the_agreed_peer_bytes(peer_bytes_run: ScriptRun, family: str) -> None:
    peer_bytes_run.assert_family(family)
