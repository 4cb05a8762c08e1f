"""Bruck's all-to-all for equal splits (Bruck et al. 1997; Thakur et al. 2005, sec. 3.5).

Three phases on ``p`` blocks of ``c`` elements (rank ``r``)::

    rotate:   tmp[i] = in[(r + i) mod p]            block i is bound for rank r + i
    for d in 1, 2, 4, ... < p:                      ceil(log2 p) exchange steps
              send tmp[i] for every i with (i & d) to r + d, receive the same slots from r - d
    unrotate: out[j] = tmp[(r - j) mod p]           slot i now holds the block from rank r - i

``ceil(log2 p)`` latencies instead of ``p - 1``, at the price of sending about ``n/2 log2 p`` bytes
per rank, so it wins for small blocks and loses to pairwise exchange for large ones.
Only equal splits: uneven ones need pairwise.
"""

from __future__ import annotations

from topology.cost import CostPlan, Links, Machine, flat_plan

from ._base import ScheduledAlgorithm
from ._schedule import Copy, Layout, Recv, Region, Schedule, Send, Step

__all__ = ["Bruck"]


class Bruck(ScheduledAlgorithm):
    name = "bruck"
    ops = frozenset({"all_to_all"})
    equal_splits_only = True
    summary = "ceil(log2 p) steps; equal splits only"

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """Its ``ceil(log2 p)`` rounds of the blocks whose index has bit ``k`` set, one executor step each."""
        return flat_plan("bruck", op, nodes, Links.EXECUTOR) if op in self.ops else None

    def build(self, layout: Layout) -> Schedule:
        p, r = layout.world, layout.rank
        ins = layout.in_splits
        assert ins is not None and len(set(ins)) <= 1
        c = ins[0]
        if c == 0:
            return Schedule(layout, ())
        total = p * c
        # The rotation is two contiguous copies.
        rotate = tuple(x for x in (
            Copy(Region("in", r * c, (p - r) * c), Region("tmp", 0, (p - r) * c)),
            Copy(Region("in", 0, r * c), Region("tmp", (p - r) * c, r * c)),
        ) if x.src.count)
        steps = [Step(copies=rotate)]
        d = 1
        while d < p:
            slots = tuple(Region("tmp", i * c, c) for i in range(p) if i & d)
            steps.append(Step(
                sends=(Send((r + d) % p, slots),),
                recvs=(Recv((r - d) % p, slots, staged=True),),
            ))
            d *= 2
        unrotate = tuple(Copy(Region("tmp", ((r - j) % p) * c, c), Region("out", j * c, c)) for j in range(p))
        steps.append(Step(copies=unrotate))
        return Schedule(layout, tuple(steps), scratch=total)
