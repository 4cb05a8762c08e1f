"""Run every rank's schedule in one process, on numpy arrays, with rendezvous matching.

Used by the tests (algorithms checked at many world sizes without starting processes) and by
anything that wants to know what a schedule does without a network. The model is strict: a send
matches a receive only while both ranks are in the steps that hold them, and a step completes
once all of its transfers have matched, as with a backend whose sends block until the receiver
has posted (NCCL, Gloo for large messages). A schedule that would deadlock under that model
raises :class:`Deadlock` naming the stuck ranks and steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ._schedule import Region, Schedule

__all__ = ["simulate", "Deadlock"]

_REDUCE: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum,
}


class Deadlock(RuntimeError):
    pass


def simulate(schedules: Sequence[Schedule], buffers: Sequence[dict[str, np.ndarray]], reduce_op: str = "sum") -> None:
    """Execute ``schedules[r]`` on ``buffers[r]`` for every rank ``r``; buffers are updated in place.

    Each rank's ``buffers`` holds flat arrays "in" and "out" ("tmp" is added with the schedule's
    scratch size). "avg" is simulated as a sum, like the executor does before its final division.
    """
    world = len(schedules)
    fold = _REDUCE[reduce_op]
    for sched, bufs in zip(schedules, buffers):
        bufs.setdefault("tmp", np.zeros(sched.scratch, dtype=bufs["out"].dtype))

    def view(r: int, reg: Region) -> np.ndarray:
        return buffers[r][reg.buf][reg.offset:reg.end]

    pos = [0] * world
    matched: list[set[tuple[str, int]]] = [set() for _ in range(world)]
    landed: list[dict[int, np.ndarray]] = [{} for _ in range(world)]
    started = [False] * world

    def current(r: int):  # type: ignore[no-untyped-def]
        steps = schedules[r].steps
        return steps[pos[r]] if pos[r] < len(steps) else None

    progress = True
    while progress:
        progress = False
        for r in range(world):
            step = current(r)
            if step is None:
                continue
            if not started[r]:
                for c in step.copies:
                    view(r, c.dst)[:] = view(r, c.src)
                started[r] = True
                progress = True
            for si, send in enumerate(step.sends):
                if ("s", si) in matched[r]:
                    continue
                q = send.peer
                peer_step = current(q)
                if peer_step is None or not started[q]:
                    continue
                for ri, recv in enumerate(peer_step.recvs):
                    if recv.peer == r and ("r", ri) not in matched[q]:
                        if recv.count != send.count:
                            raise AssertionError(f"rank {r} sends {send.count} to {q}, which expects {recv.count}")
                        landed[q][ri] = np.concatenate([view(r, reg) for reg in send.src]) if send.src else np.zeros(0)
                        matched[r].add(("s", si))
                        matched[q].add(("r", ri))
                        progress = True
                        break
        for r in range(world):
            step = current(r)
            if step is None or not started[r]:
                continue
            if len(matched[r]) == len(step.sends) + len(step.recvs):
                for ri, recv in enumerate(step.recvs):
                    data = landed[r][ri]
                    at = 0
                    for reg in recv.dst:
                        piece = data[at:at + reg.count]
                        at += reg.count
                        dst = view(r, reg)
                        dst[:] = fold(dst, piece) if recv.reduce else piece
                pos[r] += 1
                matched[r] = set()
                landed[r] = {}
                started[r] = False
                progress = True
    stuck = [(r, pos[r]) for r in range(world) if current(r) is not None]
    if stuck:
        raise Deadlock(f"ranks stuck at (rank, step): {stuck}")
