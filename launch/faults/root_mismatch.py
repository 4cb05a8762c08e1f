"""A rank broadcasts from another root (debug check mode). ``torchrun --nproc-per-node 3 launch/faults/root_mismatch.py``"""

import sys

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    C.broadcast(torch.ones(8, device=dev), group_src=1 if comm.rank == culprit else 0)


if __name__ == "__main__":
    sys.exit(run("root_mismatch", "the last rank broadcasts from rank 1, the others from rank 0",
                 "every rank raises CollectiveMismatch on root; diagnose: both sides", body, debug=True))
