"""A rank skips a collective: the others time out, naming it. ``torchrun --nproc-per-node 3 launch/faults/skipped_collective.py``"""

import sys
import time

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    if comm.rank == culprit:
        time.sleep(3600)  # never calls; torchrun stops it once another rank fails
    C.all_reduce(torch.ones(8, device=dev))


if __name__ == "__main__":
    sys.exit(run("skipped_collective", "the last rank skips an all-reduce",
                 "the others raise CollectiveTimeout naming it; diagnose: it never entered that call", body))
