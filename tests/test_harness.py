"""The multi-process harness itself: failing ranks' tracebacks come back, hung ranks' stacks are dumped."""

from __future__ import annotations

import time

import pytest

from tests.mp import RankFailure, RankTimeout, World


def body_fail_on_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError(f"planted failure on rank {rank}")
    return rank


def body_sleep_on_one(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(60)
    return rank


def body_rank(rank: int, world: int) -> int:
    return rank


def test_failing_rank_traceback_reaches_the_parent(worlds) -> None:  # noqa: ANN001
    with pytest.raises(RankFailure) as info:
        worlds(3).run(body_fail_on_one)
    assert list(info.value.failures) == [1]
    assert "planted failure on rank 1" in info.value.failures[1] and "body_fail_on_one" in info.value.failures[1]
    assert worlds(3).run(body_rank) == [0, 1, 2]  # the pool is still usable


def test_hung_rank_stack_is_dumped_and_the_pool_restarts() -> None:
    w = World(2)
    try:
        with pytest.raises(RankTimeout) as info:
            w.run(body_sleep_on_one, timeout=5)
        assert list(info.value.hung) == [1]
        assert "body_sleep_on_one" in info.value.hung[1]
        assert w.broken
    finally:
        w.close()
