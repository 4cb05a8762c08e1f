"""The model zoo's representative families on one GPU (``tests/gpu_models_check.py`` under torchrun):
each sharded from its plans, its decode step eager and replayed from a CUDA graph against the
unsharded model, at world 1 over NCCL and with 2 ranks sharing the GPU (peer memory). One case per
world size and family. Marker ``gpu``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests import gpu_models_check  # noqa: E402
from tests._checks import NO_MULTICAST, ScriptRun, run_script  # noqa: E402

TIMEOUT_S = 600
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(TIMEOUT_S + 60)]  # the script's own limit reports first


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"{n}ranks")
def zoo_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    nproc = request.param
    out = tmp_path_factory.mktemp(f"zoo_{nproc}") / "checks.json"
    return run_script("tests/gpu_models_check.py", nproc, out, env=NO_MULTICAST, timeout=TIMEOUT_S)


@pytest.mark.parametrize("family", gpu_models_check.families())
def test_zoo_family_on_one_gpu(zoo_run: ScriptRun, family: str) -> None:
    zoo_run.assert_family(family)
