"""One rank's call fails while the others wait in it, without debug mode and with the group's
timeout at 30 minutes: ``FAULT_CASE=bad_argument torchrun --nproc-per-node 3 launch/faults/one_rank_fails.py``.

Cases (``FAULT_CASE``): ``bad_argument`` (the last rank's all_gather output is one element short),
``refused_algorithm`` (it names an algorithm that does not exist), ``raises_in_algorithm`` (its
ring algorithm raises), ``different_op`` (it broadcasts while the others all-reduce),
``different_size`` (its all-reduce has 8 elements where the others' have 6; ``auto`` runs our
point-to-point schedule for that size, whose message tags carry the counts). The others must
raise RankFailed (or CollectiveMismatch, for the op or the size) naming it within seconds.
"""

import os
import sys

import torch
from _scenario import run

CASE = os.environ.get("FAULT_CASE", "bad_argument")


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C

    mine = comm.rank == culprit
    x = torch.randn(6, device=dev)
    if CASE == "bad_argument":
        C.all_gather_single(torch.empty(comm.size * 6 - (1 if mine else 0), device=dev), x)
    elif CASE == "refused_algorithm":
        C.all_reduce(x, algorithm="no_such_algorithm" if mine else "auto")
    elif CASE == "raises_in_algorithm":
        from collectives.algos import REGISTRY

        if mine:
            def boom(call):  # noqa: ANN001, ANN202
                raise RuntimeError("injected: the ring algorithm failed on this rank")
            REGISTRY["ring"].run = boom
        C.all_reduce(x, algorithm="ring")
    elif CASE == "different_size":
        C.all_reduce(torch.randn(8 if mine else 6, device=dev))
    elif CASE == "different_op":
        if mine:
            C.broadcast(x, 0)
        else:
            C.all_reduce(x)
    else:
        raise SystemExit(f"unknown FAULT_CASE {CASE!r}")


if __name__ == "__main__":
    sys.exit(run(f"one_rank_fails[{CASE}]", f"the last rank's call fails ({CASE}); group timeout 30 min",
                 "every other rank raises a named error within 5 s; the group is aborted", body, long_timeout=True))
