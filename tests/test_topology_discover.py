"""Topology as data (JSON round trip, tiers between ranks) and discovery over a real group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from topology import RankPlace, Tier, Topology, discover
from topology.discover import from_facts

ROOT = Path(__file__).resolve().parent.parent


def _two_nodes() -> Topology:
    facts = [{"host": h, "boot_id": b, "device": f"cuda:{i % 2}"}
             for i, (h, b) in enumerate([("a", "1"), ("a", "1"), ("b", "2"), ("b", "2"), ("a", "9")])]
    return from_facts(facts)


def test_ranks_group_by_host_and_boot_id() -> None:
    t = _two_nodes()
    assert t.nodes() == [[0, 1], [2, 3], [4]]  # same host name, other boot id: another machine
    assert [p.local_rank for p in t.ranks] == [0, 1, 0, 1, 0]
    assert [x.name for x in t.tiers] == ["node", "network"]
    assert t.tier_between(0, 1).name == "node" and t.tier_between(1, 2).name == "network"
    assert t.tier_between(3, 3) is None


def test_nvlink_tier_and_json_round_trip(tmp_path: Path) -> None:
    t = Topology((RankPlace(0, 0, 0, "h"), RankPlace(1, 0, 1, "h"), RankPlace(2, 0, 2, "h")),
                 (Tier("nvlink", 450.0, 2.0), Tier("node", 20.0, 5.0), Tier("network", 12.5, 10.0)),
                 {0: [[0, 18, 0], [18, 0, 0], [0, 0, 0]]})
    assert t.tier_between(0, 1).name == "nvlink" and t.tier_between(0, 2).name == "node"
    t.dump(tmp_path / "t.json")
    assert Topology.load(tmp_path / "t.json") == t
    assert "NV18" in t.describe()
    assert discover(override=tmp_path / "t.json") == t


def test_bad_topologies_are_refused() -> None:
    with pytest.raises(ValueError, match="in order"):
        Topology((RankPlace(1, 0, 0, "h"),))
    with pytest.raises(ValueError, match="repeat"):
        Topology((RankPlace(0, 0, 0, "h"),), (Tier("node"), Tier("node")))


def body_discover(rank: int, world: int) -> tuple:
    t = discover()
    return t.nodes(), t.ranks[rank].local_rank, [x.name for x in t.tiers]


def test_discover_on_one_machine(worlds) -> None:  # noqa: ANN001
    for nodes, local, tiers in worlds(3).run(body_discover):
        assert nodes == [[0, 1, 2]] and tiers == ["node"]
    assert [r[1] for r in worlds(3).run(body_discover)] == [0, 1, 2]


def test_python_m_topology_under_torchrun() -> None:
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "topology"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 ranks on 1 node(s)" in res.stdout and "rank    1  local   1  cpu" in res.stdout


def test_launcher_node_and_local_ranks_win_over_host_names() -> None:
    # torchrun's GROUP_RANK splits one host into two nodes (e.g. emulated nodes); LOCAL_RANK orders ranks.
    facts = [{"host": "h", "boot_id": "1", "device": "cpu", "group_rank": gr, "local_rank": lr}
             for gr, lr in [(0, 1), (0, 0), (1, 0), (1, 1)]]
    t = from_facts(facts)
    assert t.nodes() == [[0, 1], [2, 3]]
    assert [p.local_rank for p in t.ranks] == [1, 0, 0, 1]


def test_nvlink_matrix_from_each_rank_s_nvml_facts() -> None:
    # Two GPUs joined by 18 NVLinks (2xH200), a third on the node with none: what NVML reports per rank.
    bus = ["0000:19:00.0", "0000:3b:00.0", "0000:4c:00.0"]
    gpus = [{"bus_id": bus[0], "nvlinks": {bus[1]: 18}, "name": "H200", "numa": 0},
            {"bus_id": bus[1], "nvlinks": {bus[0]: 18}, "name": "H200", "numa": 0},
            {"bus_id": bus[2], "nvlinks": {}, "name": "H200", "numa": 1}]
    facts = [{"host": "g", "boot_id": "1", "device": f"cuda:{i}", "gpu": gpus[i]} for i in range(3)]
    t = from_facts(facts)
    assert t.nvlinks == {0: [[0, 18, 0], [18, 0, 0], [0, 0, 0]]}
    assert [x.name for x in t.tiers] == ["nvlink", "node"]
    assert t.tier_between(0, 1).name == "nvlink" and t.tier_between(1, 2).name == "node"
    text = t.describe()
    assert "NV18" in text and "NUMA 1" in text
    assert Topology.from_dict(t.to_dict()) == t


def test_normalized_bus_ids_match_across_nvml_formats() -> None:
    from topology.nvml import normalize_bus_id

    assert normalize_bus_id("00000000:19:00.0") == normalize_bus_id(b"0000:19:00.0") == "0000:19:00.0"


def test_from_nodes_builds_emulated_nodes() -> None:
    t = Topology.from_nodes([[0, 2], [1, 3]])
    assert t.nodes() == [[0, 2], [1, 3]] and [p.local_rank for p in t.ranks] == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="exactly once"):
        Topology.from_nodes([[0, 1], [1, 2]])
