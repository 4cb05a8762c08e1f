"""On CUDA GPUs (one or more; world 1 on one GPU): the commops ops under torch.compile,
``mode="reduce-overhead"`` and ``torch.cuda.graph``, and the native algorithm's fast path, checked
by ``tests/gpu_compile_check.py`` under torchrun, one case per family of its checks; and the
operators over peer memory compiled and captured (``tests/gpu_compile_peer_check.py``), at 2 and 3
ranks sharing GPUs where there are fewer. Marker ``gpu``.
The compiled families run on CPU over Gloo in ``tests/test_compile_*.py`` (the default suite)."""

from __future__ import annotations

import pytest
import torch

from tests import gpu_compile_check, gpu_compile_peer_check
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


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def peer_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    """``tests/gpu_compile_peer_check.py`` at 2 and 3 ranks, sharing GPUs where the machine has fewer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    nproc = request.param
    return run_script("tests/gpu_compile_peer_check.py", nproc,
                      tmp_path_factory.mktemp(f"compile_peer_{nproc}") / "checks.json", env=NO_MULTICAST,
                      timeout=TIMEOUT_S)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("family", gpu_compile_peer_check.families())
def test_compiled_over_peer_memory(peer_run: ScriptRun, family: str) -> None:
    peer_run.assert_family(family)
