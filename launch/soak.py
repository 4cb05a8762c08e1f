"""Soak: many randomised collectives against float64 references: ``torchrun --nproc-per-node 3 launch/soak.py -n 10000``.

Every rank draws the same sequence of calls from one seed: the op (all_reduce, reduce_scatter,
all_gather, all_to_all, broadcast, reduce), an algorithm (any registered one that runs it here, or
``auto``), the dtype (float32, float64, bfloat16, int32, int64), the size (0, 1, primes, random,
up to ``--max-elems``), the reduce op, the root, and for all-to-all an even, uneven (zero-length
parts included) or one-hot split matrix. Inputs are fresh random data per call
(``bench.reference.rank_data``); outputs are poisoned first and compared with the float64
reference within its rounding bound (``bench.reference``). Prints the mismatches (each call's
index and arguments) and a summary; exits 1 on any.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench import reference as R  # noqa: E402

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64)
PRIMES = (2, 3, 5, 7, 11, 13, 97, 101, 257, 1009, 4093)


def _size(rng: random.Random, max_elems: int) -> int:
    r = rng.random()
    if r < 0.08:
        return 0
    if r < 0.16:
        return 1
    if r < 0.5:
        return rng.choice([p for p in PRIMES if p <= max_elems])
    return rng.randint(2, max_elems)


def one_call(comm: C.Communicator, rng: random.Random, i: int, max_elems: int, corrupt: bool = False) -> tuple[int, str]:
    """Run call ``i`` (same arguments on every rank); (#wrong, description)."""
    w, r = comm.size, comm.rank
    op = rng.choice(OPS)
    dtype = rng.choice(DTYPES)
    reduce_ops = ["sum", "max", "min"] + (["avg", "prod"] if dtype.is_floating_point and dtype != torch.bfloat16 else [])
    reduce_op = rng.choice(reduce_ops) if op in ("all_reduce", "reduce_scatter", "reduce") else "sum"
    algos = comm.algorithms(op, dtype, "cpu") + ["auto"]
    algorithm = rng.choice(algos)
    root = rng.randrange(w)
    n = _size(rng, max_elems)
    pattern = rng.choice(["even", "uneven", "one_hot"]) if op == "all_to_all" else "even"
    if algorithm == "bruck" and pattern != "even":
        pattern = "even"
    seed = 1_000_003 * i + 17
    what = f"#{i} {op} {algorithm} {str(dtype).removeprefix('torch.')} n={n} op={reduce_op} root={root} {pattern}"
    if op in ("reduce_scatter", "all_gather"):
        m = n // w if n >= w else n  # per-rank elements (may be 0)
        total = m * w
        n_in = total if op == "reduce_scatter" else m
    else:
        total = n_in = n
    splits = None
    if op == "all_to_all":
        splits = R.split_matrix(w, seed, pattern, max(1, n // w) if n else 0)
        n_in = sum(splits[r])
    xs = [R.rank_data(q, n_in if op != "all_to_all" else sum(splits[q]), dtype, seed, "cpu", reduce_op)  # type: ignore[index]
          for q in range(w)]
    x = xs[r].clone()
    if op == "all_reduce":
        C.all_reduce(x, op=reduce_op, algorithm=algorithm)
        out = x
    elif op == "reduce":
        C.reduce(x, op=reduce_op, group_dst=root, algorithm=algorithm)
        out = x
    elif op == "broadcast":
        C.broadcast(x, group_src=root, algorithm=algorithm)
        out = x
    elif op == "reduce_scatter":
        out = torch.full((total // w,), -7, dtype=dtype) if not dtype.is_floating_point else \
            torch.full((total // w,), float("nan"), dtype=dtype)
        C.reduce_scatter_single(out, x, op=reduce_op, algorithm=algorithm)
    elif op == "all_gather":
        out = torch.full((total,), -7, dtype=dtype) if not dtype.is_floating_point else torch.full((total,), float("nan"), dtype=dtype)
        C.all_gather_single(out, x, algorithm=algorithm)
    else:
        assert splits is not None
        recv = [splits[q][r] for q in range(w)]
        out = torch.full((sum(recv),), -7, dtype=dtype) if not dtype.is_floating_point else \
            torch.full((sum(recv),), float("nan"), dtype=dtype)
        C.all_to_all_single(out, x, recv, splits[r], algorithm=algorithm)
    if op == "reduce" and r != root:
        return 0, what
    ref = R.expected(op, xs, r, reduce_op, root, splits)
    tol = R.tolerance(op, xs, r, dtype, reduce_op, root)
    if corrupt and out.numel():  # --self-check: the comparison must see this
        out.view(-1)[0] = out.view(-1)[0] + 64
    return R.count_wrong(out, ref, tol), what


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/soak.py", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--calls", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--max-elems", type=int, default=4096)
    p.add_argument("--self-check", type=int, default=0, metavar="K",
                   help="corrupt one output element of every K-th call on the last rank (the run must then fail)")
    args = p.parse_args()
    comm = C.init()
    rng = random.Random(args.seed)
    bad, t0 = [], time.perf_counter()
    for i in range(args.calls):
        corrupt = bool(args.self_check) and comm.rank == comm.size - 1 and i % args.self_check == 0
        wrong, what = one_call(comm, rng, i, args.max_elems, corrupt)
        if wrong:
            bad.append(f"{what}: {wrong} wrong on rank {comm.rank}")
            print(f"MISMATCH {bad[-1]}", flush=True)
        if comm.rank == 0 and (i + 1) % 1000 == 0:
            print(f"# {i + 1} calls, {time.perf_counter() - t0:.0f} s", flush=True)
    total = torch.tensor([len(bad)], dtype=torch.int64)
    C.all_reduce(total, algorithm="native")
    if comm.rank == 0:
        print(f"soak: {args.calls} collectives on {comm.size} ranks ({comm.backend}), seed {args.seed}: "
              f"{int(total)} mismatches, {time.perf_counter() - t0:.0f} s", flush=True)
    C.destroy()
    return 1 if int(total) else 0


if __name__ == "__main__":
    raise SystemExit(main())
