"""Benchmark the overlap operators: ``torchrun --nproc-per-node N launch/bench_overlap.py``.

For each op and shape ``MxKxN`` (a row-parallel linear: ``[M, K] @ [K, N]``, then the collective
on ``[M, N]``; the all-gather op gathers ``[M/p, K]`` shards first), prints the GEMM alone, the
collective alone, the plain sequence, each strategy, ``auto`` and torch's AsyncTP fused op where
present, with the share of the collective hidden. Writes JSON, CSV and a plot on request.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench.cli import DTYPES, where  # noqa: E402
from bench.gemm_collective import OPS, format_overlap_table, measure_shape, plot_overlap, tuned_overlap_table  # noqa: E402
from bench.report import run_meta, write_csv, write_json  # noqa: E402

# Decode-like (small M) and Llama-like prefill shapes of a TP=2 row-parallel linear; the four
# largest are the ones our anchors were measured on.
GPU_SHAPES = "8x8192x8192,128x8192x8192,2048x2048x8192,4096x4096x8192,16384x4096x8192,8192x14336x8192"
CPU_SHAPES = "8x64x64,96x128x96,256x256x128"


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/bench_overlap.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="all", help=f"comma-separated, or 'all' ({', '.join(OPS)})")
    p.add_argument("--shapes", default=None, help=f"comma-separated MxKxN (default on GPUs: {GPU_SHAPES})")
    p.add_argument("-d", "--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on GPUs, float on CPUs")
    p.add_argument("--chunks", default="2,4,8", help="chunk counts of the chunked and copy_engine strategies")
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("-r", "--reps", type=int, default=5)
    p.add_argument("--min-loop-ms", type=float, default=5.0,
                   help="eager: more than --iters calls per timed loop where a loop would be shorter than this")
    p.add_argument("--graph", action="store_true",
                   help="time every variant replayed from a CUDA graph (no host cost; AsyncTP's ops left out)")
    p.add_argument("--json")
    p.add_argument("--csv")
    p.add_argument("--plot")
    p.add_argument("--tune", metavar="PATH", help="write the measured-best strategy per shape (for COMMOPS_OVERLAP_TUNED); "
                   "an existing table for the same world size keeps its other entries")
    args = p.parse_args()
    comm = C.init()
    cuda, device, dtype = where(comm, args.dtype)
    ops = list(OPS) if args.ops == "all" else [o.strip() for o in args.ops.split(",")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shapes or (GPU_SHAPES if cuda else CPU_SHAPES)).split(",")]
    chunks = tuple(int(x) for x in args.chunks.split(","))
    lead = comm.rank == 0
    records = []
    for op in ops:
        for M, K, N in shapes:
            if M % comm.size:
                raise C.InvalidArgumentError("--shapes", f"{M}x{K}x{N}", f"M={M} is not divisible by {comm.size} ranks",
                                             f"use an M that is a multiple of {comm.size}")
            rs = measure_shape(comm, op, M, K, N, dtype, device, chunk_counts=chunks, iters=args.iters, reps=args.reps,
                               graph=args.graph and cuda, min_loop_s=args.min_loop_ms / 1e3)
            records += rs
            if lead:
                print(format_overlap_table(rs), flush=True)
    if lead:
        meta = run_meta("launch/bench_overlap.py", comm, cuda)
        if cuda:
            meta["mode"] = "graph (AsyncTP left out)" if args.graph else "eager"
        if args.json:
            write_json(records, args.json, meta)  # type: ignore[arg-type]
        if args.csv:
            write_csv(records, args.csv)  # type: ignore[arg-type]
        if args.plot:
            plot_overlap(records, args.plot, f"{comm.size} ranks, {meta['device']}, {dtype}")
        if args.tune:
            table = tuned_overlap_table(records, meta, graph=bool(args.graph and cuda))
            path = Path(args.tune)
            if path.exists():  # add to a table from earlier runs (another op or shape list)
                old = json.loads(path.read_text())
                if old.get("meta", {}).get("world") == comm.size:
                    def key(e: dict[str, object]) -> tuple[object, ...]:
                        return (e["op"], e["dtype"], e["M"], e["K"], e["N"], bool(e.get("graph", False)))

                    mine = {key(e) for e in table["entries"]}  # type: ignore[attr-defined]
                    table["entries"] = [e for e in old.get("entries", []) if key(e) not in mine] \
                        + table["entries"]  # type: ignore[operator]
            path.write_text(json.dumps(table, indent=1) + "\n")
    bad = sum(r.wrong or 0 for r in records)
    C.destroy()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
