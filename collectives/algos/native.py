"""The backend's own collective (NCCL, HCCL, Gloo or MPI through torch.distributed).

This is the anchor every other algorithm is measured against, and what ``auto`` picks wherever
the backend's tuned implementation is the best we have. It has no schedule of ours to show.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

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
# groups inside torch.distributed's coalescing manager: their calls are collected, not issued
_COALESCING: dict[Any, Any] = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_coalesce_state", {})


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

    def fast_path(self, call: Call) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """For repeats of a synchronous single-tensor call: the process group's own method with
        its options built once, then ``wait``: what ``torch.distributed``'s verb does for it,
        less the checks that the call's signature settles (``dispatch_tensors``) and its
        wrappers. Inside torch's coalescing manager the verb itself runs (it collects the call).
        None for the other ops and for complex tensors (torch views them as real)."""
        op, group, t = call.op, call.comm.group, call.output
        if t.is_complex() or op not in ("all_reduce", "reduce_scatter", "all_gather"):
            return None
        rop = torch_reduce_op(call.reduce_op or "sum")
        opts: Any = dist.AllreduceOptions() if op == "all_reduce" else \
            dist.ReduceScatterOptions() if op == "reduce_scatter" else AllgatherOptions()
        if op != "all_gather":
            opts.reduceOp = rop
        opts.asyncOp = False
        if op == "all_reduce":
            allreduce = group.allreduce

            def run(out: torch.Tensor, inp: torch.Tensor) -> None:
                if _COALESCING and group in _COALESCING:
                    dist.all_reduce(out, rop, group)
                    return
                work = allreduce([out], opts)
                if work is not None:  # None: the backend synchronised itself
                    work.wait()
            return run
        base: Callable[..., Any]
        verb: Callable[..., Any]
        if op == "reduce_scatter":
            base, verb = group._reduce_scatter_base, functools.partial(_reduce_scatter, op=rop, group=group)
        else:
            base, verb = group._allgather_base, functools.partial(_all_gather, group=group)

        def run_out_of_place(out: torch.Tensor, inp: torch.Tensor) -> None:
            if _COALESCING and group in _COALESCING:
                verb(out, inp)
                return
            work = base(out, inp, opts)
            if work is not None:
                work.wait()
        return run_out_of_place

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
            return dist.barrier(g, async_op=a, device_ids=call.device_ids)
        assert call.root is not None  # set by validation
        root = call.comm.global_ranks[call.root]
        if op == "broadcast":
            return dist.broadcast(call.output, root, g, a)
        if op == "reduce":
            return dist.reduce(call.output, root, torch_reduce_op(call.reduce_op or "sum"), g, a)
        raise AssertionError(op)
