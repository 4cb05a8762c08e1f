"""On GPUs: the peer-memory collectives (``collectives/peer``), checked by
``tests/gpu_peer_check.py`` under torchrun, at 2 and 3 ranks (and at every GPU of a larger
node), sharing GPUs where the machine has fewer (one GPU is enough; the comparison with NCCL is
then one with Gloo). One
case per world size and family of its checks (``gpu_peer_check.families()``). Marker ``gpu``."""

from __future__ import annotations

import pytest
import torch

from tests import gpu_peer_check
from tests._checks import NO_MULTICAST, ScriptRun, run_script

TIMEOUT_S = 900
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(TIMEOUT_S + 60)]  # the script's own limit reports first


@pytest.fixture(scope="module", params=sorted({2, 3, torch.cuda.device_count()} - {0, 1}), ids=lambda n: f"{n}ranks")
def peer_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    nproc = request.param
    return run_script("tests/gpu_peer_check.py", nproc, tmp_path_factory.mktemp(f"peer_{nproc}") / "checks.json",
                      env=NO_MULTICAST, timeout=TIMEOUT_S)


@pytest.mark.parametrize("family", gpu_peer_check.families())
def test_peer_memory_collectives(peer_run: ScriptRun, family: str) -> None:
    peer_run.assert_family(family)
