"""The launch/ scripts run as users run them: through torchrun and mpiexec, as subprocesses, bounded in time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _rows(out: str) -> list[list[str]]:
    return [ln.split() for ln in out.splitlines() if ln[:12].strip().isdigit()]


def _mpiexec() -> str | None:
    return shutil.which("mpiexec") or shutil.which("mpiexec", path=os.path.dirname(sys.executable))


def test_main_job_under_torchrun(tmp_path: Path) -> None:
    res = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                "launch/bench_allreduce.py", "-b", "1K", "-e", "4K", "-f", "4", "-n", "3", "-r", "2", "-w", "1",
                "--json", str(tmp_path / "r.json"), "--csv", str(tmp_path / "r.csv"), "--plot", str(tmp_path / "r.png"),
                "--out", str(tmp_path / "record")])
    assert res.returncode == 0, res.stdout + res.stderr
    # the record every run leaves (here in the folder asked for), and the line that says where
    assert f"# record of this run: {tmp_path / 'record'}" in res.stdout, res.stdout[-2000:]
    assert json.loads((tmp_path / "record" / "results.json").read_text())["records"]
    assert (tmp_path / "record" / "plot.png").stat().st_size > 1000
    rows = _rows(res.stdout)
    algos = {r[3].split("(")[0] for r in rows}
    from collectives.algos import for_op

    assert algos == set(for_op("all_reduce", backend="gloo")) | {"auto"}
    assert {int(r[0]) for r in rows} == {1024, 4096}
    assert all(r[8] == "0" for r in rows), res.stdout  # #wrong
    assert "out-of-bounds values: 0  (OK)" in res.stdout
    meta = json.loads((tmp_path / "r.json").read_text())["meta"]
    assert meta["world"] == 3 and meta["torch"] and "bench_allreduce.py" in meta["command"]
    assert (tmp_path / "r.png").stat().st_size > 1000 and (tmp_path / "r.csv").read_text().count("\n") == 1 + 2 * len(algos)


@pytest.mark.parametrize("op", ["all_to_all", "reduce_scatter", "broadcast"])
def test_collectives_benchmark(op: str) -> None:
    res = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "launch/bench_collectives.py", "--op", op, "-b", "1K", "-e", "1K", "-n", "2", "-r", "2", "-w", "1",
                "--out", "none"])
    assert res.returncode == 0, res.stdout + res.stderr
    rows = _rows(res.stdout)
    assert rows and all(r[8] == "0" for r in rows)


def test_main_job_under_mpiexec() -> None:
    mpiexec = _mpiexec()
    if mpiexec is None:
        if os.environ.get("CI"):
            pytest.fail("mpiexec is missing in CI: the 'mpi' extra (mpi4py, mpich) must be installed")
        pytest.skip("no mpiexec on PATH (pip install 'commops[mpi]')")
    res = _run([mpiexec, "-n", "3", sys.executable, "launch/bench_allreduce.py", "-b", "1K", "-e", "1K",
                "-n", "2", "-r", "2", "-w", "1", "--out", "none"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "3 ranks, backend gloo" in res.stdout
    from collectives.algos import for_op

    assert len(_rows(res.stdout)) == len(for_op("all_reduce", backend="gloo")) + 1 and "(OK)" in res.stdout


def test_dispatch_benchmark_runs() -> None:
    res = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "launch/bench_dispatch.py", "--calls", "20", "--rounds", "3"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "overhead:" in res.stdout


def test_peer_epilogue_probe_refuses_cpus_naming_the_fix() -> None:
    # the probe times GEMMs writing into a peer GPU's memory: on Gloo it must say so, not time CPUs
    res = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                "launch/probe_peer_epilogue.py", "--shapes", "64x64x64"])
    assert res.returncode != 0
    assert "UnsupportedError" in res.stderr and "GPUs of one node" in res.stderr, res.stderr[-2000:]
