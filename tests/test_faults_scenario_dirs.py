"""Where the fault scenarios (launch/faults/) put their files: private directories, removed after the run.

No scenario runs here (the matrix is ``tests/test_faults_matrix.py``): the helpers that choose and
remove the directories are called directly, with a store standing in for the launcher's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ROOT / "launch" / "faults"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"faults_{name}", FAULTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scenario() -> ModuleType:
    return _module("_scenario")


@pytest.fixture(scope="module")
def run_all() -> ModuleType:
    return _module("run_all")


def test_no_launch_script_writes_to_a_fixed_path_in_tmp() -> None:
    fixed = re.compile(r"""["'](/tmp|/var/tmp|/dev/shm)/""")
    found = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "launch").rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if fixed.search(line)]
    assert found == []


def test_without_a_trace_dir_the_ranks_share_a_private_one_removed_at_the_end(scenario, monkeypatch,
                                                                               tmp_path) -> None:  # noqa: ANN001
    monkeypatch.delenv("COMMOPS_TRACE_DIR", raising=False)
    # what the old default was: someone else's link there must not be used
    fixed = Path("/tmp/commops-fault-unit_test_scenario")
    victim = tmp_path / "victim"
    victim.mkdir()
    if not fixed.exists() and not fixed.is_symlink():
        fixed.symlink_to(victim)
    try:
        store = dist.HashStore()
        made0, mine0 = scenario.trace_dir("unit_test_scenario", 0, store)
        made1, mine1 = scenario.trace_dir("unit_test_scenario", 1, store)
        assert made0 == made1 and mine0 and not mine1
        assert Path(made0).resolve() != fixed.resolve() and Path(made0).parent.resolve() != victim
        st = os.lstat(made0)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        Path(made0, "outcome_rank0.json").write_text("{}")
        scenario.finish(made1, mine1, store, world=2)  # rank 1 first: it removes nothing
        assert os.path.isdir(made0)
        scenario.finish(made0, mine0, store, world=2)
        assert not os.path.exists(made0)
        assert os.listdir(victim) == []
    finally:
        if fixed.is_symlink():
            fixed.unlink()


def test_the_rank_that_made_it_waits_for_the_others_then_removes_it(scenario, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("COMMOPS_TRACE_DIR", raising=False)
    store = dist.HashStore()
    made, mine = scenario.trace_dir("unit_test_wait", 0, store)
    late = threading.Timer(0.5, lambda: (Path(made, "outcome_rank1.json").write_text("{}"), store.add(
        scenario._FINISHED, 1)))
    late.start()
    scenario.finish(made, mine, store, world=2, bound_s=30)
    late.join()
    assert not os.path.exists(made)
    # a rank that never finishes (it crashed): removed once the bound has passed
    made, mine = scenario.trace_dir("unit_test_crash", 0, dist.HashStore())
    t0 = time.monotonic()
    scenario.finish(made, mine, dist.HashStore(), world=3, bound_s=0.3)
    assert not os.path.exists(made) and time.monotonic() - t0 < 10


def test_a_trace_dir_the_user_set_is_used_and_kept(scenario, monkeypatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("COMMOPS_TRACE_DIR", str(tmp_path))
    store = dist.HashStore()
    for rank in (0, 1):
        assert scenario.trace_dir("unit_test_kept", rank, store) == (str(tmp_path), False)
    scenario.finish(str(tmp_path), False, store, world=2, bound_s=0.1)
    assert tmp_path.is_dir()


def _fake_run(calls: list[tuple[str, int]]):  # noqa: ANN202
    """subprocess.run for run_all: the scenario's torchrun writes into its trace directory; ps lists nothing."""
    def run(cmd, **kwargs):  # noqa: ANN001, ANN202
        if cmd[0] == "ps":
            return subprocess.CompletedProcess(cmd, 0, "", "")
        trace = kwargs["env"]["COMMOPS_TRACE_DIR"]
        calls.append((trace, stat.S_IMODE(os.lstat(trace).st_mode)))
        Path(trace, "outcome_rank0.json").write_text('{"rank": 0, "raised": null, "detect_s": 0.1}')
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


@pytest.mark.parametrize("keep", [False, True])
def test_run_all_removes_each_trace_dir_unless_asked_to_keep_it(run_all, monkeypatch, capsys, keep) -> None:  # noqa: ANN001
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(run_all.subprocess, "run", _fake_run(calls))
    monkeypatch.setattr(run_all.time, "sleep", lambda s: None)
    row = run_all.run_one("straggler", "straggler", 3, 1.0, keep=keep)
    [(trace, mode)] = calls
    assert mode == 0o700
    err = capsys.readouterr().err
    if keep:
        assert os.path.isdir(trace) and row["trace_dir"] == trace and trace in err
        for p in Path(trace).iterdir():
            p.unlink()
        os.rmdir(trace)
    else:
        assert not os.path.exists(trace) and row["trace_dir"] is None and trace not in err
