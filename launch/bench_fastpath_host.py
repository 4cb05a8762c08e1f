"""The compiled fast path's host cost per call, a base revision's build against the working tree's.

    python launch/bench_fastpath_host.py --base 24865b6 [--calls 200 --rounds 2001 --json out.json]

One process, one rank (a Gloo group of one, through a FileStore in a temporary directory), CPU
tensors and stand-ins for the GPU (``bench/fastpath_host.py`` says which and why): prints, for
``fast_verb`` and ``fast_dispatch``, the median per-call microseconds of each build and the
median of their per-round ratios, and the same for ``verb``, the base revision's
``collectives.all_reduce`` against the working tree's over the working tree's build.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import collectives as C  # noqa: E402
from bench.fastpath_host import fastpath_host_cost, format_host_cost  # noqa: E402


def _head() -> str:
    """The working tree's commit, with "+changes" where its fast-path sources differ from it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    git = ["git", "-C", root]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    changed = subprocess.run([*git, "status", "--porcelain", "collectives/_fastpath.c", "collectives/_native.py"],
                             capture_output=True, text=True).stdout.strip()
    return f"{commit}+changes" if changed else commit


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the git revision whose _fastpath.c and _native.py are the base")
    p.add_argument("--calls", type=int, default=200, help="calls per block (short: fewer of them hit a context switch)")
    p.add_argument("--rounds", type=int, default=2001, help="rounds (one block of each build per round)")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="commops-bench-store-") as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
        try:
            records = fastpath_host_cost(C.get_communicator(), args.base, calls=args.calls, rounds=args.rounds)
        finally:
            C.destroy()
    head, load = _head(), os.getloadavg()[0]
    print(f"# compiled fast path, host cost per call: {args.base} against the working tree ({head}) "
          f"({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"load average {load:.2f})")
    print(format_host_cost(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base": args.base, "head": head, "torch": torch.__version__,
                       "python": platform.python_version(), "cpus": os.cpu_count(), "load_average": load,
                       "command": " ".join(["python", *sys.argv]), "records": [asdict(r) for r in records]}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
