"""Pairwise-exchange all-to-all, for any splits (MPICH's long-message all-to-all).

At step ``s = 1 .. p-1`` rank ``r`` sends its block for ``r + s`` and receives the block from
``r - s``; its own block is a local copy. ``p - 1`` steps, each rank sends exactly its data once:
bandwidth-optimal, and uneven or zero-length splits cost nothing extra (empty blocks are not sent).

Time: ``(p-1) a + n b`` where ``n`` is the bytes a rank sends.
"""

from __future__ import annotations

from itertools import accumulate

from topology.cost import CostPlan, Links, Machine, flat_plan

from ._base import ScheduledAlgorithm
from ._schedule import Copy, Layout, Recv, Region, Schedule, Send, Step

__all__ = ["Pairwise"]


class Pairwise(ScheduledAlgorithm):
    name = "pairwise"
    ops = frozenset({"all_to_all"})
    summary = "p-1 shifted exchanges; any splits"

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """Its ``p - 1`` shifted exchanges of ``n/p`` bytes, one executor step each."""
        return flat_plan("pairwise", op, nodes, Links.EXECUTOR) if op in self.ops else None

    def build(self, layout: Layout) -> Schedule:
        p, r = layout.world, layout.rank
        ins, outs = layout.in_splits, layout.out_splits
        assert ins is not None and outs is not None
        in_at = [0, *accumulate(ins)]
        out_at = [0, *accumulate(outs)]
        steps = []
        copies: tuple[Copy, ...] = ()
        if ins[r]:
            copies = (Copy(Region("in", in_at[r], ins[r]), Region("out", out_at[r], outs[r])),)
        steps.append(Step(copies=copies))
        for s in range(1, p):
            dst, src = (r + s) % p, (r - s) % p
            sends = (Send(dst, (Region("in", in_at[dst], ins[dst]),)),) if ins[dst] else ()
            recvs = (Recv(src, (Region("out", out_at[src], outs[src]),)),) if outs[src] else ()
            steps.append(Step(sends=sends, recvs=recvs))
        return Schedule(layout, tuple(steps))
