"""The flight recorder, the timeout path and ``collectives.diagnose``, on Gloo.

Faults are injected for real: a rank skips a collective on a group with a short timeout, or two
ranks pass different shapes; the ranks' dumps then go through the diagnosis, which must name the
culprit rank and the call's sequence number.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import collectives as C
from collectives import recorder
from collectives.diagnose import diagnose, load
from collectives.dispatch import recorded

ROOT = Path(__file__).resolve().parent.parent


def _record(rank: int, world: int, directory: str) -> dict[str, object]:
    comm = C.get_communicator()
    first = comm.seq
    C.all_reduce(torch.ones(5))                                     # line A
    C.all_reduce(torch.ones(3, dtype=torch.float64), op="max", algorithm="ring")
    out = torch.empty(2 * world)
    C.all_gather_single(out, torch.ones(2))
    with recorded(comm, "moe_dispatch", "peer", out, out):  # communication outside the verbs
        pass
    path = C.dump_trace("on request", directory)
    data = json.loads(Path(path).read_text())  # type: ignore[arg-type]
    mine = [e for e in data["entries"] if e["seq"] > first and e["group"] == comm._group_name]
    return {"rank": data["rank"], "entries": mine}


def test_recorder_keeps_every_call_with_its_call_site(worlds, tmp_path) -> None:  # noqa: ANN001
    for res in worlds(2).run(_record, str(tmp_path)):
        ops = [(e["op"], e["algorithm"], e["in_shape"], e["dtype"], e["reduce_op"], e["state"]) for e in res["entries"]]
        assert ops == [("all_reduce", "recursive_doubling", [5], "float32", "sum", "completed"),
                       ("all_reduce", "ring", [3], "float64", "max", "completed"),
                       ("all_gather", ops[2][1], [2], "float32", None, "completed"),
                       ("moe_dispatch", "peer", [2 * 2], "float32", None, "enqueued")], ops
        seqs = [e["seq"] for e in res["entries"]]
        assert seqs == sorted(seqs) and len(set(seqs)) == 4
        assert all(e["callsite"].startswith(str(ROOT / "tests" / "test_faults_recorder.py")) for e in res["entries"])
        assert all(e["t_end"] >= e["t_enqueue"] for e in res["entries"])


def _skip(rank: int, world: int, directory: str) -> dict[str, object]:
    recorder.RECORDER.clear()  # this worker ran other tests' collectives before
    g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=3))
    C.all_reduce(torch.ones(4), group=g)  # every rank: progress is published for this group
    recorder.RECORDER.trace_dir = directory  # where the failing call dumps
    out: dict[str, object] = {"raised": None}
    t0 = time.monotonic()
    if rank != world - 1:  # the last rank skips the next call
        try:
            C.all_reduce(torch.ones(4), group=g, algorithm="native")
        except C.CollectiveTimeout as exc:
            out["raised"] = "CollectiveTimeout"
            out["missing"] = exc.missing
            out["message"] = str(exc)
            # catchable where torch's own timeout is, and as a TimeoutError
            out["kinds"] = [isinstance(exc, k) for k in (RuntimeError, dist.DistBackendError, TimeoutError)]
        except Exception as exc:  # noqa: BLE001 - reported to the parent as a failure of the test
            out["raised"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - t0
    C.dump_trace("test end", directory)
    recorder.RECORDER.trace_dir = None
    dist.barrier()  # the world group still works
    C.destroy(g)
    return out


def test_a_skipped_collective_times_out_naming_the_rank_that_never_came(worlds, tmp_path) -> None:  # noqa: ANN001
    world = 3
    results = worlds(world).run(_skip, str(tmp_path), timeout=120)
    for rank, res in enumerate(results[:-1]):
        assert res["raised"] == "CollectiveTimeout", res
        assert res["missing"] == [world - 1], res
        assert 2.5 < res["seconds"] < 15, res
        assert res["kinds"] == [True, True, True], res
        backend = str(res["message"]).partition(". Backend: ")[2]  # torch's own text, after ours
        assert "timed out" in backend.lower(), res["message"]
    found = diagnose(load(tmp_path))
    groups = [f for f in found["groups"] if f["first_disagreement"] is not None]
    assert len(groups) == 1, found
    d = groups[0]["first_disagreement"]
    assert d["missing"] == [world - 1] and d["op"] == "all_reduce"
    # the diagnosis names the same call the timeout did
    assert f"#{d['seq']}" in results[0]["message"]


def _mismatch(rank: int, world: int, directory: str) -> str:
    recorder.RECORDER.clear()
    g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=10))
    comm = C.get_communicator(g)
    comm.debug = True  # compare before sending: Gloo would abort the process on a size mismatch
    n = 4 if rank == 0 else 6  # rank 0 passes a different shape
    try:
        C.all_reduce(torch.ones(n), group=g, algorithm="ring")
        outcome = "returned"
    except C.CollectiveMismatch as exc:
        outcome = str(exc)
    C.all_reduce(torch.ones(4), group=g)  # the same call everywhere still works in debug mode
    # uneven all-to-all: row counts differ between ranks legitimately, and debug mode lets them
    send = [1, 2] if rank == 0 else [3, 1]
    recv = [1, 3] if rank == 0 else [2, 1]
    out = torch.empty(sum(recv), 2)
    C.all_to_all_single(out, torch.ones(sum(send), 2), recv, send, group=g)
    C.dump_trace("test end", directory)
    dist.barrier()
    C.destroy(g)
    return outcome


def test_debug_mode_catches_a_shape_mismatch_on_every_rank_and_diagnose_shows_both(worlds, tmp_path) -> None:  # noqa: ANN001
    outcomes = worlds(2).run(_mismatch, str(tmp_path), timeout=120)
    assert outcomes[0] == outcomes[1], outcomes  # the same error text on every rank
    assert "in_shape" in outcomes[0] and "rank(s) [0] passed [4]" in outcomes[0] and "rank(s) [1] passed [6]" in outcomes[0]
    assert "Fix:" in outcomes[0]
    proc = subprocess.run([sys.executable, "-m", "collectives.diagnose", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "in_shape differs" in text and "rank(s) [0] passed [4]" in text and "rank(s) [1] passed [6]" in text, text
    js = json.loads(subprocess.run([sys.executable, "-m", "collectives.diagnose", str(tmp_path), "--json"], cwd=ROOT,
                                   capture_output=True, text=True, timeout=60).stdout)
    bad = [f for f in js["groups"] if f["first_disagreement"]]
    assert bad and "in_shape" in bad[0]["first_disagreement"]["differ"]


def test_diagnose_finds_the_straggler_and_ignores_rotated_history(tmp_path) -> None:
    # Synthetic dumps: three ranks, twenty completed calls, rank 2 enters each 50 ms late; rank 0's
    # ring has lost the first five calls (it rotated), which is not a disagreement.
    def entry(seq: int, rank: int) -> dict[str, object]:
        t = 1000.0 + seq + (0.05 if rank == 2 else 0.001 * rank)
        return {"group": "0", "group_ranks": [0, 1, 2], "seq": seq, "op": "all_reduce", "algorithm": "native",
                "in_shape": [8], "out_shape": [8], "dtype": "float32", "reduce_op": "sum", "root": None,
                "callsite": "train.py:10", "t_enqueue": t, "t_end": t + 0.06, "state": "completed"}

    for rank in range(3):
        first = 6 if rank == 0 else 1
        data = {"rank": rank, "world": 3, "reason": "test", "entries": [entry(s, rank) for s in range(first, 21)]}
        (tmp_path / f"commops_trace_rank{rank}.json").write_text(json.dumps(data))
    found = diagnose(load(tmp_path))
    g = found["groups"][0]
    assert g["first_disagreement"] is None
    assert g["straggler"]["rank"] == 2 and g["straggler"]["last_in"] == g["straggler"]["of"]
    assert 45 < g["straggler"]["mean_lag_ms"] < 55


def _call_timeout(rank: int, world: int) -> dict[str, object]:
    recorder.RECORDER.clear()
    g = dist.new_group(list(range(world)))  # the default (long) timeout
    C.all_reduce(torch.ones(4), group=g)
    out: dict[str, object] = {"raised": None}
    t0 = time.monotonic()
    if rank == world - 1:
        time.sleep(4.0)  # late: the others' 1.5 s bound runs out first
        C.all_reduce(torch.ones(4), group=g, algorithm="native")  # completes their pending call
    else:
        try:
            with C.call_timeout(1.5):
                C.all_reduce(torch.ones(4), group=g, algorithm="native")
        except C.CollectiveTimeout as exc:
            out["raised"], out["missing"] = "CollectiveTimeout", exc.missing
    out["seconds"] = time.monotonic() - t0
    dist.barrier()
    C.destroy(g)
    return out


def test_call_timeout_bounds_a_call_below_the_group_timeout(worlds) -> None:  # noqa: ANN001
    results = worlds(3).run(_call_timeout, timeout=120)
    for res in results[:-1]:
        assert res["raised"] == "CollectiveTimeout" and res["missing"] == [2], res
        assert 1.4 < res["seconds"] < 4.0, res


def _outside(rank: int, world: int) -> dict[str, object]:
    from collectives.dispatch import recorded

    comm = C.get_communicator()
    recorder.RECORDER.clear()
    first = comm.seq
    a = torch.ones(4, 3)
    with recorded(comm, "gemm_all_reduce", "copy_engine", torch.empty((4, 5), device="meta"), a):
        pass
    raised = ""
    try:
        with recorded(comm, "moe_dispatch", "copy_engine", torch.empty((2, 3), device="meta"), a):
            raise RuntimeError("peer gone")
    except RuntimeError as exc:
        raised = str(exc)
    C.all_reduce(torch.ones(2))  # the verbs go on counting after them
    mine = [(e["seq"] - first, e["op"], e["algorithm"], e["state"], e["out_shape"]) for e in recorder.RECORDER.entries()
            if e["seq"] > first]
    return {"entries": mine, "raised": raised, "seq": comm.seq - first}


def test_communication_outside_the_verbs_is_counted_and_recorded(worlds) -> None:  # noqa: ANN001
    for res in worlds(2).run(_outside):
        assert res["raised"] == "peer gone" and res["seq"] == 3
        ops = [(s, op, alg, state) for s, op, alg, state, _ in res["entries"]]
        assert ops == [(1, "gemm_all_reduce", "copy_engine", "enqueued"), (2, "moe_dispatch", "copy_engine", "failed"),
                       (3, "all_reduce", ops[2][2], "completed")], res
        assert list(res["entries"][0][4]) == [4, 5]


def _progress_thread(rank: int, world: int) -> list[bool]:
    import threading

    def alive() -> bool:
        return any(t.name == "commops-progress" and t.is_alive() for t in threading.enumerate())

    C.all_reduce(torch.ones(2))  # the default store is there: progress is published
    seen = [alive()]
    recorder.RECORDER.stop_progress()  # what collectives.destroy() does before the groups go
    seen.append(alive())
    C.all_reduce(torch.ones(2))  # a later call publishes again
    seen.append(alive())
    return seen


def test_progress_thread_stops_before_the_groups_go(worlds) -> None:  # noqa: ANN001
    """No thread may be inside a store call while the process tears the store down."""
    for seen in worlds(2).run(_progress_thread):
        assert seen == [True, False, True], seen


def _dump_inside(rank: int, world: int, directory: str) -> int:
    import threading

    recorder.RECORDER.clear()
    g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=30))
    comm = C.get_communicator(g)
    C.all_reduce(torch.ones(4), group=g)
    if rank == 0:
        # Dumped while this rank waits inside the next call, as a launcher's SIGTERM or a SIGUSR1
        # finds a rank stuck in a collective.
        timer = threading.Timer(0.5, lambda: C.dump_trace("while inside", directory))
        timer.start()
        C.all_reduce(torch.ones(4), group=g)
        timer.join()
    else:
        time.sleep(1.5)
        C.dump_trace("before its call", directory)  # this rank has not entered it yet
        C.all_reduce(torch.ones(4), group=g)
    seq = comm.seq
    dist.barrier()
    C.destroy(g)
    return seq


def test_diagnose_names_the_call_a_rank_was_still_inside_when_it_dumped(worlds, tmp_path) -> None:  # noqa: ANN001
    seqs = worlds(2).run(_dump_inside, str(tmp_path), timeout=120)
    found = diagnose(load(tmp_path))
    g = [f for f in found["groups"] if f["first_disagreement"] is not None]
    assert len(g) == 1, found
    d = g[0]["first_disagreement"]
    assert d["seq"] == seqs[0] and d["missing"] == [1] and d["states"] == {0: "started"}, d
    assert g[0]["in_flight"] == {"seq": seqs[0], "op": "all_reduce", "ranks": [0]}, g[0]
    assert g[0]["first_failure"] is None
    text = subprocess.run([sys.executable, "-m", "collectives.diagnose", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60).stdout
    assert f"rank(s) [0] were still inside call #{seqs[0]} (all_reduce)" in text, text


def _wait_for(what, bound_s: float):  # noqa: ANN001, ANN202
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.05)
    return None


def _dumped(path: Path, reason: str) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if data["reason"] == reason else None


def test_a_rank_held_inside_a_hung_collective_dumps_on_signal(tmp_path) -> None:  # noqa: ANN001
    """SIGUSR1 and SIGTERM dump at once, though the main thread is inside Gloo's wait, where Python
    runs no handler; SIGTERM still ends the rank once the call returns."""
    import os
    import signal

    env = dict(os.environ, COMMOPS_TRACE_DIR=str(tmp_path), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(ROOT / "tests" / "hung_rank.py")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        pid = _wait_for(lambda: (tmp_path / "pid0").exists() and (tmp_path / "pid0").read_text(), 120)
        assert pid, "rank 0 never reached the hung call"
        time.sleep(1.0)  # inside the all-reduce by now
        dump = tmp_path / "commops_trace_rank0.json"
        sent = time.monotonic()
        os.kill(int(pid), signal.SIGUSR1)
        data = _wait_for(lambda: _dumped(dump, "SIGUSR1"), 10)
        assert data is not None, "no dump on SIGUSR1 while the rank waits"
        took = time.monotonic() - sent
        entries = data["entries"]
        assert entries[-1]["op"] == "all_reduce" and entries[-1]["state"] == "started", entries[-1]
        found = diagnose(load(tmp_path))["groups"][0]
        assert found["no_dump"] == [1] and found["in_flight"]["ranks"] == [0], found
        os.kill(int(pid), signal.SIGTERM)
        data = _wait_for(lambda: _dumped(dump, "SIGTERM"), 10)
        assert data is not None and data["entries"][-1]["state"] == "started", data
        assert proc.poll() is None  # still held: the usual effect waits for the call to return
        (tmp_path / "go").write_text("")
        proc.wait(timeout=60)
        # Once Gloo's wait returned, the main thread's handler ran: a last dump, then SIGTERM's
        # usual effect (the call never returned to its caller, so it is still "started" there).
        final = json.loads(dump.read_text())
        assert final["reason"] == "SIGTERM" and final["time"] > data["time"], final
        assert final["entries"][-1]["seq"] == entries[-1]["seq"]
        assert proc.returncode != 0, proc.stdout.read() if proc.stdout else ""
        assert took < 5.0, took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
