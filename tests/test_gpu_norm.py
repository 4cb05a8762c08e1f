"""The fused all-reduce + residual + RMSNorm on GPUs (``tests/gpu_norm_check.py`` under torchrun):
every kernel against float64, the same bits on every rank, CUDA-graph replays with new data,
1,000-call soaks; at 1 rank (the one-rank kernel) and at 2 and 3 ranks sharing GPUs where the
machine has fewer (one GPU is enough). One case per world size and family. Marker ``gpu``."""

from __future__ import annotations

import pytest
import torch

from tests import gpu_norm_check
from tests._checks import NO_MULTICAST, ScriptRun, run_script

TIMEOUT_S = 600
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(TIMEOUT_S + 60)]  # the script's own limit reports first


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"{n}ranks")
def norm_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    nproc = request.param
    out = tmp_path_factory.mktemp(f"norm_{nproc}") / "checks.json"
    return run_script("tests/gpu_norm_check.py", nproc, out, env=NO_MULTICAST, timeout=TIMEOUT_S)


@pytest.mark.parametrize("family", gpu_norm_check.families())
def test_fused_norm_on_gpus(norm_run: ScriptRun, family: str) -> None:
    norm_run.assert_family(family)
