"""A rank reduces with another op (debug check mode). ``torchrun --nproc-per-node 3 launch/faults/reduce_op_mismatch.py``"""

import sys

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    C.all_reduce(torch.ones(8, device=dev), op="max" if comm.rank == culprit else "sum")


if __name__ == "__main__":
    sys.exit(run("reduce_op_mismatch", "the last rank all-reduces with max, the others with sum",
                 "every rank raises CollectiveMismatch on reduce_op (without the check: a silently wrong sum)",
                 body, debug=True))
