"""The multi-process test harness: pools of spawn-started ranks with an initialised group.

A :class:`World` of ``size`` ranks is started once (spawn, a ``FileStore`` in a fresh temporary
directory, so no port is ever fixed) and reused by every test that asks for that size. A test
sends a module-level function; every rank runs ``fn(rank, size, *args)`` and the parent gets
each rank's return value. If a rank raises, its traceback comes back and :class:`RankFailure`
carries every failing rank's. If a rank does not answer in time, the parent makes the hung
ranks dump their Python stacks (``faulthandler`` on SIGUSR1), raises :class:`RankTimeout` with
those stacks, and restarts the pool for the next test.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["World", "RankFailure", "RankTimeout", "messages"]

# Collectives that outlive this fail inside the ranks (the group's own timeout) rather than hang.
GROUP_TIMEOUT_S = 90


def messages(calls: Any) -> list[str]:
    """For each call: the message of the ``InvalidArgumentError`` it raised, or "no error"."""
    from collectives.errors import InvalidArgumentError

    out = []
    for call in calls:
        try:
            call()
            out.append("no error")
        except InvalidArgumentError as exc:
            out.append(str(exc))
    return out


class RankFailure(AssertionError):
    def __init__(self, failures: dict[int, str]) -> None:
        self.failures = failures
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        super().__init__(f"{len(failures)} rank(s) failed:\n{text}")


class RankTimeout(AssertionError):
    def __init__(self, hung: dict[int, str], timeout: float) -> None:
        self.hung = hung
        text = "\n".join(f"--- rank {r} stack ---\n{st}" for r, st in sorted(hung.items()))
        super().__init__(f"rank(s) {sorted(hung)} did not finish within {timeout} s:\n{text}")


def _rank_main(rank: int, size: int, store_path: str, conn: Connection, stack_path: str, backend: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    with open(stack_path, "w") as stack_file:
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        store = dist.FileStore(store_path, size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        conn.send(("ready", None))
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg is None:
                break
            fn, args = msg
            try:
                out = ("ok", fn(rank, size, *args))
            except BaseException:  # noqa: BLE001 - everything goes back to the parent
                out = ("err", traceback.format_exc())
            conn.send(out)
        import collectives

        collectives.destroy()  # also drops cached communicators, so the group dies here, not at exit


class World:
    """``size`` rank processes in one torch.distributed group (Gloo unless told otherwise)."""

    def __init__(self, size: int, backend: str = "gloo", start_timeout: float = 180.0) -> None:
        self._closing = False  # request_close has told the ranks to exit
        self.size = size
        self.backend = backend
        self._dir = tempfile.TemporaryDirectory(prefix=f"commops-world{size}-")
        ctx = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._stacks = [os.path.join(self._dir.name, f"stack{r}.txt") for r in range(size)]
        store = os.path.join(self._dir.name, "store")
        for r in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(r, size, store, child, self._stacks[r], backend), daemon=True)
            p.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._collect(start_timeout, expect="ready")
        self.broken = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
        """Run ``fn(rank, size, *args)`` on every rank; return the results in rank order."""
        if self.broken:
            raise RuntimeError("this World was torn down after a timeout")
        for c in self._conns:
            c.send((fn, args))
        return self._collect(timeout)

    def _collect(self, timeout: float, expect: str = "ok") -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        pending = {c: r for r, c in enumerate(self._conns)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for c in wait(list(pending), timeout=left):
                r = pending.pop(c)  # type: ignore[call-overload]
                try:
                    kind, value = c.recv()
                except EOFError:
                    kind, value = "err", f"rank {r} exited (exit code {self._procs[r].exitcode})"
                if kind == "err":
                    failures[r] = value
                else:
                    results[r] = value
        if pending:
            hung = self._dump_stacks(sorted(pending.values()))
            for r, tb in failures.items():
                hung.setdefault(r, tb)
            self.close()
            raise RankTimeout(hung, timeout)
        if failures:
            raise RankFailure(failures)
        return [results[r] for r in range(self.size)]

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        for r in ranks:
            if self._procs[r].is_alive():
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(1.0)
        out = {}
        for r in ranks:
            try:
                with open(self._stacks[r]) as f:
                    out[r] = f.read() or "(no stack written)"
            except OSError as exc:
                out[r] = f"(stack unavailable: {exc})"
        return out

    def request_close(self) -> None:
        """Tell every rank to exit, without waiting (``close`` waits): pools told together exit together."""
        self.broken = True
        if self._closing:
            return
        self._closing = True
        for c in self._conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass

    def close(self, until: float | None = None) -> None:
        """Tell the ranks to exit and wait for them until ``until`` (``time.monotonic()``; default
        5 s from now), one deadline for all of them, then kill those still running."""
        self.request_close()
        deadline = time.monotonic() + 5.0 if until is None else until
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._dir.cleanup()
