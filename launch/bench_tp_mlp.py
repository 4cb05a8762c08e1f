"""Benchmark a tensor-parallel MLP forward + backward per overlap strategy:
``torchrun --nproc-per-node N launch/bench_tp_mlp.py``.

Llama's gated MLP, ``RowParallelLinear(silu(gate) * up)`` with gate and up from one
``ColumnParallelLinear`` (``overlap.layers``; ``--ungated``: ``silu`` of one projection),
Llama-3-8B sizes by default, at several token counts, with sequence parallelism unless
``--no-sp``. Prints each strategy's time, its speed-up over ``strategy="sequential"`` (also paired
by round) and the largest relative difference
of its output and gradients from the sequential ones. JSON and a plot on request.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench.cli import DTYPES, where  # noqa: E402
from bench.report import run_meta, write_json  # noqa: E402
from bench.tp_mlp import format_mlp_table, measure_mlp, plot_mlp  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/bench_tp_mlp.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default=None, help="comma-separated (default on GPUs 2048,4096,8192,16384)")
    p.add_argument("--hidden", type=int, default=None, help="default 4096 on GPUs, 64 on CPUs")
    p.add_argument("--ffn", type=int, default=None, help="default 14336 on GPUs, 128 on CPUs")
    p.add_argument("--variants", default="sequential,chunked/2,chunked/4,auto",
                   help="strategy or strategy/chunks, comma-separated (copy_engine/4 on the GPUs of one node)")
    p.add_argument("--no-sp", action="store_true", help="without sequence parallelism")
    p.add_argument("--ungated", action="store_true", help="silu(fc1(x)) instead of Llama's silu(gate) * up")
    p.add_argument("-d", "--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on GPUs, float on CPUs")
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-r", "--reps", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    comm = C.init()
    cuda, device, dtype = where(comm, args.dtype)
    tokens = [int(t) for t in (args.tokens or ("2048,4096,8192,16384" if cuda else "64,128")).split(",")]
    hidden = args.hidden or (4096 if cuda else 64)
    ffn = args.ffn or (14336 if cuda else 128)
    variants = tuple(v.strip() for v in args.variants.split(","))
    records = []
    for t in tokens:
        rs = measure_mlp(comm, t, hidden, ffn, dtype, device, sequence_parallel=not args.no_sp, variants=variants,
                         gated=not args.ungated,
                         iters=args.iters, reps=args.reps)
        records += rs
        if comm.rank == 0:
            print(format_mlp_table(rs), flush=True)
    if comm.rank == 0:
        meta = run_meta("launch/bench_tp_mlp.py", comm, cuda)
        if args.json:
            write_json(records, args.json, meta)  # type: ignore[arg-type]
        if args.plot:
            plot_mlp(records, args.plot, f"TP MLP fwd+bwd, {comm.size} ranks, {meta['device']}, {dtype}")
    C.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
