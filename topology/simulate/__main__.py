"""The simulator's command line: ``python -m topology.simulate [--preset NAME | --machine FILE] ...``.

A program, not part of the library (nothing imports it): it hands the simulator
``collectives``' algorithm registry, which the ``topology`` layer itself never imports.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import topology.simulate as sim
from collectives.algos import REGISTRY
from topology.cost import Machine


def main(argv: list[str] | None = None) -> int:
    doc = sim.__doc__ or ""
    p = argparse.ArgumentParser(prog="python -m topology.simulate", description=doc.split("\n\n")[0])
    p.add_argument("--preset", default="hgx-h100-ndr400", help=f"one of {', '.join(sim.preset_names())}")
    p.add_argument("--machine", help="a machine or calibration JSON file (overrides --preset)")
    p.add_argument("--per-node", type=int, help="ranks per node (default: the preset's)")
    p.add_argument("--gpus", default="8,16,64,256,1024,4096")
    p.add_argument("--op", default=",".join(sim.OPS))
    p.add_argument("--sizes", default="64K,1M,16M,256M,1G")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH")
    args = p.parse_args(argv)
    if args.machine:
        machine, per_node = Machine.load(args.machine), 8
    else:
        machine, per_node = sim.machine_named(args.preset)
    per_node = args.per_node or per_node
    gpus = [int(x) for x in args.gpus.split(",")]
    bad = [g for g in gpus if g < 1]
    if bad:
        p.error(f"--gpus must be positive, got {bad}")
    ops = [o.strip() for o in args.op.split(",")]
    unknown = [o for o in ops if o not in sim.OPS]
    if unknown:
        p.error(f"--op {unknown} not simulated; use {', '.join(sim.OPS)}")
    sizes = [sim.parse_size(s) for s in args.sizes.split(",")]
    rows = sim.simulate(machine, per_node, gpus, ops, sizes, REGISTRY)
    print(f"# {machine.name}: {per_node} ranks per node; predicted time per algorithm, auto = least predicted")
    print(sim.format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine.to_dict(), "per_node": per_node, "rows": rows},
                                              indent=1) + "\n")
    if args.plot:
        sim.plot(rows, args.plot, f"{machine.name}, {per_node} per node (predicted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
