"""Predicted vs measured: the cost model against a benchmark's records.

For every eager record of a benchmark JSON (``bench/cli.py --json``) the cost model predicts the
same (op, algorithm, size) on the topology the benchmark ran on (its ``meta.topology``) with a
calibration, and the table shows both and the error. ``auto`` rows are also checked against the
measured fastest algorithm at their size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from collectives.selection import predict
from topology.cost import Machine

__all__ = ["compare", "format_markdown"]

ONE_MB = 1 << 20


def compare(bench: str | Path, calibration: str | Path, nodes: list[list[int]] | None = None) -> dict[str, Any]:
    data = json.loads(Path(bench).read_text())
    meta = data["meta"]
    machine = Machine.load(calibration)
    layout = nodes or meta.get("topology") or [list(range(meta["world"]))]
    records = [r for r in data["records"] if not r.get("graph")]
    rows = []
    for r in records:
        if r["algorithm"] == "auto":
            continue
        try:
            pred = predict(r["algorithm"], r["op"], layout, machine, r["bytes"]) * 1e6
        except KeyError:
            continue
        rows.append({"op": r["op"], "algorithm": r["algorithm"], "bytes": r["bytes"], "measured_us": r["time_us"],
                     "predicted_us": pred, "error": pred / r["time_us"] - 1 if r["time_us"] else None})
    auto = []
    for r in records:
        if r["algorithm"] != "auto":
            continue
        same = [x for x in records if x["op"] == r["op"] and x["bytes"] == r["bytes"] and x["algorithm"] != "auto"]
        if not same:
            continue
        best = min(same, key=lambda x: x["time_us"])
        picked = next((x for x in same if x["algorithm"] == r.get("chosen")), None)
        auto.append({"op": r["op"], "bytes": r["bytes"], "chosen": r.get("chosen"), "auto_us": r["time_us"],
                     "fastest": best["algorithm"], "fastest_us": best["time_us"],
                     "auto_vs_fastest": r["time_us"] / best["time_us"],
                     "chosen_measured_us": picked["time_us"] if picked else None,
                     "chosen_vs_fastest": (picked["time_us"] / best["time_us"]) if picked else None})
    big = [abs(x["error"]) for x in rows if x["bytes"] >= ONE_MB and x["error"] is not None]
    return {"bench": str(bench), "calibration": str(calibration), "machine": machine.name, "topology": layout,
            "bench_command": meta.get("command"), "rows": rows, "auto": auto,
            "max_abs_error_at_1MB_and_up": max(big) if big else None,
            "worst_auto_vs_fastest": max((a["auto_vs_fastest"] for a in auto), default=None)}


def _size(n: int) -> str:
    for unit, k in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k}{unit}"
    return f"{n}B"


def format_markdown(result: dict[str, Any]) -> str:
    lines = [f"### {Path(result['bench']).name} vs {result['machine']}", "",
             f"Topology {result['topology']}; calibration `{result['calibration']}`.", "",
             "| op | algorithm | size | measured (us) | predicted (us) | error |", "|---|---|---:|---:|---:|---:|"]
    for r in result["rows"]:
        err = f"{r['error'] * 100:+.0f}%" if r["error"] is not None else "-"
        lines.append(f"| {r['op']} | {r['algorithm']} | {_size(r['bytes'])} | {r['measured_us']:.0f} | "
                     f"{r['predicted_us']:.0f} | {err} |")
    worst = result["max_abs_error_at_1MB_and_up"]
    lines += ["", f"Largest error at >= 1 MB: {worst * 100:.0f}%." if worst is not None else ""]
    if result["auto"]:
        lines += ["", "`auto`: its own measured time, and the time its choice took when run by name, over the "
                  "fastest algorithm's at that size.", "",
                  "| op | size | auto ran | auto / fastest | its choice by name / fastest | fastest |",
                  "|---|---:|---|---:|---:|---|"]
        for a in result["auto"]:
            ratio = f"{a['chosen_vs_fastest']:.2f}" if a["chosen_vs_fastest"] else "-"
            lines.append(f"| {a['op']} | {_size(a['bytes'])} | {a['chosen']} | {a['auto_vs_fastest']:.2f} | {ratio} | "
                         f"{a['fastest']} |")
    return "\n".join(lines) + "\n"
