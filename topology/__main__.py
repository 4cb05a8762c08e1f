"""Print the group's topology: ``torchrun --nproc-per-node N -m topology [--json PATH]``.

A program, not part of the library: it starts torch.distributed through ``collectives`` and
discovers the world group's topology the way every communicator does (``COMMOPS_TOPOLOGY`` and
torchrun's node and local ranks included). Run without a launcher (``python -m topology``) it
shows this process alone: a one-rank group on this host, with what discovery finds here (its
GPUs, NVLink and NUMA facts), and says how to see a whole job.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

import collectives as C
from collectives.bootstrap import launcher_environment


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m topology", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the topology to this JSON file")
    args = p.parse_args()
    if launcher_environment() is None:
        # no launcher: a group of this process alone, over an in-memory store
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        print("# no launcher found: the topology of this process alone (one rank); for a job's, run "
              "torchrun --nproc-per-node N -m topology", flush=True)
        comm = C.get_communicator()
    else:
        comm = C.init()
    topo = comm.topology
    if comm.rank == 0:
        print(topo.describe(), flush=True)
        if args.json:
            topo.dump(args.json)
    C.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
