"""Run every CPU fault scenario and check what the library said: ``python launch/faults/run_all.py``.

Each scenario (a script beside this one) runs under ``torchrun --standalone --nproc-per-node N``
(Gloo) with its own trace directory and a short collective timeout; then its dumps go through
``collectives.diagnose``. Printed per scenario: whether the fault was detected as expected, the
diagnosis (culprit rank, call sequence number, op), seconds from the fault to its detection,
whether every rank exited within timeout + 15 s of the fault (the first rank's faulty call; the
launch and the import of torch, which take 5-15 s on a loaded 2-core machine, are not counted, and
``timeout + 90`` s bounds the whole job), and how many of the scenario's processes are
left. ``--json`` writes the rows. The exit status is 1 if any scenario was missed. Each
scenario's trace directory is private (``tempfile.mkdtemp``) and removed once it has been read;
``--keep-traces`` keeps them and prints where they are.

``--gpu`` runs the NCCL matrix (skipped collective, crash and the mismatches, one rank per GPU);
``--emulated`` adds the inter-node link going down in an emulated 2-node cluster (root only).
Every scenario runs its faulty call inside ``collectives.call_timeout``, which also bounds NCCL's
waits on the host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

from collectives.diagnose import diagnose, load  # noqa: E402

# scenario -> what a correct detection looks like
SCENARIOS = {
    "skipped_collective": "timeout",
    "rank_crash": "crash",
    "shape_mismatch": "mismatch:in_shape",
    "dtype_mismatch": "mismatch:dtype",
    "reduce_op_mismatch": "mismatch:reduce_op",
    "root_mismatch": "mismatch:root",
    "straggler": "straggler",
    "skipped_moe_layer": "timeout",
    "debug_hang": "timeout",
    "debug_size_mismatch": "mismatch:splits",
}
# A hang inside each CPU algorithm (launch/faults/algorithm_hang.py, FAULT_ALGORITHM=<name>).
HANG_ALGORITHMS = ("native", "ring", "recursive_doubling", "halving_doubling", "hierarchical", "grid2d", "pairwise",
                   "bruck", "binomial_tree")
SCENARIOS.update({f"algorithm_hang[{a}]": "hang" for a in HANG_ALGORITHMS})
# One rank's call fails while the others wait, group timeout 30 min, no debug mode
# (launch/faults/one_rank_fails.py, FAULT_CASE=<case>): the others must raise within 5 s.
FAST_CASES = ("bad_argument", "refused_algorithm", "raises_in_algorithm", "different_op", "different_size")
SCENARIOS.update({f"one_rank_fails[{c}]": "fast" for c in FAST_CASES})
FAST_DETECT_S = 5.0


def _script(name: str) -> tuple[str, dict[str, str]]:
    """The script a scenario runs and what it adds to the environment."""
    if name.startswith("algorithm_hang["):
        return "algorithm_hang", {"FAULT_ALGORITHM": name[len("algorithm_hang["):-1]}
    if name.startswith("one_rank_fails["):
        return "one_rank_fails", {"FAULT_CASE": name[len("one_rank_fails["):-1]}
    return name, {}


def _left(script: Path) -> int:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if str(script) in line and "ps -eo" not in line)


def _judge(kind: str, outcomes: dict[int, dict[str, Any]], found: dict[str, Any], world: int,
           timeout_s: float) -> dict[str, Any]:
    culprit = world - 1
    groups = found["groups"]
    g = groups[0] if groups else {}
    d = g.get("first_disagreement") or {}
    row: dict[str, Any] = {"culprit_named": None, "seq": d.get("seq"), "op": d.get("op"), "detected": False}
    others = [o for r, o in outcomes.items() if r != culprit]
    if len(others) < world - 1:  # a rank that wrote no outcome did not show that it noticed
        others = []
    if kind == "timeout":
        row["detected"] = bool(others) and all(o["raised"] == "CollectiveTimeout" and o.get("missing") == [culprit]
                                               for o in others)
        row["culprit_named"] = d.get("missing")
    elif kind == "crash":
        row["detected"] = bool(others) and all(o["raised"] for o in others) and culprit in g.get("no_dump", [])
        row["culprit_named"] = g.get("no_dump")
        # the call the others failed in, or were stopped inside (the launcher stops them once the culprit is gone)
        failed = g.get("first_failure") or g.get("in_flight") or {}
        row["seq"], row["op"] = failed.get("seq"), failed.get("op")
    elif kind.startswith("mismatch:"):
        field = kind.split(":")[1]
        sides = (d.get("differ") or {}).get(field, {})
        values: dict[str, list[int]] = {}
        for r, v in sides.items():
            values.setdefault(json.dumps(v), []).append(int(r))
        if not values and len(outcomes) == world:
            # A field the recorder does not keep (an all-to-all's splits): the sides every rank
            # raised with, which must be the same everywhere; the call is the one that failed.
            raised = {json.dumps(o.get("sides"), sort_keys=True) for o in outcomes.values() if o.get("field") == field}
            if len(raised) == 1:
                values = dict(json.loads(raised.pop()))
            failed = g.get("first_failure") or {}
            row["seq"], row["op"] = failed.get("seq"), failed.get("op")
        minority = min(values.values(), key=len) if len(values) > 1 else None
        if len(values) == 2 and all(len(v) == 1 for v in values.values()):  # two ranks: both sides are named
            minority = [culprit] if [culprit] in values.values() else minority
        row["culprit_named"] = minority
        row["detected"] = all(o["raised"] == "CollectiveMismatch" for o in outcomes.values()) and minority == [culprit]
    elif kind == "link_down":
        near = [o for r, o in outcomes.items() if r < world // 2]
        far = list(range(world // 2, world))
        row["detected"] = bool(near) and all(o["raised"] == "CollectiveTimeout" and o.get("missing") == far for o in near)
        row["culprit_named"] = near[0].get("missing") if near else None
        failed = g.get("first_failure") or g.get("in_flight") or {}
        row["seq"], row["op"] = failed.get("seq"), failed.get("op")
    elif kind == "hang":
        # The culprit entered the call and hangs inside it: every other rank whose part waits on it
        # raises CollectiveTimeout within timeout + 5 s (a rank whose part never needed the culprit,
        # as in a broadcast from rank 0, returns); none raised anything else.
        raised = [o for o in others if o["raised"]]
        row["detected"] = bool(raised) and all(o["raised"] == "CollectiveTimeout" for o in raised) \
            and all(o["detect_s"] <= timeout_s + 5 for o in raised)
        # every rank entered the call, so no rank is missing from it: the culprit is the one the
        # launcher had to stop, still inside it (the others' outcomes are a timeout or a return)
        row["culprit_named"] = sorted(r for r, o in outcomes.items() if o["raised"] not in (None, "CollectiveTimeout"))
        failed = g.get("first_failure") or g.get("in_flight") or {}
        row["seq"], row["op"] = failed.get("seq"), failed.get("op")
    elif kind == "fast":
        # every other rank raised, within FAST_DETECT_S of the fault, an error naming the culprit
        # (RankFailed; or CollectiveMismatch naming both sides); the culprit raised its own
        named = [o for o in others if o["raised"] in ("RankFailed", "CollectiveMismatch")
                 and (f"rank {culprit} failed" in o.get("message", "") or f"[{culprit}]" in o.get("message", ""))]
        row["detected"] = bool(others) and len(named) == len(others) \
            and all(o["detect_s"] <= FAST_DETECT_S for o in others) and bool(outcomes.get(culprit, {}).get("raised"))
        row["culprit_named"] = [culprit] if row["detected"] else None
        failed = g.get("first_failure") or g.get("in_flight") or {}
        row["seq"], row["op"] = failed.get("seq"), failed.get("op")
    elif kind == "straggler":
        s = g.get("straggler") or {}
        row["culprit_named"] = [s["rank"]] if s else None
        row["detected"] = bool(s) and s["rank"] == culprit and all(o["raised"] is None for o in outcomes.values())
        row["seq"] = max(g.get("last_seq", {}).values(), default=None)
        row["op"] = "all_reduce"
    return row


NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
GPU_SCENARIOS = ("skipped_collective", "rank_crash", "shape_mismatch", "dtype_mismatch", "reduce_op_mismatch",
                 "root_mismatch", "skipped_moe_layer")


def run_one(name: str, kind: str, world: int, timeout_s: float, gpu: bool = False,
            keep: bool = False) -> dict[str, Any]:
    """Run scenario ``name`` and judge it; its trace directory is removed afterwards unless ``keep``."""
    trace = tempfile.mkdtemp(prefix=f"commops-fault-{name}-")
    try:
        row = _run_one(name, kind, world, timeout_s, gpu, trace)
    finally:
        if keep:
            print(f"[run_all] {name}: trace directory kept: {trace}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(trace, ignore_errors=True)
    row["trace_dir"] = trace if keep else None
    return row


def _run_one(name: str, kind: str, world: int, timeout_s: float, gpu: bool, trace: str) -> dict[str, Any]:
    script_name, extra = _script(name)
    script = HERE / f"{script_name}.py"
    env = dict(os.environ, COMMOPS_TRACE_DIR=trace, FAULT_TIMEOUT_S=str(timeout_s), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", **extra)
    if gpu:
        env.update(NO_MULTICAST)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU matrix: Gloo, even on a GPU machine
    if kind == "link_down":  # two emulated nodes of world/2 ranks; the emulator needs root
        cmd = [sys.executable, str(ROOT / "launch" / "emulate_cluster.py"), "--nodes", "2", "--procs-per-node",
               str(max(1, world // 2)), "--inter-node-mbit", "400", "--timeout", str(int(timeout_s + 120)), "--",
               str(script)]
        world = 2 * max(1, world // 2)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), str(script)]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s + 90)
        exited, code, log = True, proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        exited, code, log = False, None, str(exc.stdout or "") + str(exc.stderr or "")
    wall, ended_at = time.monotonic() - t0, time.time()
    time.sleep(0.5)
    outcomes = {}
    for p in Path(trace).glob("outcome_rank*.json"):
        o = json.loads(p.read_text())
        outcomes[int(o["rank"])] = o
    dumps = load(trace)
    found = diagnose(dumps) if dumps else {"groups": []}
    fault_at = min((o["fault_at"] for o in outcomes.values() if "fault_at" in o), default=None)
    exit_s = wall if fault_at is None else ended_at - fault_at  # no rank reached the fault: from launch
    bound_s = timeout_s + 15 + (20 if kind == "link_down" else 0)
    row = {"scenario": name, **_judge(kind, outcomes, found, world, timeout_s),
           "detect_s": max((o["detect_s"] for o in outcomes.values() if o.get("raised")), default=None),
           "wall_s": wall, "exit_code": code, "exit_s": exit_s, "all_exited": exited and exit_s <= bound_s,
           "processes_left": _left(script),
           "raised": {r: o.get("raised") for r, o in sorted(outcomes.items())}}
    if kind == "straggler":
        row["detect_s"] = None
    if not row["detected"]:
        row["log_tail"] = log[-3000:]
    return row


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/faults/run_all.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--timeout", type=float, default=5.0, help="the groups' collective timeout, seconds")
    p.add_argument("--only", default="", help="comma-separated scenarios (default: all CPU ones)")
    p.add_argument("--emulated", action="store_true",
                   help="also the link-down scenario in an emulated 2-node cluster (needs root)")
    p.add_argument("--gpu", action="store_true", help="the NCCL matrix: one rank per GPU (NVLink multicast off)")
    p.add_argument("--json")
    p.add_argument("--keep-traces", action="store_true",
                   help="keep each scenario's trace directory (dumps, outcomes) and print where it is")
    args = p.parse_args()
    scenarios = dict(SCENARIOS, **({"link_down": "link_down"} if args.emulated else {}))
    if args.gpu:
        import torch

        scenarios = {n: k for n, k in scenarios.items() if n in GPU_SCENARIOS}
        args.world = torch.cuda.device_count()
    names = [n for n in scenarios if not args.only or n in args.only.split(",")]
    rows = []
    for n in names:
        world = 4 if scenarios[n] == "link_down" or n == "algorithm_hang[grid2d]" else args.world
        rows.append(run_one(n, scenarios[n], world, args.timeout, args.gpu, args.keep_traces))
        print(f"[run_all] {n}: {'detected' if rows[-1]['detected'] else 'MISSED'}; the job took {rows[-1]['wall_s']:.1f} s",
              file=sys.stderr, flush=True)
    wide = max([len("scenario")] + [len(r["scenario"]) for r in rows])  # the longest name sets the column
    print(f"{'scenario':<{wide}} {'detected':<9} {'diagnosis (culprit, call #, op)':<36} {'to detect':>9} "
          f"{'all exited':>10} {'after':>7} {'left':>5}")
    for r in rows:
        diag = f"rank {r['culprit_named']}, #{r['seq']}, {r['op']}"
        det = "-" if r["detect_s"] is None else f"{r['detect_s']:.1f} s"
        print(f"{r['scenario']:<{wide}} {'yes' if r['detected'] else 'NO':<9} {diag:<36} {det:>9} "
              f"{'yes' if r['all_exited'] else 'NO':>10} {r['exit_s']:>5.1f} s {r['processes_left']:>5}")
    for r in rows:
        if not r["detected"]:
            print(f"--- {r['scenario']} (missed) ---\n{r.get('log_tail', '')}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str) + "\n")
    ok = all(r["detected"] and r["all_exited"] and r["processes_left"] == 0 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
