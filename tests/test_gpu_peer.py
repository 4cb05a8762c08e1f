"""On the GPUs of one node: the peer-memory collectives (``collectives/peer``), checked by
``tests/gpu_peer_check.py`` under torchrun. Marker ``gpu``; needs two GPUs or more."""

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


def test_peer_memory_collectives() -> None:
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"peer memory needs 2 or more GPUs on one node; this machine has {n}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **_NO_MULTICAST)
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
         "tests/gpu_peer_check.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-6000:]
    assert " 0 failed" in res.stdout, res.stdout[-6000:]
