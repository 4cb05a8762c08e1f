"""Ring all-reduce, reduce-scatter and all-gather (Patarasuk & Yuan 2009; NCCL's ring).

The data is cut into ``p`` chunks. Reduce-scatter passes partial sums around the ring for
``p - 1`` steps so that rank ``r`` ends with chunk ``r`` fully reduced; all-gather passes the
finished chunks around for another ``p - 1`` steps. Each rank sends ``(p-1)/p`` of the data per
phase, which is bandwidth-optimal; the ``p - 1`` latencies per phase make it slow for small data.

Time (alpha-beta-gamma, n bytes): all-reduce ``2(p-1)a + 2(p-1)/p n b + (p-1)/p n g``.

Chunk indices at step ``s`` (rank ``r``, neighbours ``r-1 -> r -> r+1``)::

    reduce-scatter: send chunk r-s-1, receive and reduce chunk r-s-2  (rank r ends with chunk r)
    all-gather:     send chunk r-s,   receive chunk r-s-1
"""

from __future__ import annotations

from topology.cost import CostPlan, Links, Machine, flat_plan

from ._base import ScheduledAlgorithm
from ._schedule import Copy, Layout, Recv, Region, Schedule, Send, Step, balanced_chunks, with_copies

__all__ = ["Ring"]


def reduce_scatter_steps(buf: str, chunks: list[tuple[int, int]], rank: int, world: int) -> list[Step]:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    steps = []
    for s in range(world - 1):
        out = chunks[(rank - s - 1) % world]
        inc = chunks[(rank - s - 2) % world]
        steps.append(Step(
            sends=(Send(nxt, (Region(buf, *out),)),) if out[1] else (),
            recvs=(Recv(prv, (Region(buf, *inc),), reduce=True),) if inc[1] else (),
        ))
    return steps


def all_gather_steps(buf: str, chunks: list[tuple[int, int]], rank: int, world: int) -> list[Step]:
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    steps = []
    for s in range(world - 1):
        out = chunks[(rank - s) % world]
        inc = chunks[(rank - s - 1) % world]
        steps.append(Step(
            sends=(Send(nxt, (Region(buf, *out),)),) if out[1] else (),
            recvs=(Recv(prv, (Region(buf, *inc),)),) if inc[1] else (),
        ))
    return steps


class Ring(ScheduledAlgorithm):
    name = "ring"
    ops = frozenset({"all_reduce", "reduce_scatter", "all_gather"})
    summary = "bandwidth-optimal ring; 2(p-1) steps for all-reduce"

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """The ring pattern of ``topology.cost.flat_rounds``: ``p - 1`` rounds per phase, one executor step each."""
        return flat_plan("ring", op, nodes, Links.EXECUTOR) if op in self.ops else None

    def build(self, layout: Layout) -> Schedule:
        p, r, n = layout.world, layout.rank, layout.count
        if layout.op == "all_reduce":
            chunks = balanced_chunks(n, p)
            steps = reduce_scatter_steps("out", chunks, r, p) + all_gather_steps("out", chunks, r, p)
            return Schedule(layout, tuple(steps))
        if layout.op == "reduce_scatter":
            # Work on a copy so that the caller's input is left as it was.
            chunks = [(i * n, n) for i in range(p)]
            steps = reduce_scatter_steps("tmp", chunks, r, p)
            first = Copy(Region("in", 0, p * n), Region("tmp", 0, p * n))
            last = Copy(Region("tmp", r * n, n), Region("out", 0, n))
            steps = with_copies(steps, first, last)
            return Schedule(layout, tuple(steps), scratch=p * n)
        if layout.op == "all_gather":
            chunks = [(i * n, n) for i in range(p)]
            steps = all_gather_steps("out", chunks, r, p)
            first = Copy(Region("in", 0, n), Region("out", r * n, n))
            return Schedule(layout, tuple(with_copies(steps, first, None)))
        raise ValueError(layout.op)

