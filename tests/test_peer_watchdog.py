"""The section watchdog's decisions (collectives/peer/_watchdog.py), driven with a fake record and clock."""

from __future__ import annotations

import time

import numpy as np

from collectives.peer._watchdog import CLOSED, FAILED, OPENED, SectionWatchdog


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _watch(timeout: float = 5.0) -> tuple[SectionWatchdog, np.ndarray, Clock, list[bool]]:
    record, clock, calls = np.zeros(8, dtype=np.int32), Clock(), []
    return SectionWatchdog(record, timeout, calls.append, clock=clock), record, clock, calls


def test_an_open_section_without_progress_is_released_after_the_timeout() -> None:
    w, rec, clock, calls = _watch(5.0)
    rec[OPENED], rec[CLOSED] = 3, 2
    assert not w.observe()  # first sight starts the clock
    clock.t += 4.9
    assert not w.observe() and calls == []
    clock.t += 0.2
    assert w.observe() and calls == [True] and w.released is True
    clock.t += 100
    assert not w.observe() and calls == [True]  # once


def test_progress_restarts_the_clock() -> None:
    w, rec, clock, calls = _watch(5.0)
    for n in range(1, 20):  # sections back to back, each 3 s, always one open
        rec[OPENED], rec[CLOSED] = n, n - 1
        assert not w.observe()
        clock.t += 3.0
    assert calls == []
    clock.t += 2.5  # the 19th has now been open 5.5 s
    assert w.observe() and calls == [True]


def test_no_open_section_is_never_released() -> None:
    w, rec, clock, calls = _watch(1.0)
    rec[OPENED], rec[CLOSED] = 7, 7
    for _ in range(10):
        clock.t += 10
        assert not w.observe()
    assert calls == []


def test_a_kernel_timeout_releases_at_once() -> None:
    w, rec, clock, calls = _watch(1000.0)
    rec[OPENED], rec[CLOSED] = 1, 0
    assert not w.observe()
    rec[FAILED] = 1
    assert w.observe() and calls == [False] and w.released is False
    w2, rec2, _, calls2 = _watch(1000.0)
    rec2[FAILED] = 1  # also with no section open: its waits may be queued behind the failed barrier
    assert w2.observe() and calls2 == [False]


def test_the_thread_releases_and_stops() -> None:
    record, calls = np.zeros(8, dtype=np.int32), []
    record[OPENED] = 1
    w = SectionWatchdog(record, 0.05, calls.append, poll_s=0.01)
    w.start()
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    w.stop()
    assert calls == [True]
    assert w._thread is not None and not w._thread.is_alive()


def test_a_bound_release_is_held_weakly() -> None:
    class Owner:
        def __init__(self) -> None:
            self.calls: list[bool] = []

        def release(self, stuck: bool) -> None:
            self.calls.append(stuck)

    record, owner = np.zeros(8, dtype=np.int32), Owner()
    record[FAILED] = 1
    w = SectionWatchdog(record, 1.0, owner.release)
    del owner
    assert not w.observe() and w._stop.is_set()  # its owner is gone: it stops instead


def test_more_closes_than_opens_is_no_open_section() -> None:
    w, rec, clock, calls = _watch(1.0)
    rec[OPENED], rec[CLOSED] = 2, 3  # a caller that closed what it had not opened
    for _ in range(5):
        clock.t += 10
        assert not w.observe()
    assert calls == []
