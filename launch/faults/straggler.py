"""A rank is slow before every collective. ``torchrun --nproc-per-node 3 launch/faults/straggler.py``"""

import sys
import time

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    for _ in range(4):
        if comm.rank == culprit:
            time.sleep(0.5)
        C.all_reduce(torch.ones(8, device=dev))


if __name__ == "__main__":
    sys.exit(run("straggler", "the last rank sleeps 0.5 s before each of 4 all-reduces",
                 "no error; diagnose: it entered last every time, about 500 ms behind", body))
