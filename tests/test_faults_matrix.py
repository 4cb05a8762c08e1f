"""The CPU fault matrix (``launch/faults/run_all.py``): every scenario detected, the culprit and the
call named, every rank gone within timeout + 15 s of the fault, no process left (3 Gloo ranks, 3 s timeouts).

Each row is 10-15 s of 3-4 ranks on two cores, so the default run takes one scenario per way a
fault is caught: a rank that never calls (the timeout names it), a crash, a mismatch found by the
arguments' agreement (shape; the dtype, reduce-op and root ones go the same way), a straggler
that must not be reported, the MoE layer's all-to-all, the debug mode's hang and size checks, a
hang inside a sub-group algorithm (hierarchical), and one rank's failure under the 30-minute
group timeout, raised in an algorithm and as a size the others do not agree with. The rest, the
same mechanisms on other ops and algorithms, run in ``test_every_other_fault_is_detected``
(marker ``slow``, about 3 minutes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launch" / "faults"))

from run_all import FAST_CASES, FAST_DETECT_S, HANG_ALGORITHMS, SCENARIOS  # noqa: E402

BASE = ("skipped_collective", "rank_crash", "shape_mismatch", "dtype_mismatch", "reduce_op_mismatch", "root_mismatch",
        "straggler", "skipped_moe_layer", "debug_hang", "debug_size_mismatch")
DEFAULT = ("skipped_collective", "rank_crash", "shape_mismatch", "straggler", "skipped_moe_layer", "debug_hang",
           "debug_size_mismatch", "algorithm_hang[hierarchical]", "one_rank_fails[raises_in_algorithm]",
           "one_rank_fails[different_size]")


def _matrix(tmp_path: Path, names: list[str]) -> list[dict]:
    out = tmp_path / "faults.json"
    proc = subprocess.run([sys.executable, "launch/faults/run_all.py", "--timeout", "3", "--json", str(out),
                           "--only", ",".join(names)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted(r["scenario"] for r in rows) == sorted(names)
    for r in rows:
        culprit = 3 if r["scenario"] == "algorithm_hang[grid2d]" else 2  # grid2d runs on a 2 x 2 grid
        assert r["detected"] and r["culprit_named"] == [culprit] and r["seq"] is not None, r
        assert r["all_exited"] and r["processes_left"] == 0, r
    return rows


def _check_fast(rows: list[dict]) -> None:
    """One rank's failure with the group's timeout at 30 minutes: the others raised within seconds."""
    fast = [r for r in rows if r["scenario"].startswith("one_rank_fails[")]
    assert all(r["detect_s"] <= FAST_DETECT_S for r in fast), fast


def test_the_matrix_lists_every_scenario_once() -> None:
    every = set(BASE) | {f"algorithm_hang[{a}]" for a in HANG_ALGORITHMS} | {f"one_rank_fails[{c}]" for c in FAST_CASES}
    assert every == set(SCENARIOS) and set(DEFAULT) <= every


def test_each_way_a_cpu_fault_is_caught_detects_and_diagnoses(tmp_path: Path) -> None:
    _check_fast(_matrix(tmp_path, list(DEFAULT)))


@pytest.mark.slow
def test_every_other_fault_is_detected(tmp_path: Path) -> None:
    rest = [n for n in SCENARIOS if n not in DEFAULT]
    rows = _matrix(tmp_path, rest)
    _check_fast(rows)
    assert all(r["detect_s"] <= 3 + 5 for r in rows if r["scenario"].startswith("algorithm_hang[")), rows
