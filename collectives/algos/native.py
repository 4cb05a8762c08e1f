"""The backend's own collective (NCCL, HCCL, Gloo or MPI through torch.distributed).

This is the anchor every other algorithm is measured against, and what ``auto`` picks wherever
the backend's tuned implementation is the best we have. It has no schedule of ours to show.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from topology.cost import CostPlan, Links, Machine, flat_plan

from .._types import DATA_OPS, OPS, torch_reduce_op
from .._wait import limit, wait
from ._base import Algorithm

if TYPE_CHECKING:
    from ..dispatch import Call

__all__ = ["Native"]

# torch 2.13 renamed the single-tensor collectives; 2.11 only has the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Native(Algorithm):
    name = "native"
    ops = frozenset(OPS)
    summary = "the backend's own collective"
    returns_work = True

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """The pattern the backend runs for ``op`` (``machine.native``; ring where it names none) on
        the backend's own links, or the backend's whole call where the machine measured it on this
        topology. A barrier moves no data: no price."""
        if op not in DATA_OPS:
            return None
        return flat_plan(machine.native.get(op, "ring"), op, nodes, Links.NATIVE, backend_call=op)

    def run(self, call: Call) -> dist.Work | None:
        if not call.async_op and limit() is not None:
            # Inside a call_timeout block: start asynchronously, wait with that bound.
            call.async_op = True
            try:
                work = self._start(call)
            finally:
                call.async_op = False
            if work is not None:
                wait(work, cuda=call.output is not None and call.output.is_cuda)
            return work
        return self._start(call)

    def _start(self, call: Call) -> dist.Work | None:
        op, g, a = call.op, call.comm.group, call.async_op
        if op == "all_reduce":
            return dist.all_reduce(call.output, torch_reduce_op(call.reduce_op or "sum"), g, a)
        if op == "reduce_scatter":
            return _reduce_scatter(call.output, call.input, torch_reduce_op(call.reduce_op or "sum"), g, a)
        if op == "all_gather":
            return _all_gather(call.output, call.input, g, a)
        if op == "all_to_all":
            return dist.all_to_all_single(call.output, call.input, call.out_rows, call.in_rows, g, a)
        if op == "barrier":
            return dist.barrier(g, async_op=a)
        assert call.root is not None  # set by validation
        root = call.comm.global_ranks[call.root]
        if op == "broadcast":
            return dist.broadcast(call.output, root, g, a)
        if op == "reduce":
            return dist.reduce(call.output, root, torch_reduce_op(call.reduce_op or "sum"), g, a)
        raise AssertionError(op)
