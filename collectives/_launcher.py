"""What the launcher told this process: torchrun's variables, or that an MPI launcher started it.

Read here, in one place, and passed on as arguments: ``init`` starts torch.distributed from it
(``collectives/bootstrap.py``) and ``Communicator.topology`` hands the node and local ranks to
``topology.discover``. It lives apart from ``bootstrap`` because the communicator needs it and
``bootstrap`` needs the communicator.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["LaunchInfo", "launcher_environment"]

# Variables by which MPI launchers announce the world size (MPICH/Hydra and Intel MPI, Open MPI,
# PMIx, MVAPICH2).
MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process."""

    launcher: str  # "torchrun" or "mpi"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    group_rank: int | None = None  # torchrun's node rank (GROUP_RANK)


def launcher_environment(environ: dict[str, str] | None = None) -> LaunchInfo | None:
    """Read torchrun's variables; the MPI case is only detected here (mpi4py gives the numbers)."""
    env = os.environ if environ is None else environ
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
        group = int(env["GROUP_RANK"]) if "GROUP_RANK" in env else None
        return LaunchInfo("torchrun", rank, world, local, int(env.get("LOCAL_WORLD_SIZE", world)), group)
    if any(k in env for k in MPI_SIZE_VARS):
        return LaunchInfo("mpi", -1, -1, -1, -1)
    return None
