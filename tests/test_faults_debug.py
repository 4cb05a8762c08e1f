"""Debug check mode on Gloo, three ranks: all-to-all splits and sizes that disagree, and a rank
that never reaches a call, each caught on every rank within the call's own bound.

The mismatches must raise ``CollectiveMismatch`` on every rank with the same text, in about the
time of one store round trip, and leave the group usable: without the check Gloo aborts two ranks
on such an all-to-all and the third waits out its timeout. A rank that skips a call must be
named in ``CollectiveTimeout`` on the others within the bound that applies to the call (a
``call_timeout`` block, ``init(timeout=...)``'s ``comm.timeout_s``, or the group's timeout) plus
a small margin, not after a fixed minute.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import collectives as C
from collectives import recorder

MARGIN_S = 5.0  # slack over the bound for a loaded two-core machine


def _splits_case(rank: int, world: int, case: str) -> tuple[list[int] | None, list[int] | None, int, int]:
    """(input_split_sizes, output_split_sizes, input rows, output rows) of this rank's faulty call."""
    last = world - 1
    if case == "splits":  # the last rank sends 2 rows to rank 0, which expects 1 from it
        ins = [2] + [1] * (world - 1) if rank == last else [1] * world
        return ins, [1] * world, sum(ins), world
    # case "size": no splits, the last rank's tensors hold 2 rows per peer, the others' 1
    rows = 2 * world if rank == last else world
    return None, None, rows, rows


def _mismatch(rank: int, world: int, case: str) -> dict[str, object]:
    recorder.RECORDER.clear()
    g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=30))
    comm = C.get_communicator(g)
    comm.debug = True
    ins, outs, n_in, n_out = _splits_case(rank, world, case)
    out: dict[str, object] = {"raised": None}
    t0 = time.monotonic()
    try:
        C.all_to_all_single(torch.empty(n_out, 2), torch.ones(n_in, 2), outs, ins, group=g)
    except C.CollectiveMismatch as exc:
        out.update(raised="CollectiveMismatch", message=str(exc), field=exc.field, sides=exc.sides)
    out["seconds"] = time.monotonic() - t0
    # The group still works: a correct all-to-all, checked by rank arithmetic (row q of rank r's
    # input holds 10 r + q; rank r must receive 10 q + r from each q).
    send = torch.tensor([[10.0 * rank + q] * 2 for q in range(world)])
    got = torch.empty(world, 2)
    C.all_to_all_single(got, send, group=g)
    out["after"] = got[:, 0].tolist() == [10.0 * q + rank for q in range(world)]
    dist.barrier()
    C.destroy(g)
    return out


@pytest.mark.parametrize("case", ["splits", "size"])
def test_all_to_all_split_and_size_mismatch_raise_on_every_rank_at_once(worlds, case: str) -> None:  # noqa: ANN001
    world = 3
    results = worlds(world).run(_mismatch, case, timeout=90)
    assert all(r["raised"] == "CollectiveMismatch" for r in results), results
    assert len({r["message"] for r in results}) == 1, results  # the same text on every rank
    assert all(r["seconds"] < 3.0 for r in results), [r["seconds"] for r in results]
    assert all(r["after"] for r in results), results
    res = results[0]
    msg = str(res["message"])
    assert res["field"] == "splits", res
    if case == "splits":  # the one pair that disagrees, both sides' values, and who passed what
        assert "rank 2 sends 2 row(s) to rank 0, which expects 1 from it" in msg, msg
        assert "rank(s) [2] passed input_split_sizes=[2, 1, 1], output_split_sizes=[1, 1, 1]" in msg, msg
    else:  # every pair with the last rank disagrees, in both directions
        for q in (0, 1):
            assert f"rank {q} sends 1 row(s) to rank 2, which expects 2 from it" in msg, msg
            assert f"rank 2 sends 2 row(s) to rank {q}, which expects 1 from it" in msg, msg
        assert "rank(s) [0, 1] passed input_split_sizes=[1, 1, 1], output_split_sizes=[1, 1, 1]" in msg, msg
        assert "rank(s) [2] passed input_split_sizes=[2, 2, 2], output_split_sizes=[2, 2, 2]" in msg, msg
    assert "Fix:" in msg


BOUND_S = 3.0


def _skip(rank: int, world: int, bound: str) -> dict[str, object]:
    recorder.RECORDER.clear()
    # The group's own timeout is short only when that is the bound under test.
    g_timeout = BOUND_S if bound == "group" else 300.0
    g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=g_timeout))
    comm = C.get_communicator(g)
    comm.debug = True
    if bound == "init":
        comm.timeout_s = BOUND_S  # what collectives.init(timeout=...) sets on its communicator
    C.all_reduce(torch.ones(4), group=g)  # every rank: the group and its debug keys work
    out: dict[str, object] = {"raised": None}
    t0 = time.monotonic()
    if rank != world - 1:  # the last rank skips the next call
        try:
            if bound == "call_timeout":
                with C.call_timeout(BOUND_S):
                    C.all_reduce(torch.ones(4), group=g)
            else:
                C.all_reduce(torch.ones(4), group=g)
        except C.CollectiveTimeout as exc:
            out.update(raised="CollectiveTimeout", missing=exc.missing, message=str(exc))
        except Exception as exc:  # noqa: BLE001 - reported to the parent as the test's failure
            out["raised"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - t0
    dist.barrier()  # the world group still works
    C.destroy(g)
    return out


@pytest.mark.parametrize("bound", ["call_timeout", "init", "group"])
def test_a_rank_that_skips_a_call_is_named_within_the_calls_bound(worlds, bound: str) -> None:  # noqa: ANN001
    world = 3
    results = worlds(world).run(_skip, bound, timeout=150)
    for res in results[:-1]:
        assert res["raised"] == "CollectiveTimeout" and res["missing"] == [world - 1], res
        assert "debug check" in str(res["message"]), res
        assert BOUND_S - 0.5 < res["seconds"] < BOUND_S + MARGIN_S, res
