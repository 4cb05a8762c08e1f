"""Recursive-doubling all-reduce and all-gather (Thakur, Rabenseifner & Gropp 2005, sec. 4).

At step ``k`` rank ``v`` exchanges with ``v xor 2^k``: for all-reduce both send everything they
hold and reduce what they get; for all-gather both send the block of ``2^k`` chunks gathered so
far. ``log2 p`` steps: latency-optimal, so it suits small messages; all-reduce sends ``n log2 p``
bytes per rank, so it loses to the ring and to halving-doubling on large ones.

Time: all-reduce ``log2(p) (a + n b + n g)``; all-gather ``log2(p) a + (p-1)/p n b``.
Non-power-of-two ``p`` is folded onto ``p2`` ranks (see ``_fold``): two extra steps.

Because IEEE addition is commutative, both partners of a step compute bitwise the same sum, so
every rank ends with identical bits.
"""

from __future__ import annotations

from topology.cost import CostPlan, Links, Machine, flat_plan

from ._base import ScheduledAlgorithm
from ._fold import Fold
from ._schedule import Copy, Layout, Recv, Region, Schedule, Send, Step, with_copies

__all__ = ["RecursiveDoubling"]


class RecursiveDoubling(ScheduledAlgorithm):
    name = "recursive_doubling"
    ops = frozenset({"all_reduce", "all_gather"})
    summary = "log2(p) exchange steps; latency-optimal for small messages"

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """Its ``log2 p`` exchanges (two more where ``p`` is folded), one executor step each."""
        return flat_plan("recursive_doubling", op, nodes, Links.EXECUTOR) if op in self.ops else None

    def build(self, layout: Layout) -> Schedule:
        if layout.op == "all_reduce":
            return self._all_reduce(layout)
        if layout.op == "all_gather":
            return self._all_gather(layout)
        raise ValueError(layout.op)

    def _all_reduce(self, layout: Layout) -> Schedule:
        p, r, n = layout.world, layout.rank, layout.count
        if n == 0 or p == 1:
            return Schedule(layout, ())
        f = Fold(p)
        everything = (Region("out", 0, n),)
        if f.sits_out(r):
            return Schedule(layout, (
                Step(sends=(Send(r + 1, everything),)),
                Step(recvs=(Recv(r + 1, everything),)),
            ))
        steps = []
        if f.is_host(r):
            steps.append(Step(recvs=(Recv(r - 1, everything, reduce=True),)))
        v = f.virtual(r)
        d = 1
        while d < f.p2:
            peer = f.real(v ^ d)
            steps.append(Step(sends=(Send(peer, everything),), recvs=(Recv(peer, everything, reduce=True),)))
            d *= 2
        if f.is_host(r):
            steps.append(Step(sends=(Send(r - 1, everything),)))
        return Schedule(layout, tuple(steps))

    def _all_gather(self, layout: Layout) -> Schedule:
        p, r, n = layout.world, layout.rank, layout.count
        own = Copy(Region("in", 0, n), Region("out", r * n, n))
        if n == 0 or p == 1:
            return Schedule(layout, (Step(copies=(own,)),))
        f = Fold(p)

        def chunks(lo_v: int, hi_v: int) -> Region:
            # Real chunks of virtual ranks [lo_v, hi_v) are contiguous in the output.
            a, b = f.first_real(lo_v), f.first_real(hi_v)
            return Region("out", a * n, (b - a) * n)

        if f.sits_out(r):
            others = tuple(x for x in (Region("out", 0, r * n), Region("out", (r + 1) * n, (p - r - 1) * n)) if x.count)
            steps = [Step(sends=(Send(r + 1, (Region("out", r * n, n),)),)), Step(recvs=(Recv(r + 1, others),))]
            return Schedule(layout, tuple(with_copies(steps, own, None)))
        steps = []
        if f.is_host(r):
            steps.append(Step(recvs=(Recv(r - 1, (Region("out", (r - 1) * n, n),)),)))
        v = f.virtual(r)
        d = 1
        while d < f.p2:
            lo = v & ~(d - 1)
            plo = (v ^ d) & ~(d - 1)
            peer = f.real(v ^ d)
            steps.append(Step(sends=(Send(peer, (chunks(lo, lo + d),)),), recvs=(Recv(peer, (chunks(plo, plo + d),)),)))
            d *= 2
        if f.is_host(r):
            partner = r - 1
            others = tuple(x for x in (Region("out", 0, partner * n), Region("out", (partner + 1) * n, (p - partner - 1) * n)) if x.count)
            steps.append(Step(sends=(Send(partner, others),)))
        return Schedule(layout, tuple(with_copies(steps, own, None)))
