"""The MoE pipeline by source rank on GPUs (``tests/gpu_moe_sources_check.py`` under torchrun),
once at 2 and once at 3 ranks; ranks share GPUs where the machine has fewer (one GPU is enough).
One case per world size and family of its checks (``gpu_moe_sources_check.families()``).
Marker ``gpu``."""

from __future__ import annotations

import pytest
import torch

from tests import gpu_moe_sources_check
from tests._checks import NO_MULTICAST, ScriptRun, run_script

TIMEOUT_S = 600
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(TIMEOUT_S + 60)]  # the script's own limit reports first


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def sources_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    nproc = request.param
    out = tmp_path_factory.mktemp(f"moe_sources_{nproc}") / "checks.json"
    return run_script("tests/gpu_moe_sources_check.py", nproc, out, env=NO_MULTICAST, timeout=TIMEOUT_S)


@pytest.mark.parametrize("family", gpu_moe_sources_check.families())
def test_pipeline_by_source_rank_on_gpus(sources_run: ScriptRun, family: str) -> None:
    sources_run.assert_family(family)
