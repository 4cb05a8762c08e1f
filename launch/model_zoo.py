"""Every transformers causal-LM family with a parallel plan, sharded by ours and by transformers (``bench/model_zoo.py``).

    torchrun --nproc-per-node 2 launch/model_zoo.py --layouts tp,ep --json zoo.json --table zoo.md
    torchrun --nproc-per-node 4 launch/model_zoo.py --layouts tpxep --families deepseek_v3,qwen3_moe,gpt_oss

Prints each family as it finishes; rank 0 writes the records (JSON) and the README's table
(Markdown). Exit 0 when every family that transformers' own parallelism passes also passes ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch.distributed as dist


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="", help="comma-separated model types (default: every one with a plan)")
    ap.add_argument("--layouts", default="tp,ep", help="tp, ep and/or tpxep (4 ranks)")
    ap.add_argument("--impls", default="ours,transformers")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (ours only; ranks may share one GPU over Gloo)")
    ap.add_argument("--json", default="")
    ap.add_argument("--table", default="")
    ap.add_argument("--from", dest="sources", nargs="+", default=[], metavar="JSON",
                    help="write the table of these runs' records (no run; no launcher needed)")
    args = ap.parse_args(argv)
    import transformers

    if args.sources:
        return _table_only(args.sources, args.table)

    import collectives as C
    from bench.model_zoo import check_family, env_threads, families, format_table

    env_threads()
    C.init(backend="gloo") if args.device == "cuda" else C.init()
    plans = families()
    kinds = [k for k in (args.families.split(",") if args.families else sorted(plans)) if k]
    unknown = [k for k in kinds if k not in plans]
    if unknown:
        print(f"--families: {unknown} have no parallel plan in transformers {transformers.__version__}; "
              f"pick from {sorted(plans)}", file=sys.stderr)
        return 2
    layouts = [x for x in args.layouts.split(",") if x]
    records = []
    start = time.perf_counter()
    rank0 = dist.get_rank() == 0
    jobs = [(k, lay) for k in kinds for lay in layouts if plans[k]["tp" if lay == "tp" else "ep"]]
    for n, (kind, lay) in enumerate(jobs, 1):
        for impl in args.impls.split(","):
            rec = check_family(kind, lay, impl, device=args.device)
            records.append(rec)
            if rank0:
                print(f"[{n}/{len(jobs)} {time.perf_counter() - start:6.0f}s] {kind:28s} {lay:5s} {impl:12s} "
                      f"{rec.status:7s} {rec.seconds:5.1f}s {rec.reason[:150]}", flush=True)
    if rank0:
        import torch

        meta = {"transformers": transformers.__version__, "torch": torch.__version__, "device": args.device,
                "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "world": dist.get_world_size(),
                "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"), "seconds": time.perf_counter() - start}
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "records": [dataclasses.asdict(r) for r in records]}, f, indent=1)
        table = format_table(records, transformers.__version__)
        if args.table:
            with open(args.table, "w") as f:
                f.write(table + "\n")
        print(table)
    missed = [(r.family, r.layout) for r in records if r.impl == "transformers" and r.status == "pass"
              and not any(o.family == r.family and o.layout == r.layout and o.impl == "ours" and o.status == "pass"
                          for o in records)]
    if rank0 and missed:
        print(f"transformers passes and ours does not: {missed}", file=sys.stderr)
    C.destroy()
    return 1 if missed else 0


def _table_only(sources: list[str], out: str) -> int:
    from bench.model_zoo import ZooRecord, format_table

    records, versions = [], set()
    for path in sources:
        with open(path) as f:
            data = json.load(f)
        versions.add(data["meta"]["transformers"])
        records += [ZooRecord(**r) for r in data["records"]]
    table = format_table(records, ", ".join(sorted(versions)))
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
