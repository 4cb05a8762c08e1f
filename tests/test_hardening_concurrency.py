"""Concurrency and call order: async calls, threads on two groups, the program's own messages.

Each body repeats its case ``ROUNDS`` times with fresh float64 values and checks every result
against rank arithmetic (sums of values each rank can compute for every other rank). A rank that
sleeps before its next call (rank 0) is what makes the ranks' interleavings differ: without an
order kept by the library, the same program pairs different calls on different ranks.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import collectives as C
from topology import Topology

ROUNDS = 20


def _value(rank: int, seed: int) -> float:
    return float((rank + 1) * 7 + seed % 13)


def _expect(size: int, seed: int) -> float:
    return sum(_value(r, seed) for r in range(size))


def _topology(size: int) -> Topology | None:
    return {3: Topology.from_nodes([[0, 1], [2]]), 4: Topology.from_nodes([[0, 1], [2, 3]])}.get(size)


def body_async_then_sync(rank: int, size: int, algo: str, tiers: bool) -> list[str]:
    """``w = all_reduce(a, async); all_reduce(b); w.wait()``: both right on every rank."""
    comm = C.get_communicator()
    comm.set_topology(_topology(size) if tiers else None)
    bad = []
    try:
        for i in range(ROUNDS):
            a = torch.full((5 + i,), _value(rank, i), dtype=torch.float64)
            b = torch.full((5 + i,), -_value(rank, i + 100), dtype=torch.float64)
            w = C.all_reduce(a, algorithm=algo, async_op=True)
            if rank == 0:
                time.sleep(0.02)  # rank 0's worker issues a first; the others call b first
            C.all_reduce(b, algorithm="native")
            w.wait()
            if not (a.eq(_expect(size, i)).all() and b.eq(-_expect(size, i + 100)).all()):
                bad.append(f"round {i}: a={a[0].item()} (want {_expect(size, i)}) b={b[0].item()} "
                           f"(want {-_expect(size, i + 100)})")
    finally:
        comm.set_topology(None)
    return bad


@pytest.mark.parametrize("algo", ["hierarchical", "grid2d", "ring"])
@pytest.mark.parametrize("tiers", [False, True], ids=["one-node", "two-nodes"])
def test_async_call_keeps_call_order(worlds, algo: str, tiers: bool) -> None:  # noqa: ANN001
    size = 4 if algo == "grid2d" and tiers else 3
    for r, bad in enumerate(worlds(size).run(body_async_then_sync, algo, tiers, timeout=240)):
        assert not bad, f"rank {r}: {bad[:3]}"


def body_waited_out_of_order(rank: int, size: int) -> list[str]:
    comm = C.get_communicator()
    comm.set_topology(_topology(size))
    bad = []
    try:
        for i in range(ROUNDS):
            xs = [torch.full((3 + k,), _value(rank, i + k), dtype=torch.float64) for k in range(3)]
            works = [C.all_reduce(x, algorithm="hierarchical", async_op=True) for x in xs]
            for k in (2, 0, 1):
                works[k].wait()
            for k, x in enumerate(xs):
                if not x.eq(_expect(size, i + k)).all():
                    bad.append(f"round {i} call {k}: {x[0].item()} (want {_expect(size, i + k)})")
    finally:
        comm.set_topology(None)
    return bad


def test_async_calls_waited_out_of_order(worlds) -> None:  # noqa: ANN001
    for r, bad in enumerate(worlds(3).run(body_waited_out_of_order, timeout=240)):
        assert not bad, f"rank {r}: {bad[:3]}"


def body_two_threads_two_groups(rank: int, size: int, algo: str) -> list[str]:
    """Two threads, each running ``algo`` on its own group (same ranks), at once."""
    groups = [dist.new_group(list(range(size))) for _ in range(2)]
    for g in groups:
        C.get_communicator(g).set_topology(_topology(size))
    bad: list[str] = []
    start = threading.Barrier(2)

    def work(k: int) -> None:
        try:
            start.wait(timeout=30)
            for i in range(ROUNDS):
                x = torch.full((4 + k,), _value(rank, 10 * k + i), dtype=torch.float64)
                C.all_reduce(x, group=groups[k], algorithm=algo)
                if not x.eq(_expect(size, 10 * k + i)).all():
                    bad.append(f"thread {k} round {i}: {x[0].item()} (want {_expect(size, 10 * k + i)})")
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            bad.append(f"thread {k}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    bad += [f"thread {k} still running" for k, t in enumerate(threads) if t.is_alive()]
    for g in groups:
        C.destroy(g)
    return bad


@pytest.mark.parametrize("algo", ["hierarchical", "grid2d"])
def test_two_threads_on_two_groups(worlds, algo: str) -> None:  # noqa: ANN001
    size = 4 if algo == "grid2d" else 3
    for r, bad in enumerate(worlds(size).run(body_two_threads_two_groups, algo, timeout=300)):
        assert not bad, f"rank {r}: {bad[:3]}"


def body_user_messages_across_ours(rank: int, size: int) -> list[str]:
    """A program's own isend/irecv (tag 1, then the tags ours would use) in flight across a ring all-reduce."""
    bad = []
    for i in range(ROUNDS):
        tag = 1 + i
        peer_to, peer_from = (rank + 1) % size, (rank - 1) % size
        mine = torch.full((6,), _value(rank, i), dtype=torch.float64)
        theirs = torch.empty(6, dtype=torch.float64)
        recv = dist.irecv(theirs, peer_from, tag=tag)
        x = torch.full((6,), _value(rank, i + 50), dtype=torch.float64)
        C.all_reduce(x, algorithm="ring")
        send = dist.isend(mine, peer_to, tag=tag)
        send.wait()
        recv.wait()
        if not x.eq(_expect(size, i + 50)).all():
            bad.append(f"round {i}: all-reduce gave {x[0].item()} (want {_expect(size, i + 50)})")
        if not theirs.eq(_value(peer_from, i)).all():
            bad.append(f"round {i}: the program's message gave {theirs[0].item()} (want {_value(peer_from, i)})")
    return bad


def test_program_messages_never_match_ours(worlds) -> None:  # noqa: ANN001
    for r, bad in enumerate(worlds(3).run(body_user_messages_across_ours, timeout=240)):
        assert not bad, f"rank {r}: {bad[:3]}"
