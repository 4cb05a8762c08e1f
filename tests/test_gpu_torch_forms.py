"""On CUDA GPUs (world 1 on one GPU): torch's list forms and complex tensors over NCCL, checked by
``tests/gpu_torch_forms_check.py`` under torchrun, one case per family. Marker ``gpu``; the same
forms run on Gloo in ``tests/test_collectives_torch_forms.py`` (the default suite)."""

from __future__ import annotations

import pytest
import torch

from tests import gpu_torch_forms_check
from tests._checks import NO_MULTICAST, ScriptRun, run_script

pytestmark = pytest.mark.gpu
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    return run_script("tests/gpu_torch_forms_check.py", torch.cuda.device_count(),
                      tmp_path_factory.mktemp("forms_gpu") / "checks.json", env=NO_MULTICAST, timeout=TIMEOUT_S)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("family", gpu_torch_forms_check.families())
def test_torch_forms_on_nccl(gpu_run: ScriptRun, family: str) -> None:
    gpu_run.assert_family(family)
