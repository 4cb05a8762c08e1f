"""Should a GEMM write its result straight into a peer GPU's memory, or write locally and let a
copy engine move it? ``torchrun --nproc-per-node 2 launch/probe_peer_epilogue.py`` (GPUs of one
node, ``COMMOPS_PEER_BYTES`` at least the largest result).

Per GEMM shape: the GEMM, the copy alone, the GEMM with its output in the peer's buffer, and the
GEMM beside a copy engine moving as many bytes (``bench/peer_epilogue.py`` says what each is).
JSON and a plot on request.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench.report import run_meta, write_json  # noqa: E402

SHAPES = "512x2048x8192,1024x2048x8192,2048x2048x8192,1024x4096x8192,2048x4096x8192,4096x4096x8192,8192x4096x8192"


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/probe_peer_epilogue.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="MxKxN, comma-separated (bf16)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-r", "--reps", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    comm = C.init()
    if not (torch.cuda.is_available() and comm.backend_for("cuda")):
        raise C.UnsupportedError("device", "cpu", "this probe times GEMMs writing into a peer GPU's memory",
                                 "run it with torchrun on the GPUs of one node")
    from bench.peer_epilogue import format_epilogue, measure_epilogue, plot_epilogue
    from collectives.peer import peer_memory

    dev = torch.device("cuda", torch.cuda.current_device())
    pm = peer_memory(comm)
    records = []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        rec = measure_epilogue(comm, pm, m, k, n, dev, iters=args.iters, reps=args.reps)
        records.append(rec)
        if comm.rank == 0:
            print(format_epilogue(rec), flush=True)
    if comm.rank == 0:
        meta = run_meta("launch/probe_peer_epilogue.py", comm, True)
        if args.json:
            write_json(records, args.json, meta)  # type: ignore[arg-type]
        if args.plot:
            plot_epilogue(records, args.plot,
                          f"GEMM into a peer's memory vs. beside a copy engine, {comm.size} ranks, {meta['device']}")
    C.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
