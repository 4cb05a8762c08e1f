"""Binomial-tree broadcast and reduce (MPICH's default for short messages).

Ranks are numbered relative to the root, ``vr = (r - root) mod p``. Broadcast: at the step with
``mask = 2^k`` every rank with ``vr < mask`` that already has the data sends it to ``vr + mask``.
Reduce runs the same tree upwards: at ``mask = 2^k`` a rank with bit ``k`` set sends its partial
result to ``vr - mask`` and is done; the receiver reduces it into its own.

Time: ``ceil(log2 p) (a + n b)`` (+ ``n g`` per step for reduce): latency-optimal, but the root's
link carries the whole message ``log2 p`` times, so large messages want a scatter + all-gather.

Non-root ranks of a reduce accumulate in scratch: their tensors are left as they were.
"""

from __future__ import annotations

from topology.cost import CostPlan, Links, Machine, flat_plan

from ._base import ScheduledAlgorithm
from ._schedule import Copy, Layout, Recv, Region, Schedule, Send, Step

__all__ = ["BinomialTree"]


class BinomialTree(ScheduledAlgorithm):
    name = "binomial_tree"
    ops = frozenset({"broadcast", "reduce"})
    summary = "ceil(log2 p) steps rooted tree"

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """The tree's ``ceil(log2 p)`` rounds rooted at rank 0, one executor step each."""
        return flat_plan("binomial_tree", op, nodes, Links.EXECUTOR) if op in self.ops else None

    def build(self, layout: Layout) -> Schedule:
        p, r, n, root = layout.world, layout.rank, layout.count, layout.root
        assert root is not None
        vr = (r - root) % p

        def real(v: int) -> int:
            return (v + root) % p

        steps: list[Step] = []
        if n == 0 or p == 1:
            return Schedule(layout, ())
        if layout.op == "broadcast":
            data = (Region("out", 0, n),)
            mask = 1
            while mask < p:
                if vr < mask and vr + mask < p:
                    steps.append(Step(sends=(Send(real(vr + mask), data),)))
                elif mask <= vr < 2 * mask:
                    steps.append(Step(recvs=(Recv(real(vr - mask), data),)))
                mask *= 2
            return Schedule(layout, tuple(steps))
        if layout.op == "reduce":
            buf = "out" if vr == 0 else "tmp"
            acc = (Region(buf, 0, n),)
            mask = 1
            while mask < p:
                if vr & mask:
                    steps.append(Step(sends=(Send(real(vr - mask), acc),)))
                    break
                if vr + mask < p:
                    steps.append(Step(recvs=(Recv(real(vr + mask), acc, reduce=True),)))
                mask *= 2
            if vr != 0:
                first = Copy(Region("in", 0, n), Region("tmp", 0, n))
                steps[0] = Step(copies=(first,), sends=steps[0].sends, recvs=steps[0].recvs)
                return Schedule(layout, tuple(steps), scratch=n)
            return Schedule(layout, tuple(steps))
        raise ValueError(layout.op)
