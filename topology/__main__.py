"""Print the group's topology: ``torchrun --nproc-per-node N -m topology [--json PATH]``."""

from __future__ import annotations

import argparse

import torch.distributed as dist

import collectives as C

from . import discover


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m topology", description=__doc__)
    p.add_argument("--json", help="also write the topology to this JSON file")
    args = p.parse_args()
    C.init()
    topo = discover()
    if dist.get_rank() == 0:
        print(topo.describe(), flush=True)
        if args.json:
            topo.dump(args.json)
    C.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
