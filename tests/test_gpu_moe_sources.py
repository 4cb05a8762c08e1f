"""The MoE pipeline by source rank on GPUs (``tests/gpu_moe_sources_check.py`` under torchrun),
at 2 and 3 ranks; ranks share GPUs where the machine has fewer (one GPU is enough). Marker ``gpu``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.gpu
@pytest.mark.parametrize("nproc", [2, 3])
def test_pipeline_by_source_rank_on_gpus(nproc: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = dict(os.environ, PYTHONUNBUFFERED="1", **_NO_MULTICAST)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(nproc), "tests/gpu_moe_sources_check.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-4000:]
    assert res.stdout.count(" 0 failed") == nproc, res.stdout[-6000:]
