"""On the GPUs of one node: overlap operators, tensor-parallel layers and the MoE layer over NCCL,
checked by ``tests/gpu_overlap_check.py`` under torchrun, once for the module; one case per family
of its checks (``gpu_overlap_check.families("cuda")``). The same script runs on CPU over Gloo in
``test_overlap_check_script_on_gloo``, one case per family it has there (the default suite).
Marker ``gpu`` for the GPU run."""

from __future__ import annotations

import pytest
import torch

from tests import gpu_overlap_check
from tests._checks import NO_MULTICAST, ScriptRun, run_script

TIMEOUT_S = 900


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"needs 2 or more GPUs on one node; this machine has {n}")
    return run_script("tests/gpu_overlap_check.py", n, tmp_path_factory.mktemp("overlap_gpu") / "checks.json",
                      env=NO_MULTICAST, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    return run_script("tests/gpu_overlap_check.py", 2, tmp_path_factory.mktemp("overlap_gloo") / "checks.json",
                      env={"CUDA_VISIBLE_DEVICES": ""}, timeout=TIMEOUT_S)


@pytest.mark.gpu
@pytest.mark.timeout(TIMEOUT_S + 60)  # the script's own limit reports first, with its output
@pytest.mark.parametrize("family", gpu_overlap_check.families("cuda"))
def test_overlap_on_gpus(gpu_run: ScriptRun, family: str) -> None:
    gpu_run.assert_family(family)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("family", gpu_overlap_check.families("cpu"))
def test_overlap_check_script_on_gloo(gloo_run: ScriptRun, family: str) -> None:
    gloo_run.assert_family(family)


@pytest.mark.gpu
def test_pinned_offsets_never_overwrite_a_pending_copy() -> None:
    """``GroupedSwiGLU``'s offsets ring (``overlap.moe.experts._PinnedSlots``): with the GPU held behind
    the host, more sends than slots must neither wait for the GPU nor overwrite a buffer whose copy
    has not run; every vector lands as sent."""
    import numpy as np

    from overlap.moe.experts import _PinnedSlots

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
