"""Benchmark MoE dispatch and combine: ``torchrun --nproc-per-node N launch/bench_moe.py``.

Configurations (tokens per rank, hidden, expert inner width, experts, top-k): on GPUs a
DeepSeek-V3-like prefill (hidden 7168, expert width 2048, 32 experts per rank, i.e. 256 on 8
GPUs, top-8, 4096 tokens), its decode step (128 tokens) and a Qwen3-235B-A22B-like prefill
(hidden 4096, expert width 1536, 16 experts per rank, i.e. 128 on 8 GPUs, top-8, 4096 tokens) and a
Qwen3-30B-A3B-like one (hidden 2048, expert width 768, 16 experts per rank, top-8, 8192 tokens),
where the exchange is closest to the experts' time;
on CPUs small ones. Prints
dispatch and combine time and GB/s beside the backend's ``all_to_all_single`` on the same rows,
the experts' time, sequential and pipelined totals and the share of communication hidden, the
ideal max(experts, exchange) and the share of the smaller of the two hidden, and the same for the
training step. Bandwidths: ``*_GBps`` on the rows a rank sends (its own included), ``*_link_GBps``
on the bytes that cross to other ranks.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench.cli import DTYPES, where  # noqa: E402
from bench.moe_bench import format_moe_table, measure_config, micro_batches_of, plot_moe, tuned_moe_table  # noqa: E402
from bench.report import run_meta, write_csv, write_json  # noqa: E402


def _configs(cuda: bool, world: int) -> list[tuple[str, int, int, int, int, int]]:
    if cuda:
        return [("dsv3-prefill", 4096, 7168, 2048, 32 * world, 8), ("dsv3-decode", 128, 7168, 2048, 32 * world, 8),
                ("qwen3-prefill", 4096, 4096, 1536, 16 * world, 8), ("qwen3-30b-prefill", 8192, 2048, 768, 16 * world, 8)]
    return [("small", 64, 32, 48, 4 * world, 2), ("small-decode", 8, 32, 48, 4 * world, 2)]


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/bench_moe.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", default=None, metavar="NAME:TOKENS:HIDDEN:FFN:EXPERTS:K",
                   help="a configuration (repeatable); default: the built-in ones")
    p.add_argument("-d", "--dtype", default=None, choices=sorted(DTYPES))
    p.add_argument("--chunks", default="2,4",
                   help="comma-separated token chunk counts of the pipelined forward, 'sources' for the "
                        "pipeline by source rank (transport peer, GPUs: forward_pipelined(chunks='sources')) and "
                        "'auto' (what a tuned table picks, COMMOPS_OVERLAP_TUNED) and 'micro<n>' (forward_micro_batches at n "
                        "micro-batches, any transport, with autograd)")
    p.add_argument("--pieces", default="1,4", help="exchange_pieces of the dispatcher, comma-separated (transport nccl)")
    p.add_argument("--transport", default=None,
                   help="comma-separated: nccl, peer (default: both on the GPUs of one node, else nccl)")
    p.add_argument("--routing", default="auto", choices=("auto", "host", "device"),
                   help="where transport nccl works out the routing (MoEDispatcher(routing=...))")
    p.add_argument("--pipeline-transfers", default="auto",
                   help="comma-separated settings of the peer transport's pipeline: auto, copy_engine, sm "
                        "(MoEDispatcher(pipeline_transfers=...))")
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-r", "--reps", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--csv")
    p.add_argument("--plot")
    p.add_argument("--tune", metavar="PATH",
                   help="write (or add to) the tuned table forward_pipelined(chunks='auto') follows: per configuration, "
                        "the pipeline measured faster than the sequential forward, else one chunk "
                        "(overlap.set_tuned(PATH) or COMMOPS_OVERLAP_TUNED=PATH)")
    args = p.parse_args()
    if args.routing == "device" and any(int(x) != 1 for x in args.pieces.split(",")):
        p.error(f"--routing device works out the routing of one piece only; pass --pieces 1 (got {args.pieces})")
    comm = C.init()
    cuda, device, dtype = where(comm, args.dtype)
    configs = _configs(cuda, comm.size)
    if args.config:
        configs = []
        for c in args.config:
            name, *nums = c.split(":")
            configs.append((name, *map(int, nums)))  # type: ignore[arg-type]
    chunks = tuple(x if x in ("sources", "auto") or micro_batches_of(x) else int(x) for x in args.chunks.split(","))
    records = []
    transports = args.transport.split(",") if args.transport else ["nccl"]
    if not args.transport and cuda:
        from overlap import _copy_engine

        if not _copy_engine.unavailable(comm, device, dtype):
            transports.append("peer")
    for name, tokens, hidden, ffn, experts, k in configs:
        for transport in transports:
            # the peer transport has no pieces (exchange_pieces does not apply to it): one run
            for pieces in ([1] if transport == "peer" else [int(x) for x in args.pieces.split(",")]):
                rs = measure_config(comm, name, tokens, hidden, ffn, experts, k, dtype, device, chunk_counts=chunks,
                                    iters=args.iters, reps=args.reps, pieces=pieces, transport=transport,
                                    routing=args.routing, transfers=tuple(args.pipeline_transfers.split(",")))
                records += rs
                if comm.rank == 0:
                    print(format_moe_table(rs), flush=True)
    if comm.rank == 0:
        meta = run_meta("launch/bench_moe.py", comm, cuda)
        if args.json:
            write_json(records, args.json, meta)  # type: ignore[arg-type]
        if args.csv:
            write_csv(records, args.csv)  # type: ignore[arg-type]
        if args.plot:
            plot_moe(records, args.plot, f"{comm.size} ranks, {meta['device']}, {dtype}")
        if args.tune:
            path = Path(args.tune)
            into = json.loads(path.read_text()) if path.exists() else None
            path.write_text(json.dumps(tuned_moe_table(records, meta, into), indent=1) + "\n")
    bad = sum(r.wrong for r in records)
    C.destroy()
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
