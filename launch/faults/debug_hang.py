"""A rank hangs before a collective in debug check mode: the others' fingerprint wait is bounded by
the call's timeout and names it. ``torchrun --nproc-per-node 3 launch/faults/debug_hang.py``"""

import sys
import time

import torch
from _scenario import run


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    if comm.rank == culprit:
        time.sleep(3600)  # hangs before the call; torchrun stops it once another rank fails
    C.all_reduce(torch.ones(8, device=dev))


if __name__ == "__main__":
    sys.exit(run("debug_hang", "the last rank hangs before an all-reduce, debug check mode on",
                 "the others raise CollectiveTimeout naming it within the timeout (the debug check's wait); "
                 "diagnose: it never entered that call", body, debug=True))
