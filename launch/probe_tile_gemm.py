"""The tile-signalled GEMM against cuBLAS on one GPU, alone and with its result moved by copy
engines while it runs: ``torchrun --nproc-per-node 1 launch/probe_tile_gemm.py`` (a CUDA GPU).

Per shape (MxKxN, bf16), eagerly and replayed from CUDA graphs, every variant of
``bench/tile_gemm.py`` (which says what each is) in the same rounds. JSON and a plot on request.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench.report import run_meta, write_json  # noqa: E402

# the GEMM + all-reduce shapes of launch/bench_overlap.py, then the Llama-3-8B-like TP MLP's down product
SHAPES = "2048x2048x8192,4096x4096x8192,16384x4096x8192,8192x14336x8192,16384x7168x4096"


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/probe_tile_gemm.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="MxKxN, comma-separated (bf16)")
    p.add_argument("--groups", type=int, default=8, help="row groups a GEMM signals (default 8: four per rank of two)")
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("-r", "--reps", type=int, default=5)
    p.add_argument("--modes", default="eager,graph")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    comm = C.init()
    if not (torch.cuda.is_available() and comm.backend_for("cuda")):
        raise C.UnsupportedError("device", "cpu", "this probe times a Triton GEMM on a GPU",
                                 "run it with torchrun on a CUDA GPU")
    from bench.tile_gemm import format_tile_gemm, measure_tile_gemm, plot_tile_gemm
    from overlap._tile_gemm import TILE_ROWS

    dev = torch.device("cuda", torch.cuda.current_device())
    records = []
    for mode in args.modes.split(","):
        for shape in args.shapes.split(","):
            m, k, n = (int(v) for v in shape.split("x"))
            group_rows = max(TILE_ROWS, m // args.groups // TILE_ROWS * TILE_ROWS)
            records.append(measure_tile_gemm(comm, m, k, n, dev, group_rows=group_rows, iters=args.iters,
                                             reps=args.reps, graph=mode == "graph"))
            if comm.rank == 0:
                print(format_tile_gemm(records[-1:]), flush=True)
    if comm.rank == 0:
        print(format_tile_gemm(records))
        meta = run_meta("launch/probe_tile_gemm.py", comm, True)
        if args.json:
            write_json(records, args.json, meta)  # type: ignore[arg-type]
        if args.plot:
            plot_tile_gemm(records, args.plot, f"tile-signalled GEMM vs cuBLAS, bf16, {meta['device']}")
    C.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
