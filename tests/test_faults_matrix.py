"""The CPU fault matrix (``launch/faults/run_all.py``): every scenario detected, the culprit and the
call named, every rank gone within timeout + 15 s, no process left (3 Gloo ranks, 3 s timeouts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_cpu_fault_is_detected_and_diagnosed(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    proc = subprocess.run([sys.executable, "launch/faults/run_all.py", "--timeout", "3", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["scenario"] for r in rows} == {"skipped_collective", "rank_crash", "shape_mismatch", "dtype_mismatch",
                                              "reduce_op_mismatch", "root_mismatch", "straggler", "skipped_moe_layer",
                                              "debug_hang", "debug_size_mismatch"}
    for r in rows:
        assert r["detected"] and r["culprit_named"] == [2] and r["seq"] is not None, r
        assert r["all_exited"] and r["processes_left"] == 0, r
