"""Merge the ranks' flight-recorder dumps and say what went wrong: ``python -m collectives.diagnose DIR``.

Reads every ``commops_trace_rank*.json`` in DIR (``collectives/recorder.py``), lines the ranks'
calls up by group and sequence number, and reports, per group:

* the first sequence number where the ranks disagree: ranks that never entered it (and the last
  call they did enter), and ranks that entered a different op, shape, dtype, reduce op, root or
  algorithm there (both sides' values);
* the first call that failed (raised) on some rank, and the calls ranks were still inside when
  they dumped (state ``started``: a synchronous call that never returned, because the rank was
  stopped there, by its launcher's SIGTERM for instance, or was still waiting);
* the straggler: over the last calls every rank completed, the rank that entered last most
  often, and by how much on average.

Prints one paragraph and a table; ``--json`` prints the same findings as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["load", "diagnose", "main"]

_COMPARED = ("op", "in_shape", "out_shape", "dtype", "reduce_op", "root")
# A rank that enters last by less than this is scheduling jitter, not a straggler worth naming.
STRAGGLER_MS = 20.0


def load(directory: str | Path) -> dict[int, dict[str, Any]]:
    """rank -> that rank's dump."""
    out = {}
    for path in sorted(Path(directory).glob("commops_trace_rank*.json")):
        data = json.loads(path.read_text())
        out[int(data["rank"])] = data
    return out


def diagnose(dumps: dict[int, dict[str, Any]], straggler_window: int = 20) -> dict[str, Any]:
    """The findings for every group seen in ``dumps`` (see the module docstring)."""
    groups: dict[str, dict[str, Any]] = {}
    for rank, data in dumps.items():
        for e in data["entries"]:
            g = groups.setdefault(e["group"], {"ranks": e["group_ranks"], "calls": {}})
            g["calls"].setdefault(rank, {})[e["seq"]] = e
    findings = []
    for name, g in groups.items():
        members = [r for r in g["ranks"] if r in dumps]
        absent = [r for r in g["ranks"] if r not in dumps]
        calls = g["calls"]
        # Each rank's ring holds its last calls only: compare from the first call every rank still has.
        floor = max((min(calls[r]) for r in members if calls.get(r)), default=0)
        seqs = sorted({s for r in members for s in calls.get(r, {}) if s >= floor})
        first = None
        for s in seqs:
            here = {r: calls.get(r, {}).get(s) for r in members}
            missing = [r for r, e in here.items() if e is None]
            entered = {r: e for r, e in here.items() if e is not None}
            ref_rank = min(entered)
            ref = entered[ref_rank]
            differ = {}
            for field in _COMPARED:
                values = {r: e[field] for r, e in entered.items()}
                if field.endswith("shape") and ref["op"] == "all_to_all":  # uneven splits: rows may differ
                    values = {r: None if v is None else v[1:] for r, v in values.items()}
                if len({json.dumps(v) for v in values.values()}) > 1:
                    differ[field] = values
            if missing or differ:
                last = {r: max(calls.get(r, {}), default=None) for r in missing}
                first = {"seq": s, "op": ref["op"], "callsite": ref["callsite"], "missing": missing,
                         "missing_last_seq": last, "differ": differ,
                         "states": {r: e["state"] for r, e in entered.items()}}
                break
        failures = [(s, r) for s in seqs for r in members if calls.get(r, {}).get(s, {}).get("state") == "failed"]
        first_failure = None
        if failures:
            s0 = failures[0][0]
            first_failure = {"seq": s0, "op": next(calls[r][s0]["op"] for ss, r in failures if ss == s0),
                             "ranks": sorted(r for ss, r in failures if ss == s0)}
        # A synchronous call still "started" in a dump never returned: the rank dumped from inside it
        # (stopped by a signal, or waiting). Only a rank's latest call of the group can be one.
        inside = {r: max(calls[r]) for r in members if calls.get(r)
                  and calls[r][max(calls[r])]["state"] == "started"}
        in_flight = None
        if inside:
            s1 = min(inside.values())
            in_flight = {"seq": s1, "op": next(calls[r][s1]["op"] for r in inside if inside[r] == s1),
                         "ranks": sorted(r for r in inside if inside[r] == s1)}
        done = [s for s in seqs if all(calls.get(r, {}).get(s, {}).get("state") == "completed" for r in members)]
        straggler = None
        if len(members) > 1 and done:
            window = done[-straggler_window:]
            late: Counter[int] = Counter()
            lag: dict[int, list[float]] = {r: [] for r in members}
            for s in window:
                t = {r: calls[r][s]["t_enqueue"] for r in members}
                latest = max(t, key=t.__getitem__)
                late[latest] += 1
                for r in members:
                    lag[r].append(t[r] - min(t.values()))
            rank, times = late.most_common(1)[0]
            straggler = {"rank": rank, "last_in": times, "of": len(window),
                         "mean_lag_ms": 1e3 * statistics.mean(lag[rank]),
                         "others_mean_lag_ms": 1e3 * statistics.mean(x for r in members if r != rank for x in lag[r])}
        findings.append({"group": name, "ranks": g["ranks"], "no_dump": absent, "first_disagreement": first,
                         "first_failure": first_failure, "in_flight": in_flight, "straggler": straggler,
                         "last_seq": {r: max(calls.get(r, {}), default=None) for r in members}})
    return {"ranks_dumped": sorted(dumps), "reasons": {r: d.get("reason") for r, d in dumps.items()},
            "groups": findings}


def _sentence(f: dict[str, Any]) -> str:
    d = f["first_disagreement"]
    parts = []
    if d is None:
        parts.append(f"group {f['group']} (ranks {f['ranks']}): every rank entered the same calls")
    else:
        parts.append(f"group {f['group']} (ranks {f['ranks']}): the ranks first disagree at call #{d['seq']} "
                     f"({d['op']} at {d['callsite']})")
        if d["missing"]:
            parts.append(f"rank(s) {d['missing']} never entered it (their last call: "
                         + ", ".join(f"rank {r} #{s}" for r, s in d["missing_last_seq"].items()) + ")")
        for field, values in d["differ"].items():
            groups: dict[str, list[int]] = {}
            for r, v in values.items():
                groups.setdefault(json.dumps(v), []).append(r)
            parts.append(f"{field} differs: " + "; ".join(f"rank(s) {rs} passed {v}" for v, rs in groups.items()))
    if f["no_dump"]:
        parts.append(f"no dump from rank(s) {f['no_dump']} (crashed, or killed before it could write)")
    ff = f.get("first_failure")
    if ff is not None and (d is None or ff["seq"] != d["seq"]):
        parts.append(f"call #{ff['seq']} ({ff['op']}) failed on rank(s) {ff['ranks']}")
    fl = f.get("in_flight")
    if fl is not None:
        parts.append(f"rank(s) {fl['ranks']} were still inside call #{fl['seq']} ({fl['op']}) when they dumped "
                     "(stopped there, or still waiting)")
    s = f["straggler"]
    if s is not None and s["mean_lag_ms"] >= STRAGGLER_MS and s["mean_lag_ms"] > 2 * s["others_mean_lag_ms"]:
        parts.append(f"straggler: rank {s['rank']} entered last in {s['last_in']} of the last {s['of']} completed "
                     f"calls, {s['mean_lag_ms']:.1f} ms behind on average")
    return "; ".join(parts) + "."


def _table(f: dict[str, Any]) -> str:
    d = f["first_disagreement"]
    rows = [f"{'rank':>6} {'last call':>10} {'at the first disagreement':<60}"]
    for r, last in f["last_seq"].items():
        if d is None:
            what = "-"
        elif r in d["missing"]:
            what = "never entered"
        else:
            what = f"{d['states'].get(r)}: " + ", ".join(f"{k}={v[r]}" for k, v in d["differ"].items() if r in v)
        rows.append(f"{r:>6} {str(last):>10} {what:<60}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m collectives.diagnose", description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = p.parse_args(argv)
    dumps = load(args.directory)
    if not dumps:
        print(f"no commops_trace_rank*.json in {args.directory}", file=sys.stderr)
        return 2
    found = diagnose(dumps)
    if args.json:
        print(json.dumps(found, indent=1, default=str))
        return 0
    for f in found["groups"]:
        print(_sentence(f))
        print(_table(f))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
