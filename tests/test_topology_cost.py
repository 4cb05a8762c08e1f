"""The cost model against closed forms worked out by hand, and the hierarchical plans' structure.

Expected values are the textbook formulas (Thakur, Rabenseifner & Gropp 2005) evaluated here,
and byte counts derived from the op's definition, never numbers the model printed.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from collectives.algos import REGISTRY
from collectives.algos.hierarchical import plan
from collectives.selection import predict
from topology import Topology
from topology.cost import LinkCost, Machine
from topology.groups import rails_of

A, B, G = 7e-6, 2e-10, 3e-11  # alpha, beta, gamma of one tier
ONE_TIER = Machine("one", LinkCost(A, B), gamma=G)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
@pytest.mark.parametrize("n", [1 << 10, 1 << 24])
def test_single_tier_matches_thakur(p: int, n: int) -> None:
    nodes = [list(range(p))]
    lg = math.log2(p)
    ring = 2 * (p - 1) * A + 2 * (p - 1) / p * n * B + (p - 1) / p * n * G
    rd = lg * (A + n * B + n * G)
    hd = 2 * lg * A + 2 * (p - 1) / p * n * B + (p - 1) / p * n * G
    assert predict("ring", "all_reduce", nodes, ONE_TIER, n) == pytest.approx(ring)
    assert predict("recursive_doubling", "all_reduce", nodes, ONE_TIER, n) == pytest.approx(rd)
    assert predict("halving_doubling", "all_reduce", nodes, ONE_TIER, n) == pytest.approx(hd)
    assert predict("ring", "all_gather", nodes, ONE_TIER, n) == pytest.approx((p - 1) * A + (p - 1) / p * n * B)
    assert predict("pairwise", "all_to_all", nodes, ONE_TIER, n) == pytest.approx((p - 1) * (A + n / p * B))


def test_fold_adds_two_rounds_of_the_whole_message() -> None:
    n = 1 << 20
    five = predict("recursive_doubling", "all_reduce", [list(range(5))], ONE_TIER, n)
    four = predict("recursive_doubling", "all_reduce", [list(range(4))], ONE_TIER, n)
    assert five - four == pytest.approx(2 * (A + n * B) + n * G)


def test_shared_uplink_makes_the_hierarchy_win_by_the_byte_ratio() -> None:
    # 2 nodes x 2 ranks, one NIC per node, a network 1000x slower than the node: bandwidth-bound.
    # Flat ring: each node's uplink carries one ring flow of 2(p-1)/p n = 1.5 n bytes.
    # Hierarchical: the two rails' all-reduces of n/2 each send n/2 across, sharing the uplink: n.
    slow = Machine("slow", LinkCost(0.0, 1e-12), LinkCost(0.0, 1e-9), nics_per_node=1)
    nodes = [[0, 1], [2, 3]]
    n = 1 << 26
    ring = predict("ring", "all_reduce", nodes, slow, n)
    hier = predict("hierarchical", "all_reduce", nodes, slow, n)
    assert ring == pytest.approx(1.5 * n * 1e-9, rel=0.01)
    assert hier == pytest.approx(n * 1e-9, rel=0.01)
    # With a NIC per rank (rail-optimised) the rails no longer share: n/2 per rail.
    rails = Machine("rails", LinkCost(0.0, 1e-12), LinkCost(0.0, 1e-9), nics_per_node=2)
    assert predict("hierarchical", "all_reduce", nodes, rails, n) == pytest.approx(0.5 * n * 1e-9, rel=0.01)


def test_exchange_links_price_two_way_rounds() -> None:
    m = Machine("x", LinkCost(0.0, 1e-9), inter=LinkCost(0.0, 1e-9), inter_exchange=LinkCost(0.0, 2e-9))
    n = 1 << 20
    # Two ranks on two nodes: recursive doubling is one exchange of n bytes.
    assert predict("recursive_doubling", "all_reduce", [[0], [1]], m, n) == pytest.approx(n * 2e-9)


def test_anchor_sets_the_fixed_cost_and_links_the_growth() -> None:
    # One tier, 4 ranks: the ring all-reduce grows by 2(p-1)/p (n - n0) B + (p-1)/p (n - n0) G from
    # the measured n0 call (bytes and reductions only: the anchor holds every latency); other
    # algorithms and other topologies keep the plain model.
    n0, measured = 1 << 14, 3e-3
    nodes = [list(range(4))]
    m = Machine("anchored", LinkCost(A, B), gamma=G, meta={"ranks_per_node": [4]},
                anchors={"all_reduce": {"ring": measured}}, anchor_bytes=n0)
    n = 1 << 22
    growth = 2 * 3 / 4 * (n - n0) * B + 3 / 4 * (n - n0) * G
    assert predict("ring", "all_reduce", nodes, m, n) == pytest.approx(measured + growth)
    assert predict("ring", "all_reduce", nodes, m, n0) == pytest.approx(measured)
    assert predict("ring", "all_reduce", nodes, m, 16) == pytest.approx(measured)  # never below the anchor
    plain = 2 * 3 * A + 2 * 3 / 4 * n * B + 3 / 4 * n * G
    assert predict("halving_doubling", "all_reduce", nodes, m, n) == pytest.approx(2 * 2 * A + 2 * 3 / 4 * n * B
                                                                                   + 3 / 4 * n * G)
    assert predict("ring", "all_reduce", [[0, 1], [2, 3]], m, n) != pytest.approx(measured + growth)
    assert predict("ring", "all_reduce", nodes, ONE_TIER, n) == pytest.approx(plain)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce"])
def test_every_modelled_algorithm_is_registered_and_positive(op: str) -> None:
    nodes = [[0, 1], [2, 3]]
    priced = [name for name, algo in REGISTRY.items() if algo.cost(op, nodes, ONE_TIER) is not None]
    assert "native" in priced
    for name in priced:
        assert name in REGISTRY and REGISTRY[name].supports(op), name
        assert predict(name, op, nodes, ONE_TIER, 1 << 20) > 0


# -- hierarchical plans: intra phases stay in a node, inter phases take one rank per node, and the
#    bytes that cross nodes are the minimum the op needs ------------------------------------------
LAYOUTS = [[[0, 1], [2, 3]], [[0, 3], [1, 2]], [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]],
           [[0, 2, 4], [1, 3, 5]]]


def _node_of(nodes: list[list[int]]) -> dict[int, int]:
    return {r: k for k, members in enumerate(nodes) for r in members}


@pytest.mark.parametrize("nodes", LAYOUTS, ids=str)
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"])
def test_hierarchical_plan_structure(nodes: list[list[int]], op: str) -> None:
    topo = Topology.from_nodes(nodes)
    where = _node_of(nodes)
    n_nodes, g, p = len(nodes), len(nodes[0]), topo.world
    elements = 7 * p * 1000
    phases = plan(op, topo, elements)
    for ph in phases:
        for grp in ph.groups:
            homes = [where[r] for r in grp]
            if ph.tier == "intra":
                assert len(set(homes)) == 1, (ph, grp)
            else:
                assert sorted(homes) == list(range(n_nodes)), (ph, grp)  # one rank of every node
        covered = sorted(r for grp in ph.groups for r in grp)
        assert covered == list(range(p)), ph  # every rank takes part in every phase once
    inter = [ph for ph in phases if ph.tier == "inter"]
    assert len(inter) == 1 and inter[0].groups == tuple(rails_of(nodes))
    # Elements each rank feeds into the inter-node phase: an all-reduce needs the node's m spread
    # over its g ranks (m/g each); reduce-scatter and all-gather the n_nodes blocks of its rail;
    # all-to-all everything it sends. No phase moves more across nodes than the op must.
    c = elements // p
    expected = {"all_reduce": -(-elements // g), "reduce_scatter": n_nodes * c, "all_gather": n_nodes * c,
                "all_to_all": p * c}[op]
    assert inter[0].elements == expected


def test_hierarchical_all_reduce_sends_each_byte_across_nodes_twice_per_node_pair_minimum() -> None:
    # n nodes of g ranks, m bytes: the rails' ring all-reduces send 2(n-1)/n * m/g per rank, so a
    # node sends 2(n-1)/n * m across: exactly the all-reduce lower bound between n parties.
    one = Machine("bytes", LinkCost(0.0, 0.0), LinkCost(0.0, 1.0), nics_per_node=1)
    for n_nodes, g in [(2, 2), (3, 4), (4, 8)]:
        nodes = [list(range(k * g, (k + 1) * g)) for k in range(n_nodes)]
        m = 1 << 20
        secs = predict("hierarchical", "all_reduce", nodes, one, m)  # beta 1 s/B: seconds == bytes per node
        assert secs == pytest.approx(2 * (n_nodes - 1) / n_nodes * m, rel=1e-3), (n_nodes, g)


def test_simulator_prints_8_to_4096() -> None:
    out = subprocess.run([sys.executable, "-m", "topology.simulate", "--gpus", "8,4096", "--sizes", "1M,1G",
                          "--op", "all_reduce,all_to_all"], capture_output=True, text=True, timeout=240, check=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.strip() and not ln.startswith("#")]
    assert any(ln.split()[0] == "4096" for ln in lines[1:]) and any(ln.split()[0] == "8" for ln in lines[1:])
    assert len(lines) == 1 + 2 * 2 * 2  # header + gpus x ops x sizes
