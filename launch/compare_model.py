"""Predicted vs measured: ``python launch/compare_model.py BENCH.json CALIBRATION.json [--md OUT] [--json OUT]``."""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.model_check import compare, format_markdown  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/compare_model.py", description=__doc__)
    p.add_argument("bench")
    p.add_argument("calibration")
    p.add_argument("--nodes", help="topology as JSON (e.g. '[[0,1],[2,3]]') when the benchmark did not record one")
    p.add_argument("--md", help="append the markdown table to this file")
    p.add_argument("--json", help="write the comparison as JSON")
    args = p.parse_args()
    result = compare(args.bench, args.calibration, json.loads(args.nodes) if args.nodes else None)
    text = format_markdown(result)
    print(text)
    if args.md:
        with open(args.md, "a") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
