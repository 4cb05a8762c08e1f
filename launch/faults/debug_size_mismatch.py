"""A rank all-to-alls a tensor of another size, without split sizes (debug check mode): every rank
raises at once instead of Gloo aborting two of them. ``torchrun --nproc-per-node 3 launch/faults/debug_size_mismatch.py``"""

import sys

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    rows = (2 if comm.rank == culprit else 1) * comm.size  # dim 0 / world: 2 rows per peer, the others' 1
    C.all_to_all_single(torch.empty(rows, 4, device=dev), torch.ones(rows, 4, device=dev))


if __name__ == "__main__":
    sys.exit(run("debug_size_mismatch", "the last rank all-to-alls 2 rows per peer, the others 1 (no split sizes)",
                 "every rank raises CollectiveMismatch on splits, naming the pairs with the last rank", body,
                 debug=True))
