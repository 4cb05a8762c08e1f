"""A newly registered algorithm that describes its cost is priced by ``auto`` with no other edit.

The algorithm below exists only here: a star all-reduce (every rank sends its buffer to rank 0 in
one round, rank 0 sends the sum back in a second) that runs the backend's all-reduce for the
data. It fills ``Algorithm.cost`` and is registered with ``collectives.algos.register``; neither
``topology`` nor ``collectives/selection.py`` names it. On a machine where every message costs a
millisecond and bytes are free, its two rounds are the fewest of any algorithm at three ranks
(recursive doubling folds 3 ranks onto 2: three rounds; ring: 2(p-1) = 4), so the model must
list it at 2 ms and pick it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist

import collectives as C
from collectives.algos import REGISTRY, Algorithm, for_op, register
from collectives.dispatch import Call
from collectives.selection import predict
from tests.mp import World
from topology import Topology
from topology.cost import CostPlan, LinkCost, Links, Machine, Round, Stage, price

ALPHA = 1e-3  # seconds per message; bytes, reductions and host steps are free
LATENCY_BOUND = Machine("lat", LinkCost(ALPHA, 0.0))
WORLD = 3


class Star(Algorithm):
    """Reduce to rank 0 in one round, send the sum back in another (the backend's all-reduce moves the data)."""

    name = "test_star"
    ops = frozenset({"all_reduce"})
    summary = "star all-reduce (tests only)"

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        if op not in self.ops:
            return None
        p = sum(len(n) for n in nodes)
        gather = np.full((p, 1), -1, dtype=np.int64)
        gather[1:, 0] = 0                      # every other rank -> rank 0, reduced there
        scatter = np.full((p, max(1, p - 1)), -1, dtype=np.int64)
        scatter[0, : p - 1] = np.arange(1, p)  # rank 0 -> everyone else
        return CostPlan.sequence([Stage((Round(gather, 1.0, True), Round(scatter, 1.0, False)), Links.NATIVE)])

    def run(self, call: Call) -> None:
        dist.all_reduce(call.output, group=call.comm.group)


def _register(rank: int, world: int) -> None:
    register(Star())


def _unregister(rank: int, world: int) -> None:
    REGISTRY.pop(Star.name, None)


@pytest.fixture
def star(worlds: Callable[[int], World]) -> Iterator[World]:
    """``Star`` registered here and on every rank of a world of ``WORLD``, removed afterwards."""
    world = worlds(WORLD)
    register(Star())
    world.run(_register)
    yield world
    world.run(_unregister)
    REGISTRY.pop(Star.name, None)


def body_auto(rank: int, world: int) -> tuple[str, str, dict[str, float], list[float]]:
    comm = C.get_communicator()
    comm.set_topology(Topology.from_nodes([list(range(world))]))
    comm.set_calibration(LATENCY_BOUND)
    try:
        x = torch.full((1000,), float(rank + 1))
        C.all_reduce(x)
        ch = C.last_choice()
        assert ch is not None
        return ch.algorithm, ch.rule, dict(ch.predicted), sorted(set(x.tolist()))
    finally:
        comm.set_calibration(None)
        comm.set_topology(None)


def test_a_registered_algorithm_is_priced_and_picked_by_auto(star: World) -> None:
    for algorithm, rule, predicted, values in star.run(body_auto):
        assert (algorithm, rule) == ("test_star", "cost_model"), predicted
        assert predicted["test_star"] == pytest.approx(2 * ALPHA)                # two rounds
        assert predicted["recursive_doubling"] == pytest.approx(3 * ALPHA)       # fold, one exchange, unfold
        assert predicted["ring"] == pytest.approx(2 * (WORLD - 1) * ALPHA)
        assert values == [WORLD * (WORLD + 1) / 2]                               # 1 + 2 + 3 on every element


def test_the_registry_is_what_is_priced(star: World) -> None:
    # In this process too: listed by the registry, priced by name and as its own plan.
    nodes = [list(range(WORLD))]
    assert "test_star" in for_op("all_reduce")
    assert predict("test_star", "all_reduce", nodes, LATENCY_BOUND, 1 << 20) == pytest.approx(2 * ALPHA)
    plan = Star().cost("all_reduce", nodes, LATENCY_BOUND)
    assert plan is not None
    assert float(price(plan, "all_reduce", nodes, LATENCY_BOUND, [1 << 20])[0]) == pytest.approx(2 * ALPHA)
    with pytest.raises(KeyError):
        predict("test_star", "broadcast", nodes, LATENCY_BOUND, 1 << 20)  # no plan for it: no price
