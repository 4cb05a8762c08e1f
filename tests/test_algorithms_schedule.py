"""Schedules checked as data: structure, and what they compute, at many world sizes, no processes.

Every registered point-to-point algorithm's schedule is built for every rank, checked against
the executor's invariants, and run by the lock-step simulator on random float64 data; the result
is compared with ``bench.reference``. Step counts, peers and bytes are checked against the
algorithms' textbook formulas.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bench.reference import expected, rank_data, split_matrix
from collectives.algos import REGISTRY, Layout, ScheduledAlgorithm
from collectives.algos.simulate import simulate

SCHEDULED = [(name, op) for name, a in REGISTRY.items() if isinstance(a, ScheduledAlgorithm) for op in sorted(a.ops)]
WORLDS = list(range(1, 14))
COUNTS = [0, 1, 2, 7, 13, 64, 101]


def _layouts(op: str, world: int, count: int, root: int, splits: list[list[int]] | None) -> list[Layout]:
    if op == "all_to_all":
        assert splits is not None
        return [Layout(op, world, r, in_splits=tuple(splits[r]), out_splits=tuple(s[r] for s in splits)) for r in range(world)]
    return [Layout(op, world, r, count, root) for r in range(world)]


def _run(name: str, op: str, world: int, count: int, root: int = 0, pattern: str = "even", reduce_op: str = "sum"):
    algo = REGISTRY[name]
    splits = split_matrix(world, count + world, pattern, count) if op == "all_to_all" else None
    layouts = _layouts(op, world, count, root, splits)
    scheds = [algo.schedule(lay) for lay in layouts]
    for s in scheds:
        s.check()
    n_in = {"reduce_scatter": count * world, "all_to_all": sum(splits[0]) if splits else 0}.get(op, count)
    inputs = []
    for r in range(world):
        n_in_r = sum(splits[r]) if splits else n_in
        inputs.append(rank_data(r, n_in_r, torch.float64, seed=world * 1000 + count, reduce_op=reduce_op))
    bufs = []
    for r in range(world):
        x = inputs[r].numpy().copy()
        if op in ("all_reduce", "broadcast", "reduce"):
            bufs.append({"in": x, "out": x})
        else:
            n_out = {"reduce_scatter": count, "all_gather": count * world}.get(op) if op != "all_to_all" else sum(s[r] for s in splits)
            bufs.append({"in": x, "out": np.full(n_out, np.nan)})
    simulate(scheds, bufs, reduce_op)
    for r in range(world):
        if op == "reduce" and r != root:
            np.testing.assert_array_equal(bufs[r]["out"], inputs[r].numpy(), err_msg=f"rank {r}: non-root input changed")
            continue
        ref = expected(op, inputs, r, reduce_op, root, splits).numpy()
        np.testing.assert_allclose(bufs[r]["out"], ref, rtol=1e-12, atol=1e-12, err_msg=f"{name} {op} world={world} rank={r}")
    return scheds


@pytest.mark.parametrize("name,op", SCHEDULED)
@pytest.mark.parametrize("world", WORLDS)
def test_schedule_computes_the_collective(name: str, op: str, world: int) -> None:
    patterns = ["even"]
    if op == "all_to_all" and not REGISTRY[name].equal_splits_only:
        patterns += ["uneven", "one_hot"]
    roots = sorted({0, world - 1, world // 2}) if op in ("broadcast", "reduce") else [0]
    for count in COUNTS:
        for pattern in patterns:
            for root in roots:
                _run(name, op, world, count, root, pattern)


@pytest.mark.parametrize("reduce_op", ["max", "min", "prod", "avg"])
@pytest.mark.parametrize("name,op", [(n, o) for n, o in SCHEDULED if o in ("all_reduce", "reduce_scatter", "reduce")])
def test_schedule_reduce_ops(name: str, op: str, reduce_op: str) -> None:
    for world in (3, 4, 6):
        scheds = _run(name, op, world, 11, root=1, reduce_op=reduce_op if reduce_op != "avg" else "sum")
        assert scheds


def _comm_steps(name: str, op: str, world: int, count: int, rank: int, root: int = 0) -> int:
    lay = Layout(op, world, rank, count, root) if op != "all_to_all" else Layout(op, world, rank, in_splits=(count,) * world, out_splits=(count,) * world)
    return len(REGISTRY[name].schedule(lay).comm_steps)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8, 12])
def test_ring_structure(world: int) -> None:
    pairs = set()
    n = 120 * world
    for r in range(world):
        s = REGISTRY["ring"].schedule(Layout("all_reduce", world, r, n))
        assert len(s.comm_steps) == 2 * (world - 1)
        assert s.peers() <= {(r + 1) % world, (r - 1) % world}
        pairs |= {(r, t.peer) for st in s.steps for t in st.sends}
        # bandwidth-optimal: 2 (p-1)/p of the data leaves each rank
        assert s.elements_sent() == 2 * (world - 1) * n // world
    assert pairs == {(r, (r + 1) % world) for r in range(world)}
    assert len(pairs) == world


@pytest.mark.parametrize("world", [2, 4, 8, 16])
def test_recursive_doubling_power_of_two(world: int) -> None:
    for r in range(world):
        s = REGISTRY["recursive_doubling"].schedule(Layout("all_reduce", world, r, 64))
        assert len(s.comm_steps) == int(math.log2(world))
        assert s.peers() == {r ^ (1 << k) for k in range(int(math.log2(world)))}
        assert s.elements_sent() == 64 * int(math.log2(world))
        g = REGISTRY["recursive_doubling"].schedule(Layout("all_gather", world, r, 8))
        assert len(g.comm_steps) == int(math.log2(world))
        assert g.elements_sent() == 8 * (world - 1)


@pytest.mark.parametrize("world", [3, 5, 6, 7, 12])
def test_fold_adds_two_steps_for_non_power_of_two(world: int) -> None:
    p2 = 1 << (world.bit_length() - 1)
    rem = world - p2
    for name, extra_phases in (("recursive_doubling", 1), ("halving_doubling", 2)):
        for r in range(world):
            steps = _comm_steps(name, "all_reduce", world, 10 * world, r)
            if r < 2 * rem and r % 2 == 0:
                assert steps == 2, (name, r)  # hand over, get back
            elif r < 2 * rem:
                assert steps == extra_phases * int(math.log2(p2)) + 2, (name, r)
            else:
                assert steps == extra_phases * int(math.log2(p2)), (name, r)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_halving_doubling_sends_like_the_ring(world: int) -> None:
    n = 64 * world
    for r in range(world):
        s = REGISTRY["halving_doubling"].schedule(Layout("all_reduce", world, r, n))
        assert len(s.comm_steps) == 2 * int(math.log2(world))
        assert s.elements_sent() == 2 * (world - 1) * n // world
        rs = REGISTRY["halving_doubling"].schedule(Layout("reduce_scatter", world, r, 64))
        assert len(rs.comm_steps) == int(math.log2(world))
        assert rs.elements_sent() == (world - 1) * 64


@pytest.mark.parametrize("world", [2, 3, 5, 8, 13])
def test_bruck_and_pairwise_step_counts(world: int) -> None:
    for r in range(world):
        assert _comm_steps("bruck", "all_to_all", world, 4, r) == math.ceil(math.log2(world))
        assert _comm_steps("pairwise", "all_to_all", world, 4, r) == world - 1
        pw = REGISTRY["pairwise"].schedule(Layout("all_to_all", world, r, in_splits=(4,) * world, out_splits=(4,) * world))
        assert pw.elements_sent() == 4 * (world - 1)
        assert pw.peers() == set(range(world)) - {r}


@pytest.mark.parametrize("world", [2, 3, 5, 8, 11])
@pytest.mark.parametrize("root", [0, 1])
def test_binomial_tree_shape(world: int, root: int) -> None:
    root %= world
    sends = recvs = 0
    for op in ("broadcast", "reduce"):
        sends = recvs = 0
        for r in range(world):
            s = REGISTRY["binomial_tree"].schedule(Layout(op, world, r, 16, root))
            sends += sum(len(st.sends) for st in s.steps)
            recvs += sum(len(st.recvs) for st in s.steps)
            assert len(s.comm_steps) <= math.ceil(math.log2(world))
            if op == "broadcast" and r != root:
                assert sum(len(st.recvs) for st in s.steps) == 1  # every rank receives once
        assert sends == recvs == world - 1  # a tree: p-1 edges
        root_sched = REGISTRY["binomial_tree"].schedule(Layout(op, world, root, 16, root))
        assert len(root_sched.comm_steps) == math.ceil(math.log2(world))
