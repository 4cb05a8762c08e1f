"""``discover(group)``: which ranks share a node, from facts every rank exchanges over the group.

Each rank contributes its host name and boot id (two containers on one host name differ in boot
id only if they are separate machines), its device, and its local rank. Ranks with equal
(host, boot id) share a node; nodes are numbered in order of their lowest rank. A JSON file
(``override=`` or ``COMMOPS_TOPOLOGY``) replaces discovery entirely.

Not yet here: the NVLink matrix through NVML, PCIe and NUMA affinity, and measured tier
bandwidths (the cost model's calibration fills those).
"""

from __future__ import annotations

import socket
from pathlib import Path

import torch
import torch.distributed as dist

from collectives import _env

from .model import RankPlace, Tier, Topology

__all__ = ["discover", "local_facts"]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def local_facts() -> dict[str, str]:
    """What this rank says about itself."""
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() and torch.cuda.device_count() else "cpu"
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "device": device}


def from_facts(facts: list[dict[str, str]]) -> Topology:
    """Group ranks by (host, boot id); local ranks in rank order within a node."""
    node_ids: dict[tuple[str, str], int] = {}
    counts: dict[int, int] = {}
    places = []
    for rank, f in enumerate(facts):
        node = node_ids.setdefault((f["host"], f["boot_id"]), len(node_ids))
        local = counts.get(node, 0)
        counts[node] = local + 1
        places.append(RankPlace(rank, node, local, f["host"], f["device"]))
    tiers = [Tier("node")]
    if len(node_ids) > 1:
        tiers.append(Tier("network"))
    return Topology(tuple(places), tuple(tiers))


def discover(group: dist.ProcessGroup | None = None, *, override: str | Path | None = None) -> Topology:
    """The topology of ``group`` (collective over the group unless a JSON override is given)."""
    path = override or _env.TOPOLOGY.get()
    if path:
        return Topology.load(path)
    facts: list[dict[str, str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(facts, local_facts(), group=group)
    return from_facts([f for f in facts if f is not None])
