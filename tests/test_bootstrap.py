"""init(): launcher detection and backend selection (including the HCCL rule, untestable on hardware here)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import collectives as C
from collectives.bootstrap import launcher_environment, select_backend


@pytest.mark.parametrize("cuda,npu,expected", [(True, False, "nccl"), (True, True, "nccl"), (False, True, "hccl"),
                                               (False, False, "gloo")])
def test_backend_follows_the_device(cuda: bool, npu: bool, expected: str) -> None:
    assert select_backend(None, cuda=cuda, npu=npu) == expected


def test_explicit_backend_wins() -> None:
    assert select_backend("gloo", cuda=True, npu=False) == "gloo"
    assert select_backend("NCCL", cuda=False, npu=False) == "nccl"
    assert select_backend("mpi", cuda=False, npu=False, mpi_available=True) == "mpi"
    with pytest.raises(C.InvalidArgumentError, match="backend='gloo' under mpiexec"):
        select_backend("mpi", cuda=False, npu=False, mpi_available=False)


def test_launcher_detection() -> None:
    tr = launcher_environment({"RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "h", "MASTER_PORT": "1", "LOCAL_RANK": "1",
                               "LOCAL_WORLD_SIZE": "4"})
    assert tr == C.LaunchInfo("torchrun", 3, 8, 1, 4)
    assert launcher_environment({"PMI_SIZE": "2", "PMI_RANK": "0"}).launcher == "mpi"
    assert launcher_environment({"OMPI_COMM_WORLD_SIZE": "2"}).launcher == "mpi"
    assert launcher_environment({"HOME": "/root"}) is None


def test_init_outside_a_launcher_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE",
                "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(C.LaunchError, match="torchrun --nproc-per-node"):
        C.init()
    assert not dist.is_initialized()
