"""``Topology``: who sits on which node, and the tiers of links between them, as plain data.

A topology lists every rank with its node, local rank, host and device, and the link tiers from
fastest to slowest (for example ``nvlink`` inside an NVLink domain, ``node`` for shared memory or
loopback inside a host, ``network`` between hosts), each with a bandwidth and latency when known.
It dumps to and loads from JSON, so a file can stand in for discovery (tests, emulated clusters,
machines where discovery is wrong).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Tier", "RankPlace", "Topology"]


@dataclass(frozen=True)
class Tier:
    """One kind of link. Bandwidth per rank and direction in GB/s, latency in microseconds."""

    name: str
    bandwidth_GBps: float | None = None
    latency_us: float | None = None


@dataclass(frozen=True)
class RankPlace:
    rank: int
    node: int
    local_rank: int
    host: str
    device: str = "cpu"


@dataclass(frozen=True)
class Topology:
    """Ranks, their nodes, and the link tiers (fastest first).

    ``nvlinks[node][i][j]`` (optional) is the number of NVLinks between local ranks ``i`` and
    ``j`` of ``node``; ranks of one node joined by at least one NVLink talk over tier ``nvlink``.
    """

    ranks: tuple[RankPlace, ...]
    tiers: tuple[Tier, ...] = (Tier("node"), Tier("network"))
    nvlinks: dict[int, list[list[int]]] = field(default_factory=dict)
    # rank -> what NVML reported about its GPU (bus id, NVLinks per peer, P2P, PCIe, NUMA)
    gpus: dict[int, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if [p.rank for p in self.ranks] != list(range(len(self.ranks))):
            raise ValueError(f"ranks must be listed as 0..{len(self.ranks) - 1} in order, got {[p.rank for p in self.ranks]}")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names repeat: {names}")

    @property
    def world(self) -> int:
        return len(self.ranks)

    def nodes(self) -> list[list[int]]:
        """Ranks of each node, nodes in order of their index, ranks ascending."""
        out: dict[int, list[int]] = {}
        for p in self.ranks:
            out.setdefault(p.node, []).append(p.rank)
        return [out[k] for k in sorted(out)]

    def node_of(self, rank: int) -> int:
        return self.ranks[rank].node

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier {name!r}; tiers are {[t.name for t in self.tiers]}")

    def tier_between(self, a: int, b: int) -> Tier | None:
        """The tier a message from rank ``a`` to rank ``b`` crosses (None for a rank to itself)."""
        if a == b:
            return None
        pa, pb = self.ranks[a], self.ranks[b]
        if pa.node != pb.node:
            return self.tier("network")
        links = self.nvlinks.get(pa.node)
        if links and links[pa.local_rank][pb.local_rank] > 0 and any(t.name == "nvlink" for t in self.tiers):
            return self.tier("nvlink")
        return self.tier("node")

    @classmethod
    def from_nodes(cls, nodes: list[list[int]], tiers: tuple[Tier, ...] | None = None) -> Topology:
        """A topology with the given rank sets as nodes (host names ``node<k>``), e.g. ``[[0, 2], [1, 3]]``."""
        where = {r: (k, i) for k, members in enumerate(nodes) for i, r in enumerate(sorted(members))}
        listed = sorted(r for members in nodes for r in members)
        if listed != list(range(len(listed))):
            raise ValueError(f"nodes must hold each rank 0..{len(where) - 1} exactly once, got {nodes}")
        places = tuple(RankPlace(r, where[r][0], where[r][1], f"node{where[r][0]}") for r in range(len(where)))
        default = (Tier("node"), Tier("network")) if len(nodes) > 1 else (Tier("node"),)
        return cls(places, tiers or default)

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": [asdict(p) for p in self.ranks], "tiers": [asdict(t) for t in self.tiers],
                "nvlinks": {str(k): v for k, v in self.nvlinks.items()},
                "gpus": {str(k): v for k, v in self.gpus.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Topology:
        return cls(tuple(RankPlace(**p) for p in data["ranks"]), tuple(Tier(**t) for t in data["tiers"]),
                   {int(k): v for k, v in data.get("nvlinks", {}).items()},
                   {int(k): v for k, v in data.get("gpus", {}).items()})

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Topology:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def describe(self) -> str:
        """A readable listing: one block per node with its ranks, devices and links."""
        lines = [f"{self.world} ranks on {len(self.nodes())} node(s); tiers: "
                 + ", ".join(f"{t.name}" + (f" {t.bandwidth_GBps} GB/s" if t.bandwidth_GBps else "")
                             + (f" {t.latency_us} us" if t.latency_us else "") for t in self.tiers)]
        for members in self.nodes():
            first = self.ranks[members[0]]
            lines.append(f"node {first.node} ({first.host}): ranks {members}")
            for r in members:
                gpu = self.gpus.get(r, {})
                about = "  ".join(str(x) for x in (gpu.get("name"), gpu.get("bus_id"), gpu.get("pcie"),
                                                   f"NUMA {gpu['numa']}" if "numa" in gpu else None) if x)
                lines.append(f"  rank {r:>4}  local {self.ranks[r].local_rank:>3}  {self.ranks[r].device}  {about}".rstrip())
            links = self.nvlinks.get(first.node)
            if links:
                head = "        " + "".join(f"L{j:<5}" for j in range(len(links)))
                lines.append(head)
                for i, row in enumerate(links):
                    lines.append(f"  L{i:<4} " + "".join(f"{'X' if i == j else ('NV' + str(n) if n else '-'):<6}" for j, n in enumerate(row)))
        return "\n".join(lines)
