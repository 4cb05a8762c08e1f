"""Sub-groups derived from a topology: intra-node, inter-node rails, node leaders.

For a group whose topology has nodes ``N_0 .. N_{n-1}`` (group ranks, ascending):

* ``intra``: the ranks of my node;
* ``rail``: when every node has ``g`` ranks, the ranks with my local index on every node (the
  ranks that share a NIC rail on rail-optimised clusters; the columns of an ``n x g`` grid);
* ``leaders``: the first rank of every node (members only; ``None`` on other ranks).

Groups are created once per (backend, rank set) and cached for the life of the process, so two
communicators over the same ranks share them. Creation uses ``new_group(...,
use_local_synchronization=True)``: only members take part, each rank creates its groups in one
fixed order (intra, rail, leaders), which cannot deadlock because every group's members all reach
its creation after creating the same earlier groups. torch names such a group after its ranks and
the number of groups the process has made, so before creating any, the communicator's ranks line
that number up (:func:`_align_group_counts`); a program whose ranks made different numbers of
groups would otherwise hang there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .model import Topology

__all__ = ["DerivedGroups", "derive", "equal_nodes", "rails_of", "clear"]

# (backend, global ranks) -> process group, shared by every communicator of this process.
_CACHE: dict[tuple[str, tuple[int, ...]], Any] = {}


def clear() -> None:
    """Forget the cached groups (after ``destroy_process_group``; the groups die with it)."""
    _CACHE.clear()


def equal_nodes(topo: Topology) -> int | None:
    """Ranks per node when every node has the same number, else None."""
    sizes = {len(n) for n in topo.nodes()}
    return sizes.pop() if len(sizes) == 1 else None


@dataclass(frozen=True)
class DerivedGroups:
    """This rank's derived groups and where it sits in them (indices are group ranks)."""

    nodes: list[list[int]]
    node: int          # index of my node
    local: int         # my index inside my node
    intra: Any
    rail: Any | None   # None when nodes differ in size
    leaders: Any | None  # None unless I am my node's first rank
    intra_ranks: tuple[int, ...]
    rail_ranks: tuple[int, ...] | None
    # rails[j]: the group ranks of rail j in the rail group's own order (ascending), for every j.
    rails: list[tuple[int, ...]] | None


def _group(backend: str, global_ranks: tuple[int, ...], world_group: Any) -> Any:
    if global_ranks == tuple(range(dist.get_world_size())) and world_group is not None:
        return world_group
    key = (backend, global_ranks)
    g = _CACHE.get(key)
    if g is None:
        g = _CACHE[key] = dist.new_group(list(global_ranks), backend=backend, use_local_synchronization=True)
    return g


def _align_group_counts(group: Any, backend: str) -> None:
    """Give every member of ``group`` as many process groups as the one with the most.

    torch names a group made with ``use_local_synchronization=True`` after its ranks and the
    number of groups the calling process has made so far (``_hash_ranks_to_str`` in
    ``torch.distributed.distributed_c10d``). Members that have made different numbers (a subgroup
    that left some of them out, made by the program or by commops) would name the same new group
    differently and wait for each other forever. So the members compare their counts (one small
    all-gather over ``group``, which exists) and each one behind makes single-rank groups until it
    has caught up; those cost nothing to the others."""
    world = getattr(dist.distributed_c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    if names is None:  # a torch that names groups some other way: nothing to align
        return
    counts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, len(names), group=group)
    me = dist.get_rank()
    for _ in range(max(counts) - len(names)):
        dist.new_group([me], backend=backend, use_local_synchronization=True)


def derive(topo: Topology, rank: int, global_ranks: tuple[int, ...], backend: str,
           group: Any = None) -> DerivedGroups:
    """Create (or fetch) this rank's derived groups. Collective over each derived group's members.

    Args:
        topo: the communicator's topology (same on every rank).
        rank: this rank's index in the communicator's group.
        global_ranks: the communicator's group ranks -> global ranks.
        backend: the backend string of the communicator's group.
        group: the communicator's process group (default: the world), over which the members
            first line up their group counts (:func:`_align_group_counts`).
    """
    if topo.world != len(global_ranks):
        raise ValueError(f"topology has {topo.world} ranks but the group has {len(global_ranks)}")
    nodes = topo.nodes()
    node = next(k for k, members in enumerate(nodes) if rank in members)
    local = nodes[node].index(rank)
    world_pg = dist.group.WORLD
    _align_group_counts(world_pg if group is None else group, backend)

    def pg(members: tuple[int, ...]) -> Any:
        return _group(backend, tuple(global_ranks[m] for m in members), world_pg)

    intra_ranks = tuple(nodes[node])
    intra = pg(intra_ranks)
    rail = rail_ranks = rails = None
    if equal_nodes(topo) is not None:
        rails = rails_of(nodes)
        rail_ranks = rails[local]
        rail = pg(rail_ranks)
    leaders = pg(tuple(members[0] for members in nodes)) if local == 0 else None
    return DerivedGroups(nodes, node, local, intra, rail, leaders, intra_ranks, rail_ranks, rails)


def rails_of(nodes: list[list[int]]) -> list[tuple[int, ...]]:
    """Rail ``j``: the ``j``-th rank of every node, ascending (the order its process group uses)."""
    return [tuple(sorted(members[j] for members in nodes)) for j in range(len(nodes[0]))]
