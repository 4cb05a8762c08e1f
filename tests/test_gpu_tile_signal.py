"""The ``tile_signal`` overlap strategy on GPUs (``tests/gpu_tile_signal_check.py`` under torchrun):
reduce-scatter and all-reduce against float64, ring slots reused within a call, CUDA-graph
replays with new data, a 1,000-call soak; at 2 and 3 ranks sharing GPUs where the machine has
fewer (one GPU is enough). One case per world size and family. Marker ``gpu``."""

from __future__ import annotations

import pytest
import torch

from tests import gpu_tile_signal_check
from tests._checks import NO_MULTICAST, ScriptRun, run_script

TIMEOUT_S = 600
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(TIMEOUT_S + 60)]  # the script's own limit reports first


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def tile_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    nproc = request.param
    out = tmp_path_factory.mktemp(f"tile_{nproc}") / "checks.json"
    return run_script("tests/gpu_tile_signal_check.py", nproc, out, env=NO_MULTICAST, timeout=TIMEOUT_S)


@pytest.mark.parametrize("family", gpu_tile_signal_check.families())
def test_tile_signal_on_gpus(tile_run: ScriptRun, family: str) -> None:
    tile_run.assert_family(family)
