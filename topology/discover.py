"""``discover(group)``: which ranks share a node and how their devices are linked.

Each rank contributes what it knows about itself: host name and boot id (ranks with equal
(host, boot id) share a node), its device, the launcher's node rank and local rank when the caller
passes them (torchrun's ``GROUP_RANK`` and ``LOCAL_RANK``: ``Communicator.topology`` reads them
with ``collectives.bootstrap.launcher_environment``), and, on NVIDIA GPUs, what NVML reports
(``topology/nvml.py``): its PCI bus id, NVLinks per peer GPU, P2P support, PCIe link and NUMA node.
The facts travel over the group with ``all_gather_object``; every rank builds the same
:class:`Topology` from them.

Nodes are numbered by the launcher's node rank when every rank has one, else in order of their
lowest rank; local ranks follow the launcher's local rank when given, else rank order. A JSON
file (``override=``; ``COMMOPS_TOPOLOGY`` through the communicator) replaces discovery entirely. A
CPU-only group gets one tier inside a node (shared memory / loopback) and a network tier if it
spans hosts. Launcher facts are arguments, not read here, so that this layer reads no launcher
variables and imports nothing of ``collectives``.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .model import RankPlace, Tier, Topology
from .nvml import gpu_facts

__all__ = ["discover", "local_facts", "from_facts"]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def local_facts(group_rank: int | None = None, local_rank: int | None = None) -> dict[str, Any]:
    """What this rank says about itself (``group_rank``/``local_rank``: the launcher's, if any)."""
    facts: dict[str, Any] = {"host": socket.gethostname(), "boot_id": _boot_id(), "device": "cpu"}
    if torch.cuda.is_available() and torch.cuda.device_count():
        index = torch.cuda.current_device()
        facts["device"] = f"cuda:{index}"
        props = torch.cuda.get_device_properties(index)
        uuid = str(getattr(props, "uuid", "") or "")
        gpu = gpu_facts(uuid=uuid or None)
        if gpu is not None:
            facts["gpu"] = gpu
    if group_rank is not None:
        facts["group_rank"] = group_rank
    if local_rank is not None:
        facts["local_rank"] = local_rank
    return facts


def from_facts(facts: list[dict[str, Any]]) -> Topology:
    """Group ranks into nodes and build the NVLink matrix of each node."""
    if all("group_rank" in f for f in facts):
        keys = [("launcher", f["group_rank"]) for f in facts]
    else:
        keys = [(f["host"], f["boot_id"]) for f in facts]
    order: dict[Any, int] = {}
    for k in (sorted(set(keys)) if keys and keys[0][0] == "launcher" else keys):
        order.setdefault(k, len(order))
    members: dict[int, list[int]] = {}
    for rank, k in enumerate(keys):
        members.setdefault(order[k], []).append(rank)
    local: dict[int, int] = {}
    for node, ranks in members.items():
        if all("local_rank" in facts[r] for r in ranks) and len({facts[r]["local_rank"] for r in ranks}) == len(ranks):
            by_local = sorted(ranks, key=lambda r: facts[r]["local_rank"])
        else:
            by_local = ranks
        for i, r in enumerate(by_local):
            local[r] = i
    places = tuple(RankPlace(r, order[keys[r]], local[r], facts[r]["host"], facts[r]["device"]) for r in range(len(facts)))
    nvlinks: dict[int, list[list[int]]] = {}
    for node, ranks in members.items():
        gpus = [facts[r].get("gpu") for r in sorted(ranks, key=lambda r: local[r])]
        if all(gpus) and any(g["nvlinks"] for g in gpus):  # type: ignore[index]
            buses = [g["bus_id"] for g in gpus]  # type: ignore[index]
            nvlinks[node] = [[0 if i == j else gi["nvlinks"].get(buses[j], 0) for j in range(len(gpus))]  # type: ignore[index]
                             for i, gi in enumerate(gpus)]
    tiers = [Tier("nvlink")] if nvlinks else []
    tiers.append(Tier("node"))
    if len(members) > 1:
        tiers.append(Tier("network"))
    extra = {r: facts[r]["gpu"] for r in range(len(facts)) if facts[r].get("gpu")}
    return Topology(places, tuple(tiers), nvlinks, extra)


def discover(group: dist.ProcessGroup | None = None, *, override: str | Path | None = None,
             group_rank: int | None = None, local_rank: int | None = None) -> Topology:
    """The topology of ``group``.

    Args:
        group: the process group (``None``: the default group).
        override: a topology JSON file that replaces discovery (nothing is exchanged).
        group_rank: this rank's node rank as the launcher numbers nodes (torchrun's ``GROUP_RANK``), if known.
        local_rank: this rank's index in its node as the launcher gives it (``LOCAL_RANK``), if known.

    Collective over ``group`` unless ``override`` is given: every rank must call it, each with
    its own launcher facts.
    """
    if override:
        return Topology.load(override)
    facts: list[dict[str, Any] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(facts, local_facts(group_rank, local_rank), group=group)
    return from_facts([f for f in facts if f is not None])
