"""Run on every rank of an emulated cluster (``launch/emulate_cluster.py -- tests/emulated_check.py``).

Checks that discovery finds the nodes the emulator made, then every all-reduce, reduce-scatter,
all-gather and all-to-all algorithm (uneven all-to-all splits included) against float64 references
computed from every rank's seeded inputs, with poisoned outputs. Prints one ``CHECK`` line per
case on rank 0 and exits non-zero if anything is wrong.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import collectives as C  # noqa: E402
from bench.reference import count_wrong, expected, rank_data, split_matrix, tolerance  # noqa: E402
from collectives.algos import REGISTRY, for_op  # noqa: E402


def main() -> int:
    nodes_wanted = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    comm = C.init()
    rank, world = comm.rank, comm.size
    topo = comm.topology
    bad = []
    if len(topo.nodes()) != nodes_wanted:
        bad.append(f"discovery found nodes {topo.nodes()}, expected {nodes_wanted}")
    seed = 100
    for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
        for algo in for_op(op, torch.float32, "gloo"):
            for n in (1, 1001, 40_000):
                seed += 1
                if op == "all_reduce":
                    xs = [rank_data(q, n, torch.float32, seed) for q in range(world)]
                    out = xs[rank].clone()
                    C.all_reduce(out, algorithm=algo)
                    wrong = count_wrong(out, expected(op, xs, rank), tolerance(op, xs, rank, torch.float32))
                elif op == "reduce_scatter":
                    xs = [rank_data(q, n * world, torch.float32, seed) for q in range(world)]
                    out = torch.full((n,), float("nan"))
                    C.reduce_scatter_single(out, xs[rank].clone(), algorithm=algo)
                    wrong = count_wrong(out, expected(op, xs, rank), tolerance(op, xs, rank, torch.float32))
                elif op == "all_gather":
                    xs = [rank_data(q, n, torch.float32, seed) for q in range(world)]
                    out = torch.full((n * world,), float("nan"))
                    C.all_gather_single(out, xs[rank].clone(), algorithm=algo)
                    wrong = count_wrong(out, expected(op, xs, rank), 0.0)
                else:
                    pattern = "even" if REGISTRY[algo].equal_splits_only else "uneven"
                    m = split_matrix(world, seed, pattern, max(1, n // world))
                    xs = [rank_data(q, sum(m[q]), torch.float32, seed) for q in range(world)]
                    out_rows = [m[q][rank] for q in range(world)]
                    out = torch.full((sum(out_rows),), float("nan"))
                    C.all_to_all_single(out, xs[rank].clone(), out_rows, m[rank], algorithm=algo)
                    wrong = count_wrong(out, expected(op, xs, rank, splits=m), 0.0)
                if wrong:
                    bad.append(f"{op} {algo} n={n}: #wrong {wrong}")
                if rank == 0:
                    print(f"CHECK {op} {algo} n={n} wrong={wrong}", flush=True)
    flag = torch.tensor([len(bad)])
    dist.all_reduce(flag)
    for b in bad:
        print(f"rank {rank}: {b}", flush=True)
    if rank == 0:
        print(f"EMULATED nodes={topo.nodes()} failures={int(flag.item())}", flush=True)
    C.destroy()
    return 1 if int(flag.item()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
