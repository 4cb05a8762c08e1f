"""A short soak in CI (``launch/soak.py``): randomised collectives on 3 Gloo ranks, 0 mismatches; and
the same run with outputs corrupted on purpose must report them (the check can fail)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _soak(*extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           "launch/soak.py", "-n", "600", "--seed", "7", *extra], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_short_soak_has_no_mismatch() -> None:
    proc = _soak()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "600 collectives on 3 ranks (gloo), seed 7: 0 mismatches" in proc.stdout


def test_soak_reports_corrupted_outputs() -> None:
    proc = _soak("--self-check", "50")
    assert proc.returncode == 1
    found = re.search(r"seed 7: (\d+) mismatches", proc.stdout)
    assert found and 1 <= int(found.group(1)) <= 12, proc.stdout[-2000:]
