"""Rabenseifner's all-reduce and reduce-scatter: recursive halving, then recursive doubling.

Reduce-scatter by recursive halving: at the step with distance ``d`` (``p/2, p/4, ..., 1``) each
rank swaps half of its current range with ``v xor d`` and reduces the half it keeps, so after
``log2 p`` steps rank ``v`` owns its own chunk, fully reduced. All-reduce follows with an
all-gather by recursive doubling that retraces the steps. Each rank sends ``(p-1)/p n`` bytes per
phase like the ring, in ``log2 p`` steps instead of ``p - 1``.

Time: all-reduce ``2 log2(p) a + 2 (p-1)/p n b + (p-1)/p n g`` (Thakur et al. 2005, sec. 4.3).

Non-power-of-two ``p`` is folded onto ``p2`` virtual ranks (``_fold``): the folded-out ranks hand
their whole vector to a partner first (one extra step) and get their part back at the end. The
halving splits fall on real-chunk boundaries, so each virtual rank ends up owning exactly the real
chunks of the ranks it stands for, and reduce-scatter still gives every real rank its own chunk.
"""

from __future__ import annotations

from topology.cost import CostPlan, Links, Machine, flat_plan

from ._base import ScheduledAlgorithm
from ._fold import Fold
from ._schedule import Copy, Layout, Recv, Region, Schedule, Send, Step, balanced_chunks, with_copies

__all__ = ["HalvingDoubling"]


class HalvingDoubling(ScheduledAlgorithm):
    name = "halving_doubling"
    ops = frozenset({"all_reduce", "reduce_scatter"})
    summary = "Rabenseifner: recursive halving reduce-scatter + recursive doubling all-gather"

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """Its halving exchanges, then (all-reduce) the doubling ones, one executor step each."""
        return flat_plan("halving_doubling", op, nodes, Links.EXECUTOR) if op in self.ops else None

    def build(self, layout: Layout) -> Schedule:
        p, r, n = layout.world, layout.rank, layout.count
        if layout.op == "all_reduce":
            chunks = balanced_chunks(n, p)
            buf = "out"
            total = n
        elif layout.op == "reduce_scatter":
            chunks = [(i * n, n) for i in range(p)]
            buf = "tmp"
            total = p * n
        else:
            raise ValueError(layout.op)
        f = Fold(p)

        def span(lo_v: int, hi_v: int) -> tuple[Region, ...]:
            a, b = f.first_real(lo_v), f.first_real(hi_v)
            start = chunks[a][0] if a < p else total
            end = chunks[b][0] if b < p else total
            return (Region(buf, start, end - start),) if end > start else ()

        everything = (Region(buf, 0, total),) if total else ()
        steps: list[Step] = []
        if total and f.sits_out(r):
            steps.append(Step(sends=(Send(r + 1, everything),)))
            if layout.op == "all_reduce":
                steps.append(Step(recvs=(Recv(r + 1, everything),)))
            else:
                mine = (Region(buf, *chunks[r]),)
                steps.append(Step(recvs=(Recv(r + 1, mine),)))
        elif total and p > 1:
            if f.is_host(r):
                steps.append(Step(recvs=(Recv(r - 1, everything, reduce=True),)))
            v = f.virtual(r)
            lo, hi = 0, f.p2
            d = f.p2 // 2
            trail = []
            while d >= 1:
                mid = lo + (hi - lo) // 2
                if v < mid:
                    keep, give = (lo, mid), (mid, hi)
                else:
                    keep, give = (mid, hi), (lo, mid)
                peer = f.real(v ^ d)
                sends = (Send(peer, span(*give)),) if span(*give) else ()
                recvs = (Recv(peer, span(*keep), reduce=True),) if span(*keep) else ()
                steps.append(Step(sends=sends, recvs=recvs))
                trail.append((peer, keep, give))
                lo, hi = keep
                d //= 2
            if layout.op == "all_reduce":
                for peer, keep, give in reversed(trail):
                    sends = (Send(peer, span(*keep)),) if span(*keep) else ()
                    recvs = (Recv(peer, span(*give)),) if span(*give) else ()
                    steps.append(Step(sends=sends, recvs=recvs))
                if f.is_host(r):
                    steps.append(Step(sends=(Send(r - 1, everything),)))
            elif f.is_host(r):
                steps.append(Step(sends=(Send(r - 1, (Region(buf, *chunks[r - 1]),)),)))
        if layout.op == "reduce_scatter":
            first = Copy(Region("in", 0, total), Region("tmp", 0, total))
            last = Copy(Region("tmp", r * n, n), Region("out", 0, n))
            steps = with_copies(steps, first, last)
            return Schedule(layout, tuple(steps), scratch=total)
        return Schedule(layout, tuple(steps))
