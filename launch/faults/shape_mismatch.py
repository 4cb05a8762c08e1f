"""A rank passes a different shape (debug check mode). ``torchrun --nproc-per-node 3 launch/faults/shape_mismatch.py``"""

import sys

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    C.all_reduce(torch.ones(8 if comm.rank != culprit else 12, device=dev))


if __name__ == "__main__":
    sys.exit(run("shape_mismatch", "the last rank all-reduces 12 elements, the others 8",
                 "every rank raises CollectiveMismatch on in_shape; diagnose: both sides", body, debug=True))
