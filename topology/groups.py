"""Sub-groups derived from a topology: intra-node, inter-node rails, node leaders.

For a group whose topology has nodes ``N_0 .. N_{n-1}`` (group ranks, ascending):

* ``intra``: the ranks of my node;
* ``rail``: when every node has ``g`` ranks, the ranks with my local index on every node (the
  ranks that share a NIC rail on rail-optimised clusters; the columns of an ``n x g`` grid);
* ``leaders``: the first rank of every node (members only; ``None`` on other ranks).

Groups are created once per parent group and kept for the life of the process: a communicator
owns its derived groups, never shares them with another communicator over the same ranks, so two
threads running on two communicators never meet on one process group (their calls would pair in
a different order on each rank). Each group is named after its parent group's name, its role and
its ranks (``commops/<parent>/<role>/<ranks>``), the same on every member whatever else the
process created before or creates meanwhile on another thread; only the members take part in its
creation (the backend's own rendezvous through the store, under the parent's timeout). torch's
``new_group`` names a group after its ranks and how many groups the process has made, so that
two threads making groups at once, or ranks that made different numbers of groups, would pair
the wrong groups or wait forever; it serves only where torch lacks the helper used here
(:func:`_named_group`), and there creation takes a lock and first lines up the group counts.
Their waits use the parent's timeout, which the caller passes.
"""

from __future__ import annotations

import datetime
import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .model import Topology

__all__ = ["DerivedGroups", "derive", "equal_nodes", "rails_of", "clear", "forget", "private_group"]

# (parent group name, role, backend, global ranks) -> process group, created once.
_CACHE: dict[tuple[str, str, str, tuple[int, ...]], Any] = {}
_LOCK = threading.Lock()  # guards _CACHE and _KEY_LOCKS; never held while a group is created
_KEY_LOCKS: dict[tuple[str, str, str, tuple[int, ...]], threading.Lock] = {}
_LEGACY_LOCK = threading.Lock()  # new_group's fallback: one creation at a time in this process


def clear() -> None:
    """Forget the cached groups (after ``destroy_process_group``; the groups die with it)."""
    with _LOCK:
        _CACHE.clear()
        _KEY_LOCKS.clear()


def forget(parent: str) -> list[Any]:
    """Forget the groups derived from the group named ``parent``; return them (for destroying)."""
    with _LOCK:
        keys = [k for k in _CACHE if k[0] == parent]
        for k in keys:
            _KEY_LOCKS.pop(k, None)
        return [_CACHE.pop(k) for k in keys]


def equal_nodes(topo: Topology) -> int | None:
    """Ranks per node when every node has the same number, else None."""
    sizes = {len(n) for n in topo.nodes()}
    return sizes.pop() if len(sizes) == 1 else None


def private_group(parent: Any, parent_name: str, role: str, global_ranks: tuple[int, ...], backend: str,
                  timeout: datetime.timedelta | None = None) -> Any:
    """The process group over ``global_ranks`` that the group named ``parent_name`` keeps for
    ``role``, created on first use (collective over those ranks only; thread-safe); its waits
    are bounded by ``timeout`` (the parent's, from the caller; None: torch's default)."""
    key = (parent_name, role, backend, tuple(global_ranks))
    with _LOCK:
        g = _CACHE.get(key)
        if g is not None:
            return g
        lock = _KEY_LOCKS.setdefault(key, threading.Lock())
    with lock:  # a second thread asking for the same group waits for the first one's
        with _LOCK:
            g = _CACHE.get(key)
        if g is None:
            name = f"commops/{parent_name}/{role}/{'_'.join(map(str, sorted(global_ranks)))}"
            g = _named_group(sorted(global_ranks), backend, name, timeout, parent)
            with _LOCK:
                _CACHE[key] = g
    return g


def _helper() -> Any:
    """torch's ``_new_process_group_helper`` when it has the signature used here (2.11-2.13), else None."""
    c10d = dist.distributed_c10d
    helper = getattr(c10d, "_new_process_group_helper", None)
    if helper is None:
        return None
    try:
        params = list(inspect.signature(helper).parameters)
    except (TypeError, ValueError):
        return None
    want = ["group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name"]
    ok = params[:6] == want and "timeout" in params and hasattr(c10d, "_world") and hasattr(c10d, "_get_default_store")
    return helper if ok else None


def _named_group(ranks: list[int], backend: str, name: str, timeout: datetime.timedelta | None, parent: Any) -> Any:
    c10d = dist.distributed_c10d
    helper = _helper()
    if timeout is None:  # a backend without options (MPI): torch's default for it
        timeout = getattr(c10d, "_get_default_timeout", lambda b: None)(backend)
    if helper is None or "mpi" in backend:  # MPI creates every group over the whole world
        with _LEGACY_LOCK:
            _align_group_counts(parent, backend)
            return dist.new_group(ranks, timeout=timeout, backend=backend, use_local_synchronization=True)
    me = dist.get_rank()
    group_name = getattr(c10d, "GroupName", str)(name)
    kwargs: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
    bound = getattr(c10d._get_default_group(), "bound_device_id", None)
    if bound is not None and "nccl" in backend:  # as new_group does: NCCL communicators split eagerly from the world's
        kwargs["device_id"] = bound
    pg, _ = helper(len(ranks), ranks.index(me), ranks, backend, c10d._get_default_store(), group_name, **kwargs)
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg


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
           group: Any = None, timeout: datetime.timedelta | None = None) -> DerivedGroups:
    """Create (or fetch) this rank's derived groups. Collective over each derived group's members.

    Args:
        topo: the communicator's topology (same on every rank).
        rank: this rank's index in the communicator's group.
        global_ranks: the communicator's group ranks -> global ranks.
        backend: the backend string of the communicator's group.
        group: the communicator's process group (default: the world): the derived groups are
            its own (named after it), used by no other communicator.
        timeout: the bound of the derived groups' waits (the communicator group's timeout).
    """
    if topo.world != len(global_ranks):
        raise ValueError(f"topology has {topo.world} ranks but the group has {len(global_ranks)}")
    nodes = topo.nodes()
    node = next(k for k, members in enumerate(nodes) if rank in members)
    local = nodes[node].index(rank)
    parent = dist.group.WORLD if group is None else group
    parent_name = str(getattr(parent, "group_name", "") or "world")

    def pg(role: str, members: tuple[int, ...]) -> Any:
        return private_group(parent, parent_name, role, tuple(global_ranks[m] for m in members), backend, timeout)

    intra_ranks = tuple(nodes[node])
    intra = pg("intra", intra_ranks)
    rail = rail_ranks = rails = None
    if equal_nodes(topo) is not None:
        rails = rails_of(nodes)
        rail_ranks = rails[local]
        rail = pg("rail", rail_ranks)
    leaders = pg("leaders", tuple(members[0] for members in nodes)) if local == 0 else None
    return DerivedGroups(nodes, node, local, intra, rail, leaders, intra_ranks, rail_ranks, rails)


def rails_of(nodes: list[list[int]]) -> list[tuple[int, ...]]:
    """Rail ``j``: the ``j``-th rank of every node, ascending (the order its process group uses)."""
    return [tuple(sorted(members[j] for members in nodes)) for j in range(len(nodes[0]))]
