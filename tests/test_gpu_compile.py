"""On CUDA GPUs (one or more; world 1 on one GPU): the commops ops under torch.compile,
``mode="reduce-overhead"`` and ``torch.cuda.graph``, and the native algorithm's fast path, checked
by ``tests/gpu_compile_check.py`` under torchrun, one case per family of its checks. Marker ``gpu``.
The compiled families run on CPU over Gloo in ``tests/test_compile_*.py`` (the default suite)."""

from __future__ import annotations

import pytest
import torch

from tests import gpu_compile_check
from tests._checks import NO_MULTICAST, ScriptRun, run_script

pytestmark = pytest.mark.gpu
TIMEOUT_S = 900


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    n = torch.cuda.device_count()
    return run_script("tests/gpu_compile_check.py", n, tmp_path_factory.mktemp("compile_gpu") / "checks.json",
                      env=NO_MULTICAST, timeout=TIMEOUT_S)


@pytest.mark.timeout(TIMEOUT_S + 60)  # the script's own limit reports first, with its output
@pytest.mark.parametrize("family", gpu_compile_check.families("cuda"))
def test_compiled_and_captured_on_gpus(gpu_run: ScriptRun, family: str) -> None:
    gpu_run.assert_family(family)
