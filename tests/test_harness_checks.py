"""The GPU check scripts' reporting (``tests/_checks.py``): a rank's records by family, the
ranks' records merged, and the verdict of each family's pytest case, which must fail, with the
script's output, when the script failed a check, crashed, timed out or left a family out.

A small script runs under torchrun on Gloo (two ranks): failing a check on rank 1, crashing
on rank 1 before anything is written, and hanging past its time limit.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests._checks import ROOT, Checks, ScriptRun, check_arguments, merge, run_script, write_results


def test_checks_are_counted_and_failed_by_family() -> None:
    ck = Checks(["a", "b", "c"], rank=0)
    with ck.family("a"):
        ck.count(2)
        with ck.family("b"):  # the innermost family wins
            ck.count()
            ck.fail("b went wrong", "twice")
        ck.fail("a went wrong")
    assert ck.results() == {"a": {"checks": 2, "failures": ["a went wrong"]},
                            "b": {"checks": 1, "failures": ["b went wrong", "twice"]},
                            "c": {"checks": 0, "failures": []}}
    assert ck.checks == 3 and ck.failures == ["a went wrong", "b went wrong", "twice"]


def test_begin_names_the_family_of_the_checks_that_follow() -> None:
    ck = Checks(["a", "b", "c"], rank=0)
    ck.begin("a")
    ck.count()
    with ck.family("b"):
        ck.begin("c")  # within the block, until the block ends
        ck.count()
    ck.count()  # "a" again
    assert [ck.results()[f]["checks"] for f in "abc"] == [2, 0, 1]
    with pytest.raises(KeyError, match="not among the declared"):
        ck.begin("typo")


def test_a_check_outside_the_declared_families_is_refused() -> None:
    ck = Checks(["a"], rank=0)
    with pytest.raises(RuntimeError, match="outside any family"):
        ck.count()
    with pytest.raises(KeyError, match="not among the declared"):
        with ck.family("typo"):
            pass
    with pytest.raises(ValueError, match="twice"):
        Checks(["a", "a"], rank=0)


def test_merge_keeps_each_rank_s_count() -> None:
    r0 = {"a": {"checks": 2, "failures": []}, "b": {"checks": 1, "failures": ["r0 b"]}}
    r1 = {"a": {"checks": 3, "failures": ["r1 a"]}}
    assert merge([r0, r1]) == {"a": {"checks": 5, "per_rank": [2, 3], "failures": ["r1 a"]},
                               "b": {"checks": 1, "per_rank": [1, 0], "failures": ["r0 b"]}}


def _run(returncode: int | None, results: dict | None, stderr: str = "the stderr") -> ScriptRun:
    return ScriptRun("tests/x_check.py", 2, 60, returncode, "the stdout", stderr, results,
                     "" if results is not None else "checks.json was not written")


_GOOD = {"a": {"checks": 4, "per_rank": [2, 2], "failures": []},
         "b": {"checks": 1, "per_rank": [1, 0], "failures": []},
         "c": {"checks": 2, "per_rank": [1, 1], "failures": ["rank 1 c: 3 wrong"]}}


@pytest.mark.parametrize("returncode, results, family, says", [
    (0, _GOOD, "a", None),
    (1, _GOOD, "a", None),  # the exit code is c's failure
    (1, _GOOD, "c", "1 failed of 2 checks:\nrank 1 c: 3 wrong"),
    (0, _GOOD, "b", "no check ran on rank(s) [1]"),
    (0, _GOOD, "d", "reported no family 'd'"),
    (1, {"a": _GOOD["a"]}, "a", "exit 1 though no check failed"),
    (1, None, "a", "exit 1, no results (checks.json was not written)"),
    (None, None, "a", "killed after its 60 s limit"),
], ids=["passed", "exit-explained", "failed", "idle-rank", "missing-family", "exit-unexplained", "crashed",
        "timed-out"])
def test_a_family_s_verdict(returncode: int | None, results: dict | None, family: str, says: str | None) -> None:
    problem = _run(returncode, results).problem(family)
    if says is None:
        assert problem is None
    else:
        assert problem is not None and says in problem
        if returncode != 0 and "failed of" not in says and "no check ran" not in says:
            assert "the stderr" in problem and "the stdout" in problem  # the script's own words


_SCRIPT = """
import argparse, os, sys, time
sys.path.insert(0, {root!r})
import torch.distributed as dist
from tests._checks import Checks, write_results

p = argparse.ArgumentParser()
p.add_argument("--json")
args = p.parse_args()
dist.init_process_group("gloo")
r = dist.get_rank()
ck = Checks(["ok", "bad"], r)
with ck.family("ok"):
    ck.count()
with ck.family("bad"):
    ck.count()
    if r == 1:
        if os.environ.get("CRASH"):
            raise RuntimeError("rank 1 fell over")
        if os.environ.get("HANG"):
            print("rank 1 hangs", flush=True)
            time.sleep(300)
        ck.fail("rank 1: wrong")
every = ck.gather()
if r == 0:
    write_results(args.json, every)
dist.destroy_process_group()
sys.exit(1 if ck.failures else 0)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("checks") / "tiny_check.py"
    path.write_text(_SCRIPT.format(root=str(ROOT)))
    return path


def test_a_failed_check_fails_its_family_alone(script: Path, tmp_path: Path) -> None:
    run = run_script(str(script), 2, tmp_path / "checks.json", env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert run.returncode != 0
    assert run.results == {"ok": {"checks": 2, "per_rank": [1, 1], "failures": []},
                           "bad": {"checks": 2, "per_rank": [1, 1], "failures": ["rank 1: wrong"]}}
    assert run.problem("ok") is None
    assert "rank 1: wrong" in (run.problem("bad") or "")


def test_a_crash_fails_every_family_with_its_stderr(script: Path, tmp_path: Path) -> None:
    run = run_script(str(script), 2, tmp_path / "checks.json", env={"CUDA_VISIBLE_DEVICES": "", "CRASH": "1"},
                     timeout=120)
    assert run.returncode != 0 and run.results is None
    for family in ("ok", "bad"):
        problem = run.problem(family) or ""
        assert "no results" in problem and "rank 1 fell over" in problem, problem
    with pytest.raises(pytest.fail.Exception, match="rank 1 fell over"):
        run.assert_family("ok")


def test_a_hung_run_is_ended_whole(script: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    run = run_script(str(script), 2, tmp_path / "checks.json", env={"CUDA_VISIBLE_DEVICES": "", "HANG": "1"},
                     timeout=10)
    assert run.returncode is None and time.monotonic() - t0 < 60
    assert "killed after its 10 s limit" in (run.problem("ok") or "")
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if str(script).encode() in _read(p)]
    assert not left, "ranks left running"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def test_results_are_written_whole(tmp_path: Path) -> None:
    write_results(tmp_path / "r.json", _GOOD)
    assert json.loads((tmp_path / "r.json").read_text()) == _GOOD
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_check_scripts_arguments_name_its_families() -> None:
    fams = ("a/bf16", "a/fp16", "soak")
    assert check_arguments(fams, []).only == set(fams)  # every family by default
    args = check_arguments(fams, ["--only", "soak,a/fp16", "--json", "x.json"])
    assert args.only == {"soak", "a/fp16"} and args.json == "x.json"
    assert check_arguments(fams, ["-v"], verbose=True).verbose
    with pytest.raises(SystemExit):  # -v only where the script offers it
        check_arguments(fams, ["-v"])
