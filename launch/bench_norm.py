"""Benchmark the fused all-reduce + residual + RMSNorm against the three separate steps:
``torchrun --nproc-per-node N launch/bench_norm.py``.

Decode sizes by default (1-256 rows x hidden 4096 and 8192, bf16 on GPUs), eagerly and under
CUDA graphs, every variant in the same rounds (``bench/norm_bench.py`` says what each is and how
the ratios pair). Prints a table; JSON and a plot on request. On CPUs (Gloo) it is a smoke run:
the kernel cannot run there, and each record says what ran in its place.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench.cli import DTYPES, where  # noqa: E402
from bench.norm_bench import format_norm_table, measure_norm, plot_norm  # noqa: E402
from bench.report import run_meta, write_json  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/bench_norm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=None, help="comma-separated (default on GPUs 1,2,4,...,256; on CPUs 1,5)")
    p.add_argument("--hidden", default=None, help="comma-separated (default on GPUs 4096,8192; on CPUs 64)")
    p.add_argument("--modes", default=None, help="eager,graph (default on GPUs both; on CPUs eager)")
    p.add_argument("-d", "--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on GPUs, float on CPUs")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-r", "--reps", type=int, default=15)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    comm = C.init()
    cuda, device, dtype = where(comm, args.dtype)
    rows = [int(v) for v in (args.rows or ("1,2,4,8,16,32,64,128,256" if cuda else "1,5")).split(",")]
    hidden = [int(v) for v in (args.hidden or ("4096,8192" if cuda else "64")).split(",")]
    modes = (args.modes or ("eager,graph" if cuda else "eager")).split(",")
    if "graph" in modes and not cuda:
        p.error("--modes graph needs CUDA")
    records = [measure_norm(comm, n, h, dtype, device, graph=m == "graph", iters=args.iters, reps=args.reps)
               for m in modes for h in hidden for n in rows]
    if comm.rank == 0:
        print(format_norm_table(records), flush=True)
        meta = run_meta("launch/bench_norm.py", comm, cuda)
        if args.json:
            write_json(records, args.json, meta)  # type: ignore[arg-type]
        if args.plot:
            plot_norm(records, args.plot, f"all-reduce + add + RMSNorm, {comm.size} ranks, {meta['device']}, {dtype}")
    C.destroy()
    return 1 if any(r.wrong for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
