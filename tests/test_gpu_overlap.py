"""On the GPUs of one node: overlap operators, tensor-parallel layers and the MoE layer over NCCL,
checked by ``tests/gpu_overlap_check.py`` under torchrun (the same script runs on Gloo in
``test_overlap_check_script_on_gloo``). Marker ``gpu`` for the GPU run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _run(nproc: int, extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra_env)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), "tests/gpu_overlap_check.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.gpu
def test_overlap_on_gpus() -> None:
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 or more GPUs on one node; this machine has {n}")
    res = _run(n, _NO_MULTICAST)
    assert res.returncode == 0 and " 0 failed" in res.stdout, res.stdout[-6000:] + res.stderr[-4000:]


def test_overlap_check_script_on_gloo() -> None:
    res = _run(2, {"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 0 and " 0 failed" in res.stdout, res.stdout[-6000:] + res.stderr[-4000:]


@pytest.mark.gpu
def test_pinned_offsets_never_overwrite_a_pending_copy() -> None:
    """``GroupedSwiGLU``'s offsets ring (``overlap.moe._PinnedSlots``): with the GPU held behind
    the host, more sends than slots must neither wait for the GPU nor overwrite a buffer whose copy
    has not run; every vector lands as sent."""
    import numpy as np

    from overlap.moe import _PinnedSlots

    dev = torch.device("cuda", torch.cuda.current_device())
    ring = _PinnedSlots(slots=4)
    a = torch.randn(4096, 4096, device=dev)
    rng = np.random.default_rng(0)
    sent, got = [], []
    for _ in range(3):
        a @ a  # keeps the GPU busy while the copies below queue up behind it
    for i in range(11):  # wraps the ring twice while the copies are pending
        v = rng.integers(0, 1 << 30, size=5 + i, dtype=np.int32)
        sent.append(v.copy())
        got.append(ring.send(v, dev))
        v[:] = -1  # the caller's array may change at once
    torch.cuda.synchronize()
    for v, t in zip(sent, got):
        assert t.dtype == torch.int32 and t.device == dev
        assert np.array_equal(t.cpu().numpy(), v)
