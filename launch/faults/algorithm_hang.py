"""A rank hangs inside an algorithm, after its first step. ``FAULT_ALGORITHM=ring torchrun --nproc-per-node 3 launch/faults/algorithm_hang.py``

``FAULT_ALGORITHM`` names the algorithm (default ``ring``). ``hierarchical`` runs on two
emulated nodes ([[0], [1, 2]] at 3 ranks: node leaders 0 and 1), ``grid2d`` on a 2 x 2 grid (4
ranks), so that their sub-group phases run. The op is the algorithm's first of all-reduce,
all-to-all, broadcast. The last rank enters the call and, the second time the algorithm hands work
to torch.distributed (its second step) blocks instead, for an hour; the first time where its later
steps feed no other rank (``FIRST_STEP``: ``native`` has one; at 3 ranks the last rank of
``recursive_doubling`` and ``binomial_tree`` sends once and then only receives; in
``hierarchical`` it shares its later phases with one other rank only). The
others must raise ``CollectiveTimeout`` within the timeout and a few seconds, from whichever wait
they are in.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from _scenario import run

ALGORITHM = os.environ.get("FAULT_ALGORITHM", "ring")
FIRST_STEP = ("native", "hierarchical", "recursive_doubling", "binomial_tree")
# what the algorithm hands its steps to: entering the second of them is where the culprit stops
_ENTRY_POINTS = ("batch_isend_irecv", "all_reduce", "broadcast", "reduce", "all_to_all_single",
                 "reduce_scatter_tensor", "all_gather_into_tensor", "reduce_scatter_single", "all_gather_single")


def _arm(stop_at: int) -> None:
    import collectives.algos.hierarchical as hierarchical
    import collectives.algos.grid2d as grid2d
    import collectives.algos.native as native

    count = [0]

    def hanging(fn):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            count[0] += 1
            if count[0] >= stop_at:
                time.sleep(3600)  # torchrun stops it once another rank fails
            return fn(*a, **k)
        return wrapper

    for name in _ENTRY_POINTS:
        if hasattr(dist, name):
            setattr(dist, name, hanging(getattr(dist, name)))
    for mod in (native, hierarchical, grid2d):
        for name in ("_reduce_scatter", "_all_gather"):
            if hasattr(mod, name):
                setattr(mod, name, hanging(getattr(mod, name)))


def body(comm, culprit, dev):  # noqa: ANN001, ANN201
    import collectives as C
    from topology import Topology

    if ALGORITHM == "hierarchical":
        comm.set_topology(Topology.from_nodes([[0], list(range(1, comm.size))]))
    elif ALGORITHM == "grid2d":
        half = comm.size // 2
        comm.set_topology(Topology.from_nodes([list(range(half)), list(range(half, comm.size))]))
    op = next(o for o in ("all_reduce", "all_to_all", "broadcast") if ALGORITHM in C.algorithms(o))

    def call():  # noqa: ANN202
        x = torch.ones(comm.size * 4096, device=dev)
        if op == "all_reduce":
            C.all_reduce(x, algorithm=ALGORITHM)
        elif op == "all_to_all":
            C.all_to_all_single(torch.empty_like(x), x, algorithm=ALGORITHM)
        else:
            C.broadcast(x, 0, algorithm=ALGORITHM)

    call()  # a good call first: sub-groups and the private point-to-point group exist from here on
    if comm.rank == culprit:
        _arm(1 if ALGORITHM in FIRST_STEP else 2)
    call()


if __name__ == "__main__":
    sys.exit(run(f"algorithm_hang[{ALGORITHM}]", f"the last rank hangs inside {ALGORITHM}, after its first step",
                 "the others raise CollectiveTimeout within the timeout + 5 s; no rank dies of a signal", body))
