"""Per-call overhead of commops' dispatch point over calling torch.distributed directly.

    torchrun --nproc-per-node 2 launch/bench_dispatch.py [--calls 200 --rounds 41 --json out.json] [--ways]

Prints the median time per call of ``collectives.all_reduce(x, algorithm="native")`` and of
``torch.distributed.all_reduce(x)`` on a one-element tensor, and their paired difference. With
``--ways`` (an all-reduce), also other ways to issue it (``bench.overhead.issue_ways``): the
process group's and the backend's own methods, ``auto``, and both compiled.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import collectives as C  # noqa: E402
from bench.overhead import dispatch_overhead, issue_ways, recorder_and_debug_cost  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=41)
    p.add_argument("--op", default="all_reduce", choices=["all_reduce", "broadcast"])
    p.add_argument("--json")
    p.add_argument("--ways", action="store_true", help="also time other ways to issue the all-reduce")
    args = p.parse_args()
    comm = C.init()
    device = torch.device("cuda", torch.cuda.current_device()) if comm.backend_for("cuda") and torch.cuda.is_available() \
        else torch.device("cpu")
    res: dict[str, object] = dict(dispatch_overhead(comm, device, calls=args.calls, rounds=args.rounds, op=args.op))
    res.update(backend=comm.backend, op=args.op, torch=torch.__version__)
    res.update(recorder_and_debug_cost(comm, device))
    if args.ways and args.op == "all_reduce":
        res["ways"] = issue_ways(comm, device, calls=args.calls, rounds=args.rounds)
    if comm.rank == 0:
        print(f"# dispatch overhead, {args.op} of 1 element, {comm.size} ranks, {comm.backend}: "
              f"{args.rounds} rounds x {args.calls} calls, interleaved")
        print(f"torch.distributed: {res['torch_us']:8.2f} us/call")
        print(f"commops native:    {res['ours_us']:8.2f} us/call")
        print(f"overhead:          {res['overhead_us']:8.2f} us/call (median of paired differences)")
        print(f"flight recorder:   {res['recorder_us']:8.2f} us/call (one entry started and ended)")
        print(f"debug check mode:  {res['debug_check_us']:8.2f} us/call (fingerprints compared through the store)")
        ways = res.get("ways")
        if isinstance(ways, dict):
            for name, us in ways["us"].items():
                print(f"{name:22s} {us:8.2f} us/call ({ways['minus_torch_us'][name]:+.2f} paired against torch)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    del comm
    C.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
