"""The flight recorder's dumps and signal handlers against what else is in the directory and the process.

Dumps go to a trace directory other users may share: links planted at the names a dump could
use must not be written through, and no temporary file may be left, whatever fails. The signal
handlers run in a child process that signals itself; they must chain to what the program had.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from collectives import recorder
from collectives.recorder import FlightRecorder

ROOT = Path(__file__).resolve().parent.parent
FINAL = "commops_trace_rank0.json"


@pytest.fixture
def rank0(monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")


def _temporaries(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


def test_a_dump_writes_through_no_planted_link(tmp_path, rank0) -> None:  # noqa: ANN001
    trace, victim = tmp_path / "trace", tmp_path / "victim"
    trace.mkdir()
    victim.write_text("precious")
    # every name the dump's temporary file once had (.json.<n>.tmp, n counting dumps), and the final one
    planted = [trace / f"commops_trace_rank0.json.{n}.tmp" for n in range(1, 21)] + [trace / FINAL]
    for p in planted:
        p.symlink_to(victim)
    rec = FlightRecorder(capacity=4)
    for i in range(3):
        assert rec.dump(f"dump {i}", str(trace)) == str(trace / FINAL)
    assert victim.read_text() == "precious"
    final = trace / FINAL
    assert not final.is_symlink() and json.loads(final.read_text())["reason"] == "dump 2"
    assert (final.stat().st_mode & 0o777) == 0o600
    assert _temporaries(trace) == sorted(p.name for p in planted[:-1])  # the planted links, nothing of ours
    assert all(p.is_symlink() for p in planted[:-1])


@pytest.mark.parametrize("fails", ["json.dumps", "os.replace"])
def test_a_failed_dump_leaves_no_temporary_file(tmp_path, rank0, monkeypatch, fails) -> None:  # noqa: ANN001
    rec = FlightRecorder(capacity=4)
    rec.dump("before", str(tmp_path))
    module, name = fails.split(".")

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError(f"{fails} failed")

    monkeypatch.setattr(recorder.json if module == "json" else recorder.os, name, broken)
    with pytest.raises(OSError, match="failed"):
        rec.dump("after", str(tmp_path))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [FINAL]
    assert json.loads((tmp_path / FINAL).read_text())["reason"] == "before"


def _child(body: str, trace: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter with the recorder imported and ``trace`` made; a main
    thread dump counter is installed (the watcher thread's dumps are not counted)."""
    program = textwrap.dedent("""\
        import json, os, signal, sys, threading, time
        sys.path.insert(0, {root!r})
        from collectives import recorder
        trace = {trace!r}
        main_dumps = []
        _dump = recorder.RECORDER.dump
        def counting(reason, directory=None):
            if threading.current_thread() is threading.main_thread():
                main_dumps.append(reason)
            return _dump(reason, directory)
        recorder.RECORDER.dump = counting
        def wait_for_dump(reason):
            path = os.path.join(trace, "commops_trace_rank0.json")
            for _ in range(200):
                try:
                    if json.load(open(path))["reason"] == reason:
                        return
                except (OSError, ValueError):
                    pass
                time.sleep(0.02)
    """).format(root=str(ROOT), trace=str(trace)) + textwrap.dedent(body)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", PYTHONPATH=str(ROOT))
    env.pop("COMMOPS_TRACE_DIR", None)
    return subprocess.run([sys.executable, "-c", program], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _reason(trace: Path) -> str:
    return str(json.loads((trace / FINAL).read_text())["reason"])


def test_the_programs_own_sigusr1_handler_still_runs(tmp_path) -> None:  # noqa: ANN001
    done = _child("""
        seen = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
        recorder.set_trace_dir(trace)
        recorder.set_trace_dir(trace)  # twice: still one dump and one call of the program's handler
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)  # the handlers run between two bytecodes of the main thread
        wait_for_dump("SIGUSR1")
        print(json.dumps({"seen": seen, "main_dumps": main_dumps}))
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"seen": [int(signal.SIGUSR1)], "main_dumps": ["SIGUSR1"]}
    assert _reason(tmp_path) == "SIGUSR1"


def test_a_default_sigusr1_only_dumps(tmp_path) -> None:  # noqa: ANN001
    done = _child("""
        recorder.set_trace_dir(trace)
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        print("alive")
    """, tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "alive", done.stderr
    assert _reason(tmp_path) == "SIGUSR1"


def test_an_ignored_sigterm_stays_ignored_after_its_dump(tmp_path) -> None:  # noqa: ANN001
    done = _child("""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        recorder.set_trace_dir(trace)
        recorder.set_trace_dir(trace)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        wait_for_dump("SIGTERM")
        print(json.dumps(main_dumps))
    """, tmp_path)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert json.loads(done.stdout) == ["SIGTERM"]
    assert _reason(tmp_path) == "SIGTERM"


def test_a_default_sigterm_still_ends_the_process_after_its_dump(tmp_path) -> None:  # noqa: ANN001
    done = _child("""
        recorder.set_trace_dir(trace)
        recorder.set_trace_dir(trace)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived")
    """, tmp_path)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
    assert "survived" not in done.stdout
    assert _reason(tmp_path) == "SIGTERM"


def test_the_programs_own_sigterm_handler_runs_once_after_the_dump(tmp_path) -> None:  # noqa: ANN001
    done = _child("""
        def mine(signum, frame):
            print(json.dumps({"dumped_first": json.load(open(os.path.join(trace, "commops_trace_rank0.json")))["reason"],
                              "main_dumps": main_dumps}), flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, mine)
        recorder.set_trace_dir(trace)
        recorder.set_trace_dir(trace)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    """, tmp_path)
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert json.loads(done.stdout) == {"dumped_first": "SIGTERM", "main_dumps": ["SIGTERM"]}


def test_a_sigterm_whose_dump_fails_still_ends_the_process(tmp_path) -> None:  # noqa: ANN001
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    done = _child("""
        recorder.set_trace_dir(trace)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived")
    """, not_a_dir)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr)
