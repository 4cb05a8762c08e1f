"""The dispatch point: tracing hooks, profiler labels, recorded choices, async handles, groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import collectives as C
from collectives.algos import for_op


def body_hooks(rank: int, world: int) -> list:
    events = []
    hook = lambda ev, call, detail: events.append((ev, call.op, call.choice.algorithm if call.choice else None, call.seq))  # noqa: E731
    C.add_trace_hook(hook)
    try:
        seq0 = C.get_communicator().seq
        C.all_reduce(torch.ones(3), algorithm="ring")
        C.broadcast(torch.ones(3), 0)
        with pytest.raises(C.InvalidArgumentError):
            C.all_reduce(torch.ones(4, 2)[:, 0])
    finally:
        C.remove_trace_hook(hook)
    return [seq0, events]


def test_trace_hooks_see_every_call_in_order(worlds) -> None:  # noqa: ANN001
    for seq0, events in worlds(2).run(body_hooks):
        assert [e[:3] for e in events] == [("start", "all_reduce", "ring"), ("end", "all_reduce", "ring"),
                                           ("start", "broadcast", "native"), ("end", "broadcast", "native")]
        assert [e[3] for e in events] == [seq0 + 1, seq0 + 1, seq0 + 2, seq0 + 2]


def body_profiler(rank: int, world: int) -> list[str]:
    x = torch.randn(1000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        C.all_reduce(x, algorithm="ring")
        C.all_gather_single(torch.empty(1000 * world), x, algorithm="native")
    return sorted({e.name for e in prof.events() if e.name.startswith("commops.")})


def test_calls_are_labelled_for_the_profiler(worlds) -> None:  # noqa: ANN001
    for names in worlds(2).run(body_profiler):
        assert names == ["commops.all_gather[native] 8000B", "commops.all_reduce[ring] 4000B"]


def body_auto(rank: int, world: int, calibrated: bool) -> list:
    comm = C.get_communicator()
    if not calibrated:  # the rules that apply where no calibration matches the machine
        comm._choices["calibration"] = None
    out = []
    for nbytes in (64, 1 << 16, 4 << 20):
        x = torch.randn(nbytes // 4)
        ref = x.clone()
        dist.all_reduce(ref)
        C.all_reduce(x)
        ch = C.last_choice()
        out.append((nbytes, ch.algorithm, ch.rule, ch.reason, bool(torch.allclose(x, ref, atol=1e-4))))
    comm.set_calibration(None)
    return out


def test_auto_records_its_choice_and_reason(worlds) -> None:  # noqa: ANN001
    import re

    from collectives.selection import SMALL_ALL_REDUCE_BYTES

    for rows in worlds(3).run(body_auto, False):
        for nbytes, algo, rule, reason, ok in rows:
            assert ok and reason
            if nbytes <= SMALL_ALL_REDUCE_BYTES:
                assert (algo, rule) == ("recursive_doubling", "cpu_small_all_reduce")
            else:
                assert algo == "native"
    # With this machine's shipped calibration (if one matches), the model decides and says why:
    # every candidate with its predicted time, the chosen one the least.
    for rows in worlds(3).run(body_auto, True):
        for nbytes, algo, rule, reason, ok in rows:
            assert ok and reason
            if rule == "cost_model":
                listed = {a: int(t) for a, t in re.findall(r"(\w+) (\d+) us", reason)}
                assert "native" in listed and listed[algo] == min(listed.values()), reason
            else:
                assert rule in ("cpu_small_all_reduce", "default"), (rule, reason)
    for rows in worlds(1).run(body_auto, True):
        assert all(r[1:3] == ("native", "single_rank") for r in rows)


def body_async(rank: int, world: int, algo: str) -> list[bool]:
    from topology import Topology

    # Two nodes of two ranks, so the topology-aware algorithms take their two-tier path.
    C.get_communicator().set_topology(Topology.from_nodes([[0, 1], [2, 3]]))
    try:
        return _async(rank, world, algo)
    finally:
        C.get_communicator().set_topology(None)


def _async(rank: int, world: int, algo: str) -> list[bool]:
    results = []
    xs = [torch.full((1001,), float(rank + i)) for i in range(3)]
    works = [C.all_reduce(x, async_op=True, algorithm=algo) for x in xs]
    for i, (w, x) in enumerate(zip(works, xs)):
        assert isinstance(w, C.Work)
        w.wait(timeout=60)
        results.append(w.is_completed())
        results.append(bool(torch.all(x == sum(range(world)) + world * i)))
    y = torch.full((world * 5,), float(rank))
    out = torch.empty(5)
    rs = algo if algo in for_op("reduce_scatter", backend="gloo") else "native"
    with C.reduce_scatter_single(out, y, async_op=True, algorithm=rs):
        pass
    results.append(bool(torch.all(out == sum(range(world)))))
    return results


@pytest.mark.parametrize("algo", for_op("all_reduce", backend="gloo"))
def test_async_handles(worlds, algo: str) -> None:  # noqa: ANN001
    for res in worlds(4).run(body_async, algo):
        assert all(res), res


def body_subgroup(rank: int, world: int) -> list[str]:
    members = [0, 2]
    g = dist.new_group(members)
    fails = []
    if rank not in members:
        return fails
    comm = C.get_communicator(g)
    assert (comm.size, comm.global_ranks) == (2, (0, 2))
    for algo in for_op("all_reduce", backend="gloo"):
        x = torch.full((7,), float(rank + 1))
        comm.all_reduce(x, algorithm=algo)
        if not torch.all(x == 4.0):
            fails.append(f"all_reduce {algo}: {x.tolist()}")
    for algo in for_op("broadcast", backend="gloo"):
        x = torch.full((5,), float(rank))
        C.broadcast(x, 2, group=g, algorithm=algo)  # src is a global rank, as in torch.distributed
        if not torch.all(x == 2.0):
            fails.append(f"broadcast {algo}: {x.tolist()}")
    for algo in for_op("all_to_all", backend="gloo"):
        inp = torch.tensor([10.0 * rank, 10.0 * rank + 1])
        out = torch.empty(2)
        comm.all_to_all_single(out, inp, algorithm=algo)
        expect = torch.tensor([0.0 + comm.rank, 20.0 + comm.rank])  # element g of each member, in group order
        if not torch.equal(out, expect):
            fails.append(f"all_to_all {algo}: {out.tolist()} != {expect.tolist()}")
    with pytest.raises(C.InvalidArgumentError, match="not a member"):
        C.broadcast(torch.ones(2), 1, group=g)
    return fails


def test_subgroups_use_group_ranks_and_global_roots(worlds) -> None:  # noqa: ANN001
    for fails in worlds(3).run(body_subgroup):
        assert not fails, fails


def body_init_on_existing_group(rank: int, world: int) -> list:
    comm = C.init()
    return [comm.group is dist.group.WORLD, comm.rank == rank, comm.size == world, C.init() is comm]


def test_init_is_idempotent_and_adopts_the_callers_group(worlds) -> None:  # noqa: ANN001
    for res in worlds(2).run(body_init_on_existing_group):
        assert all(res)


def body_uneven_group_counts(rank: int, world: int) -> list[float]:
    from topology import Topology

    # ranks 0 and 2 make a group that rank 1 does not: they now count one process group more,
    # and torch names groups made with local synchronization after that count
    if rank in (0, 2):
        dist.new_group([0, 2], use_local_synchronization=True)
    comm = C.get_communicator()
    comm.set_topology(Topology.from_nodes([[0, 1], [2]]))
    try:
        x = torch.full((5,), float(rank + 1))
        C.all_reduce(x, algorithm="hierarchical")  # derives groups (0, 1), (2,) and the leaders (0, 2)
        return x.tolist()
    finally:
        comm.set_topology(None)


def test_derived_groups_survive_ranks_with_different_group_counts(worlds) -> None:  # noqa: ANN001
    for got in worlds(3).run(body_uneven_group_counts, timeout=120):
        assert got == [6.0] * 5
