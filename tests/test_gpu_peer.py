"""On the GPUs of one node: the peer-memory collectives (``collectives/peer``), checked by
``tests/gpu_peer_check.py`` under torchrun, once for the module; one case per family of its
checks (``gpu_peer_check.families()``). Marker ``gpu``; needs two GPUs or more."""

from __future__ import annotations

import pytest
import torch

from tests import gpu_peer_check
from tests._checks import NO_MULTICAST, ScriptRun, run_script

TIMEOUT_S = 900
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(TIMEOUT_S + 60)]  # the script's own limit reports first


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory: pytest.TempPathFactory) -> ScriptRun:
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"peer memory needs 2 or more GPUs on one node; this machine has {n}")
    return run_script("tests/gpu_peer_check.py", n, tmp_path_factory.mktemp("peer") / "checks.json",
                      env=NO_MULTICAST, timeout=TIMEOUT_S)


@pytest.mark.parametrize("family", gpu_peer_check.families())
def test_peer_memory_collectives(peer_run: ScriptRun, family: str) -> None:
    peer_run.assert_family(family)
