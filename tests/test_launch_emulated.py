"""The emulated multi-node cluster: real torchrun per network namespace, collectives across it.

Needs root and iproute2. Skipped where they are missing, except under ``CI=true``, where a skip
would hide that the multi-node path was never run: there it fails instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EMULATE = [sys.executable, "launch/emulate_cluster.py"]


def _usable() -> str | None:
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs {tool} (iproute2 / util-linux)"
    return None


@pytest.fixture(autouse=True)
def _root_or_fail() -> None:
    why = _usable()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the emulated cluster, but: {why}")
        pytest.skip(why)


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith("cmx")]


def _run(args: list[str], timeout: float = 280) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(EMULATE + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_collectives_across_two_emulated_nodes() -> None:
    before = _namespaces()
    res = _run(["--nodes", "2", "--procs-per-node", "2", "--inter-node-mbit", "1000", "--timeout", "250",
                "--", "tests/emulated_check.py", "2"])
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "EMULATED nodes=[[0, 1], [2, 3]] failures=0" in out, out[-6000:]
    from collectives.algos import for_op

    for algo in for_op("all_reduce", backend="gloo"):
        assert f"CHECK all_reduce {algo} n=40000 wrong=0" in out
    assert "CHECK all_to_all hierarchical n=40000 wrong=0" in out
    assert "[node 0]" in out and "[node 1]" in out
    assert _namespaces() == before  # everything it made is gone


@pytest.mark.slow  # about 30 s: the launcher's timeout path (a failing rank's exit runs by default)
def test_timeout_kills_every_node_and_cleans_up(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    before = _namespaces()
    res = _run(["--nodes", "2", "--procs-per-node", "1", "--timeout", "20", "--", str(script)], timeout=120)
    assert res.returncode == 124, res.stdout + res.stderr
    assert "timeout after 20 s" in res.stderr
    assert _namespaces() == before


def test_a_failing_rank_sets_the_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['GROUP_RANK'] == '1' else 0)\n")
    res = _run(["--nodes", "2", "--procs-per-node", "1", "--timeout", "120", "--fail-grace", "2", "--", str(script)],
               timeout=200)
    assert res.returncode != 0 and "exited with" in res.stderr, res.stdout + res.stderr


def test_without_root_it_says_so() -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to drop root")
    res = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *EMULATE,
                          "--", "x.py"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "need root" in res.stderr, res.stdout + res.stderr
