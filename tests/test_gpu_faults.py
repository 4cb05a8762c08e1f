"""On GPUs: the NCCL fault matrix (``launch/faults/run_all.py --gpu``): skipped collective, a rank
killed, the shape, dtype, reduce-op and root mismatches, and a rank that skips its MoE layer,
each detected with the culprit and the call named, every rank gone within timeout + 15 s, no
process left. Marker ``gpu``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu


def test_nccl_fault_matrix(tmp_path: Path) -> None:
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"the fault scenarios need 2 or more GPUs; this machine has {n}")
    out = tmp_path / "faults.json"
    proc = subprocess.run([sys.executable, "launch/faults/run_all.py", "--gpu", "--timeout", "10", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert {r["scenario"] for r in rows} == {"skipped_collective", "rank_crash", "shape_mismatch", "dtype_mismatch",
                                              "reduce_op_mismatch", "root_mismatch", "skipped_moe_layer"}, rows
    for r in rows:
        assert r["detected"] and r["culprit_named"] == [n - 1] and r["seq"] is not None, r
