"""On CUDA GPUs: every algorithm of every op over NCCL, checked against float64 (#wrong == 0).

Runs the collectives benchmark as users do (torchrun, one rank per GPU) with the check on, in
eager mode and under CUDA graphs, and fails on any wrong element. Marker ``gpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu

_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.parametrize("graph", ["0", "1"])
def test_every_algorithm_on_nccl(graph: str) -> None:
    n = torch.cuda.device_count()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **_NO_MULTICAST)
    for dtype in ("bfloat16", "float"):
        res = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
             "launch/bench_collectives.py", "--op", "all", "-b", "8", "-e", "64M", "-f", "16", "-d", dtype,
             "-n", "3", "-r", "1", "-w", "1", "-c", "1", "-G", graph, "--out", "none"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
        )
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        rows = [ln.split() for ln in res.stdout.splitlines() if ln[:12].strip().isdigit()]
        assert rows and all(r[8] == "0" for r in rows), res.stdout
