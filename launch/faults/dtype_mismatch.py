"""A rank passes a different dtype (debug check mode). ``torchrun --nproc-per-node 3 launch/faults/dtype_mismatch.py``"""

import sys

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    C.all_reduce(torch.ones(8, dtype=torch.float64 if comm.rank == culprit else torch.float32, device=dev))


if __name__ == "__main__":
    sys.exit(run("dtype_mismatch", "the last rank all-reduces float64, the others float32",
                 "every rank raises CollectiveMismatch on dtype; diagnose: both sides", body, debug=True))
