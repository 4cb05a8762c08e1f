"""Calibrate the cost model on this cluster: ``torchrun --nproc-per-node N launch/calibrate.py --name NAME --out FILE``.

Measures each tier's latency and bandwidth (``bench/calibrate.py``), fits them
(``topology/calibrate.py``), prints the fit and writes a calibration file (the fitted machine plus
the measured points) that ``COMMOPS_CALIBRATION`` points ``algorithm="auto"`` at.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench.cli import parse_size, sizes  # noqa: E402
from bench.calibrate import calibrate  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/calibrate.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="label of the machine (e.g. emu-2x2-400mbit)")
    p.add_argument("--out", required=True, help="calibration file to write (JSON)")
    p.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("64K"))
    p.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--step-factor", type=int, default=4)
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-r", "--reps", type=int, default=3)
    p.add_argument("--native", action="store_true", help="also fit the backend's own all-reduce (NCCL)")
    p.add_argument("--native-a2a", action="store_true", help="also fit the backend's own all-to-all (Gloo)")
    p.add_argument("--anchor-bytes", type=parse_size, default=0,
                   help="also time every algorithm of every op at this size (e.g. 16K): its fixed cost here")
    p.add_argument("--anchor-loop-ms", type=float, default=2000.0, help="timed loops of at least this long for the anchors")
    p.add_argument("--no-match", action="store_true",
                   help="never pick this file automatically (emulated clusters): only through COMMOPS_CALIBRATION")
    p.add_argument("--note", default="", help="a sentence kept in the file's metadata")
    args = p.parse_args()
    comm = C.init()
    device = torch.device("cuda", torch.cuda.current_device()) if comm.backend_for("cuda") else torch.device("cpu")
    topo = comm.topology
    say = (lambda msg: print(msg, flush=True)) if comm.rank == 0 else (lambda msg: None)
    say(topo.describe())
    machine, raw = calibrate(args.name, topo, sizes(args.min_bytes, args.max_bytes, args.step_factor), device,
                             iters=args.iters, reps=args.reps, backend=comm.backend_for(device.type) or "gloo",
                             native=args.native, native_a2a=args.native_a2a, anchor_bytes=args.anchor_bytes,
                             anchor_loop_s=args.anchor_loop_ms / 1e3, log=say)
    machine.meta["command"] = " ".join(["launch/calibrate.py", *sys.argv[1:]])
    if args.no_match:
        machine.meta["match"] = False
    if args.note:
        machine.meta["note"] = args.note
    if comm.rank == 0:
        Path(args.out).write_text(json.dumps({"machine": machine.to_dict(), "points": raw}, indent=1) + "\n")
        say(f"wrote {args.out}")
    dist.barrier()
    C.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
