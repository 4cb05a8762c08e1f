"""A rank is killed (SIGKILL) before a collective. ``torchrun --nproc-per-node 3 launch/faults/rank_crash.py``"""

import os
import signal
import sys

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    if comm.rank == culprit:
        os.kill(os.getpid(), signal.SIGKILL)
    C.all_reduce(torch.ones(8, device=dev))


if __name__ == "__main__":
    sys.exit(run("rank_crash", "the last rank is SIGKILLed before an all-reduce",
                 "the others raise; diagnose: no dump from it, the others failed at that call", body))
