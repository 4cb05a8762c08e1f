"""What the verbs trace to under ``torch.compile``: their ``torch.ops.commops`` ops (``_ops.py``).

The public verbs (``collectives.all_reduce`` and the others) and the communicator's methods call
these while Dynamo traces (``torch.compiler.is_compiling``); eagerly they go to the dispatch point
directly. Each normalises what a graph cannot hold (a ``ReduceOp`` member, a process group) to
the strings the ops take and calls the in-place op; with ``async_op=True`` it returns ``DONE``,
a handle that is already complete (in a graph the op is ordered on its stream like any other).
Nothing here imports the communicator: it calls these from its methods.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ._types import REDUCE_OPS, normalize_reduce_op, torch_reduce_op
from .errors import UnsupportedError
from .work import Work

__all__ = ["group_name", "group_size", "DONE", "all_reduce", "reduce_scatter", "all_gather", "all_to_all_single", "broadcast",
           "reduce", "barrier"]


def group_name(group: Any) -> str:
    """What an op takes for ``group`` (a process group, a communicator or None): its
    ``group_name``, "" for None (the default group)."""
    if group is None:
        return ""
    if not isinstance(group, dist.ProcessGroup):  # a Communicator: its group
        group = group.group
    return str(group.group_name)


def group_size(group: Any) -> int:
    """The size of ``group`` (a process group, a communicator or None), read so that Dynamo folds it."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return dist.get_world_size(group)
    return int(group.size)


class _Done(Work):
    """The handle a traced verb returns for ``async_op=True``: complete (see the module docstring)."""

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


# torch's reduce-op members and our names, scanned by identity: torch 2.11's Dynamo cannot hash
# a member (a dict lookup breaks the graph) but compares objects by identity
_MEMBERS = tuple((torch_reduce_op(name), name) for name in REDUCE_OPS)


def _op_name(op: Any) -> str:
    if isinstance(op, str):
        return op
    for member, name in _MEMBERS:
        if op is member:
            return name
    return normalize_reduce_op(op)


def all_reduce(tensor: torch.Tensor, op: Any, group: Any, async_op: bool, algorithm: str) -> Work | None:
    torch.ops.commops.all_reduce_(tensor, _op_name(op), group_name(group), algorithm)
    return DONE if async_op else None


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: Any, group: Any, async_op: bool,
                          algorithm: str) -> Work | None:
    torch.ops.commops.reduce_scatter_(output, input, _op_name(op), group_name(group), algorithm)
    return DONE if async_op else None


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool,
                      algorithm: str) -> Work | None:
    torch.ops.commops.all_gather_(output, input, group_name(group), algorithm)
    return DONE if async_op else None


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any,
                             input_split_sizes: Any, group: Any, async_op: bool, algorithm: str) -> Work | None:
    out_splits = None if output_split_sizes is None else list(output_split_sizes)
    in_splits = None if input_split_sizes is None else list(input_split_sizes)
    torch.ops.commops.all_to_all_single_(output, input, out_splits, in_splits, group_name(group), algorithm)
    return DONE if async_op else None


def broadcast(tensor: torch.Tensor, src: int | None, group: Any, async_op: bool, group_src: int | None,
                     algorithm: str) -> Work | None:
    torch.ops.commops.broadcast_(tensor, src, group_src, group_name(group), algorithm)
    return DONE if async_op else None


def reduce(tensor: torch.Tensor, dst: int | None, op: Any, group: Any, async_op: bool, group_dst: int | None,
                  algorithm: str) -> Work | None:
    torch.ops.commops.reduce_(tensor, dst, group_dst, _op_name(op), group_name(group), algorithm)
    return DONE if async_op else None


def barrier(group: Any, async_op: bool, device_ids: Any = None, timeout: Any = None) -> Work | None:
    if device_ids is not None or timeout is not None:
        raise UnsupportedError("device_ids" if device_ids is not None else "timeout",
                               device_ids if device_ids is not None else timeout,
                               "is not taken by a barrier in compiled code", "call the barrier outside the compiled function")
    torch.ops.commops.barrier(group_name(group))
    return DONE if async_op else None
