"""2D grid all-reduce: half the data rows-first, half columns-first, both at once.

The ranks form an ``n x g`` grid: a row is a node (``g`` ranks), a column a rail (``n`` ranks, one
per node). A 2D-torus all-reduce (Mikami et al. 2018) reduce-scatters along rows, all-reduces the
shard along columns and all-gathers along rows; that leaves the column links idle during the row
phases and the reverse. Like Ying et al. 2018 (TPU pods), this runs the first half of the buffer
rows-first and the second half columns-first, concurrently, so both dimensions carry traffic in
every phase::

    phase        half A (rows first)              half B (columns first)
    1            row reduce-scatter  [h -> h/g]   column reduce-scatter [h -> h/n]
    2            column all-reduce   [h/g]        row all-reduce        [h/n]
    3            row all-gather      [h/g -> h]   column all-gather     [h/n -> h]

Cost with row tier ``(a_r, b_r)`` and column tier ``(a_c, b_c)``, ``h = m/2`` bytes: each phase
takes the slower of its two concurrent halves, e.g. phase 1 ``max(T_RS(g, h; row), T_RS(n, h;
column))``. It beats the two-level hierarchy when rows and columns have similar bandwidth (a
torus); when the column tier is much slower, half B sends ``n``-fold more across it and
``hierarchical`` is better, which is what the cost model predicts.

Needs nodes of equal size (a grid); with one node or one rank per node it is the backend's
all-reduce.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from topology.cost import CostPlan, Links, Machine, Stage, flat_plan, stage
from topology.groups import equal_nodes, rails_of
from topology.model import Topology

from ..errors import UnsupportedError
from ._base import Algorithm, _divide
from .hierarchical import _equal, _rop, padded, run_flat, single_tier
from .native import _all_gather, _reduce_scatter
from .._wait import wait

if TYPE_CHECKING:
    from ..communicator import Communicator
    from ..dispatch import Call

__all__ = ["Grid2D"]


class Grid2D(Algorithm):
    name = "grid2d"
    ops = frozenset({"all_reduce"})
    topology_aware = True
    summary = "2D grid all-reduce: half rows-first, half columns-first, concurrently"

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """Three phases of the backend's collectives, each the two halves at once (the slower
        counts); with one node, one rank per node or unequal nodes, the backend's all-reduce."""
        if op not in self.ops:
            return None
        p = sum(len(n) for n in nodes)
        g = equal_nodes(Topology.from_nodes([list(n) for n in nodes]))
        if g is None or single_tier(nodes, p):
            return flat_plan(machine.native.get(op, "ring"), op, nodes, Links.NATIVE)
        native, rows, rails, nn = machine.native, [tuple(n) for n in nodes], rails_of(nodes), len(nodes)

        def three(first: list[tuple[int, ...]], second: list[tuple[int, ...]], a: int) -> tuple[Stage, ...]:
            # Half of the bytes: reduce-scatter over `first` (a ranks each), all-reduce the 1/a shard
            # over `second`, all-gather over `first`.
            return (stage(native["reduce_scatter"], "reduce_scatter", first, p, 0.5),
                    stage(native["all_reduce"], "all_reduce", second, p, 0.5 / a),
                    stage(native["all_gather"], "all_gather", first, p, 0.5))

        half_a, half_b = three(rows, rails, g), three(rails, rows, nn)
        return CostPlan(tuple(zip(half_a, half_b)))

    def unavailable(self, comm: Communicator, op: str) -> str:
        nodes = comm.topology.nodes()
        if single_tier(nodes, comm.size) or _equal(nodes):
            return ""
        return f"needs a grid (nodes of equal size); this group's nodes have {[len(n) for n in nodes]} ranks"

    def check(self, call: Call) -> None:
        why = self.unavailable(call.comm, call.op)
        if why:
            raise UnsupportedError("algorithm", self.name, why, "use 'hierarchical' on nodes of unequal size")
        if not single_tier(call.comm.topology.nodes(), call.comm.size):
            call.comm.derived_groups()

    def run(self, call: Call) -> None:
        comm = call.comm
        nodes = comm.topology.nodes()
        if single_tier(nodes, comm.size):
            run_flat(call)
            return
        d = comm.derived_groups()
        x = call.output.view(-1)
        m = x.numel()
        if m == 0:
            return
        g, n, rop = len(d.intra_ranks), len(d.nodes), _rop(call)
        h = (m + 1) // 2
        a = padded(call, "grid.a", x[:h], g)
        b = padded(call, "grid.b", x[h:], n) if m > h else None
        # The column reduce-scatter hands shard `position` to the rail's position-th member, but
        # the row all-reduce needs every rank of a node to hold the same shard: order the blocks
        # by node when this rail's members are not in node order (e.g. nodes [[0, 3], [1, 2]]).
        node_of = {r: k for k, members in enumerate(d.nodes) for r in members}
        perm = [node_of[q] for q in d.rail_ranks]
        unordered = b is not None and perm != sorted(perm)
        if unordered:
            assert b is not None
            idx = torch.tensor(perm, dtype=torch.long, device=x.device)
            bp = comm._workspace("grid.bp", x.dtype, x.device, b.numel())
            torch.index_select(b.view(n, -1), 0, idx, out=bp.view(n, -1))
            b_in = b
            b = bp
        sa = comm._workspace("grid.sa", x.dtype, x.device, a.numel() // g)
        sb = comm._workspace("grid.sb", x.dtype, x.device, b.numel() // n) if b is not None else None

        def both(fa: Any, fb: Any) -> None:
            wa = fa()
            wb = fb() if b is not None else None
            wait(wa)
            if wb is not None:
                wait(wb)

        both(lambda: _reduce_scatter(sa, a, rop, d.intra, True), lambda: _reduce_scatter(sb, b, rop, d.rail, True))
        both(lambda: dist.all_reduce(sa, rop, d.rail, True), lambda: dist.all_reduce(sb, rop, d.intra, True))
        both(lambda: _all_gather(a, sa, d.intra, True), lambda: _all_gather(b, sb, d.rail, True))
        if unordered:
            assert b is not None
            b_in.view(n, -1).index_copy_(0, idx, b.view(n, -1))
            b = b_in
        if a.data_ptr() != x.data_ptr():
            x[:h].copy_(a[:h])
        if b is not None and b.data_ptr() != x[h:].data_ptr():
            x[h:].copy_(b[:m - h])
        if call.reduce_op == "avg":
            _divide(call, comm.size)
