"""The overlapped MoE forms on GPUs (``tests/gpu_moe_overlap_check.py`` under torchrun): micro-batches
forward and backward against float64, and 1,000-layer soaks eagerly and from a CUDA graph; once
at 2 and once at 3 ranks, sharing GPUs where the machine has fewer (one GPU is enough). One case
per world size and family. Marker ``gpu``."""

from __future__ import annotations

import pytest
import torch

from tests import gpu_moe_overlap_check
from tests._checks import NO_MULTICAST, ScriptRun, run_script

TIMEOUT_S = 600
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(TIMEOUT_S + 60)]  # the script's own limit reports first


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def overlap_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    nproc = request.param
    out = tmp_path_factory.mktemp(f"moe_overlap_{nproc}") / "checks.json"
    return run_script("tests/gpu_moe_overlap_check.py", nproc, out, env=NO_MULTICAST, timeout=TIMEOUT_S)


@pytest.mark.parametrize("family", gpu_moe_overlap_check.families())
def test_overlapped_moe_on_gpus(overlap_run: ScriptRun, family: str) -> None:
    overlap_run.assert_family(family)
