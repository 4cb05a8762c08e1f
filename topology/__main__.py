"""Print the group's topology: ``torchrun --nproc-per-node N -m topology [--json PATH]``.

A program, not part of the library: it starts torch.distributed through ``collectives`` and
discovers the world group's topology the way every communicator does (``COMMOPS_TOPOLOGY`` and
torchrun's node and local ranks included).
"""

from __future__ import annotations

import argparse

import collectives as C


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m topology", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write the topology to this JSON file")
    args = p.parse_args()
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
