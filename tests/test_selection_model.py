"""``algorithm="auto"`` through the cost model and the tuned table, on emulated nodes.

The machines here are synthetic with costs chosen so the right answer follows from the bytes and
rounds each algorithm needs (worked out in the comments), not from the model's own output.
"""

from __future__ import annotations

import re

import torch

import collectives as C
from topology import Topology
from topology.cost import LinkCost, Machine

# Network 1000x slower than the node, one NIC per node, no latency: only bytes across nodes count.
BANDWIDTH_BOUND = Machine("bw", LinkCost(0.0, 1e-12), LinkCost(0.0, 1e-9), nics_per_node=1)
# Every message costs a millisecond, bytes are free: only rounds count.
LATENCY_BOUND = Machine("lat", LinkCost(1e-3, 0.0), LinkCost(1e-3, 0.0), nics_per_node=1)


def body_model(rank: int, world: int) -> list[tuple[str, str, str]]:
    comm = C.get_communicator()
    comm.set_topology(Topology.from_nodes([[0, 1], [2, 3]]))
    out = []
    try:
        for machine, n in [(BANDWIDTH_BOUND, 1 << 22), (LATENCY_BOUND, 256)]:
            comm.set_calibration(machine)
            x = torch.randn(n)
            ref = x.clone()
            C.all_reduce(x)
            ch = comm.last_choice
            assert ch is not None
            out.append((ch.algorithm, ch.rule, ch.reason))
            assert torch.isfinite(x).all() and not torch.equal(x, ref)
        comm.set_tuned({"meta": {"world": 4, "nodes": 2}, "entries": [
            {"op": "all_reduce", "dtype": "float32", "max_bytes": 1 << 10, "algorithm": "ring"},
            {"op": "all_reduce", "dtype": "float32", "max_bytes": 1 << 30, "algorithm": "halving_doubling"}]})
        for n in (16, 1 << 12):
            C.all_reduce(torch.randn(n))
            ch = comm.last_choice
            out.append((ch.algorithm, ch.rule, ch.reason))
    finally:
        comm.set_tuned(None)
        comm.set_calibration(None)
        comm.set_topology(None)
    return out


def test_auto_follows_the_model_then_the_tuned_table(worlds) -> None:  # noqa: ANN001
    for rows in worlds(4).run(body_model):
        (bw_algo, bw_rule, bw_reason), (lat_algo, lat_rule, _), small, large = rows
        # Bandwidth-bound on a shared uplink: a flat ring sends 1.5 n across each node's uplink, the
        # hierarchy n (test_topology_cost); recursive doubling and halving-doubling more still.
        assert bw_rule == "cost_model" and bw_algo.startswith("hierarchical"), bw_reason
        listed = dict(re.findall(r"(\w+) (\d+) us", bw_reason))
        assert {"native", "ring", "hierarchical", "recursive_doubling"} <= set(listed)
        assert int(listed[bw_algo]) == min(map(int, listed.values()))
        # Latency-bound at 4 ranks: recursive doubling takes log2(4) = 2 rounds; ring 6, the
        # hierarchies 3 phases of at least one round each.
        assert (lat_algo, lat_rule) == ("recursive_doubling", "cost_model")
        assert small[:2] == ("ring", "tuned_table") and large[:2] == ("halving_doubling", "tuned_table")
