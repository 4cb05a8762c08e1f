"""One rank goes wrong, without debug mode: the others raise a named error within seconds.

Each case runs on a fresh group of 3 Gloo ranks whose timeout is 30 minutes (torch's default
for Gloo), so a rank that waited for the timeout would hang the test (bounded by the worker's
own limit); the culprit is the last rank. What every case must show: each other rank raises,
within 5 s, an error naming the culprit rank and the call; and the next call is what the
library documents (``collectives/_watch.py``): the group aborted (``GroupAborted`` on every
rank) where some rank entered the call, usable where nothing was sent.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import collectives as C

LONG = datetime.timedelta(minutes=30)


def _case(rank: int, world: int, case: str) -> dict[str, Any]:
    g = dist.new_group(list(range(world)), timeout=LONG)
    bad = world - 1
    if case != "first_call":
        C.all_reduce(torch.ones(4), group=g)  # the group's first call: its settings agree
    out: dict[str, Any] = {"raised": None}
    x = torch.randn(6)
    t0 = time.monotonic()
    try:
        if case in ("bad_argument", "first_call"):
            o = torch.empty(world * 6 - (1 if rank == bad else 0))
            C.all_gather_single(o, x, group=g)
        elif case == "every_rank_bad":
            C.all_gather_single(torch.empty(world * 6 - 1), x, group=g)
        elif case == "different_op":
            if rank == bad:
                C.broadcast(x, 0, group=g)
            else:
                C.all_reduce(x, group=g)
        elif case == "different_size":  # auto: our point-to-point schedule, whose tags carry the counts
            C.all_reduce(torch.randn(8 if rank == bad else 6), group=g)
        elif case == "bad_list":  # a list form's own check (collectives/_lists.py)
            C.all_gather([torch.empty(6) for _ in range(world + (1 if rank == bad else 0))], x, group=g)
        elif case == "different_reduce_op":
            # Gloo pairs these and returns: nothing waits, nothing is noticed without debug mode;
            # what the matrix records (launch/faults) is the op mismatch that waits
            C.all_reduce(x, op="max" if rank == bad else "sum", group=g, algorithm="ring")
        elif case == "refused_algorithm":
            C.all_reduce(x, group=g, algorithm="no_such_algorithm" if rank == bad else "auto")
        elif case == "raises_in_algorithm":
            from collectives.algos import REGISTRY

            algo = REGISTRY["ring"]
            saved = algo.run
            if rank == bad:
                def boom(call: Any) -> None:
                    raise RuntimeError("injected: the ring algorithm failed on this rank")
                algo.run = boom  # type: ignore[method-assign]
            try:
                C.all_reduce(x, group=g, algorithm="ring")
            finally:
                algo.run = saved  # type: ignore[method-assign]
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        out.update(raised=type(exc).__name__, message=str(exc), culprit=getattr(exc, "culprit", None),
                   seq=getattr(exc, "seq", None))
    out["detect_s"] = time.monotonic() - t0
    y = torch.full((3,), float(rank + 1))
    try:
        C.all_reduce(y, group=g)
        out["next"] = "ok" if y.eq(world * (world + 1) / 2).all() else f"wrong: {y.tolist()}"
    except Exception as exc:  # noqa: BLE001
        out["next"] = type(exc).__name__
        out["next_message"] = str(exc)
    # a new group of the same ranks works, whatever happened to this one
    z = torch.ones(2)
    g2 = dist.new_group(list(range(world)))
    C.all_reduce(z, group=g2)
    out["new_group"] = z.eq(world).all().item()
    C.destroy(g2)
    return out


ABORTING = ["bad_argument", "refused_algorithm", "raises_in_algorithm", "different_op", "different_size", "bad_list"]


@pytest.mark.parametrize("case", ABORTING)
def test_the_others_raise_within_seconds_and_the_group_is_aborted(worlds, case: str) -> None:  # noqa: ANN001
    res = worlds(3).run(_case, case, timeout=90)
    culprit = 2
    for r, o in enumerate(res):
        assert o["new_group"], (r, o)
        assert o["next"] == "GroupAborted", (r, o)
        if case in ("different_op", "different_size"):  # both sides are named, on every rank
            # CollectiveMismatch where this rank compared first; RankFailed carrying the
            # mismatch found by the rank whose abort broke this one's wait
            assert o["raised"] in ("CollectiveMismatch", "RankFailed"), (r, o)
            field = "disagree on op" if case == "different_op" else "shape"
            assert field in o["message"] and "[2]" in o["message"], o["message"]
            assert o["detect_s"] < 5 + 1, (r, o)
            continue
        if r == culprit:
            assert o["raised"] in ("InvalidArgumentError", "UnsupportedError", "RuntimeError"), o
            continue
        assert o["raised"] == "RankFailed", (r, o)
        assert o["culprit"] == culprit and o["seq"] == 2, o
        assert f"rank {culprit} failed its call #2" in o["message"], o["message"]
        assert o["detect_s"] < 5, (r, o)


def test_a_failure_before_the_first_call_sent_leaves_the_group_usable(worlds) -> None:  # noqa: ANN001
    res = worlds(3).run(_case, "first_call", timeout=90)
    assert res[2]["raised"] == "InvalidArgumentError", res[2]
    for o in res[:2]:
        assert o["raised"] == "RankFailed" and o["culprit"] == 2 and o["detect_s"] < 5, o
        assert "the group is usable" in o["message"], o["message"]
    assert all(o["next"] == "ok" for o in res), res


def test_the_same_bad_argument_everywhere_leaves_the_group_usable(worlds) -> None:  # noqa: ANN001
    res = worlds(3).run(_case, "every_rank_bad", timeout=90)
    assert all(o["raised"] == "InvalidArgumentError" for o in res), res
    assert all(o["next"] == "ok" for o in res), res
