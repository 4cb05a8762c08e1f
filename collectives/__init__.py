"""commops collectives: torch.distributed's verbs with a choice of algorithm.

Every verb takes torch.distributed's positional and keyword arguments plus a keyword-only
``algorithm=`` ("auto" by default; :func:`algorithms` lists the others) and goes through one
dispatch point that validates, chooses, traces and runs it::

    import collectives as C
    comm = C.init()                                   # under torchrun or mpiexec
    C.all_reduce(x)                                   # like torch.distributed.all_reduce
    C.all_reduce(x, op="max", algorithm="ring")
    C.all_to_all_single(out, inp, out_splits, in_splits, algorithm="pairwise")

Works on a group the caller initialised with ``torch.distributed.init_process_group`` too.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from ._types import DATA_OPS, OPS, REDUCE_OPS, ReduceOp
from .algos import for_op
from .bootstrap import LaunchInfo, init
from .communicator import Communicator, destroy, get_communicator
from . import _ops  # noqa: F401 - defines torch.ops.commops, what the verbs trace to
from . import _traced
from . import dispatch as _dispatch
from .dispatch import Call, add_trace_hook, dispatch_tensors, remove_trace_hook
from .errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    CommopsError,
    InvalidArgumentError,
    InvalidSettingError,
    InvalidTypeError,
    LaunchError,
    NotInitializedError,
    RankLeft,
    RankFailed,
    GroupAborted,
    UnsafePathError,
    SettingsMismatch,
    UnsupportedError,
)
from ._wait import call_timeout
from .recorder import dump as dump_trace
from .selection import Choice
from .work import Work

__all__ = [
    "init", "destroy", "Communicator", "get_communicator", "algorithms", "last_choice",
    "all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "all_gather_single",
    "all_gather_into_tensor", "all_to_all_single", "broadcast", "reduce", "barrier",
    "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
    "ReduceOp", "Work", "Choice", "Call", "add_trace_hook", "remove_trace_hook", "LaunchInfo",
    "OPS", "DATA_OPS", "REDUCE_OPS",
    "CommopsError", "InvalidArgumentError", "InvalidTypeError", "UnsupportedError",
    "NotInitializedError", "LaunchError", "CollectiveTimeout", "CollectiveMismatch", "RankLeft", "RankFailed",
    "GroupAborted", "InvalidSettingError",
    "UnsafePathError", "SettingsMismatch", "dump_trace", "call_timeout",
]

Group = dist.ProcessGroup | None
# True while torch.compile traces (a constant in the trace): the verbs then trace to the
# torch.ops.commops ops (collectives/_ops.py); eagerly, one call (+0.22 us on a repeated call's
# host time, launch/bench_fastpath_host.py's "verb" row).
_compiling = torch.compiler.is_compiling


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Group = None, async_op: bool = False, *,
               algorithm: str = "auto") -> Work | None:
    """Reduce ``tensor`` across ranks in place (``torch.distributed.all_reduce``).

    Args:
        tensor: contiguous, on the device the group's backend uses; same shape and dtype on every rank.
        op: sum, avg, max, min or prod (``ReduceOp`` or a string).
        group: the process group (default: world).
        async_op: return a :class:`Work` handle instead of waiting.
        algorithm: "auto" or a name from :func:`algorithms` ("all_reduce").
    """
    if _compiling():
        return _traced.all_reduce(tensor, op, group, async_op, algorithm)
    fast = _dispatch._native_verb  # a repeat, compiled (collectives/_native.py); None: it is not one
    if fast is not None and fast("all_reduce", tensor, tensor, op, group, async_op, algorithm) is None:
        return None
    return dispatch_tensors(get_communicator(group), "all_reduce", tensor, tensor, op, algorithm, async_op,
                            fast is not None)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM, group: Group = None,
                          async_op: bool = False, *, algorithm: str = "auto") -> Work | None:
    """Reduce ``input`` ([world * n]) across ranks; rank r receives elements [r*n, (r+1)*n) into ``output`` ([n])."""
    if _compiling():
        return _traced.reduce_scatter(output, input, op, group, async_op, algorithm)
    fast = _dispatch._native_verb
    if fast is not None and fast("reduce_scatter", output, input, op, group, async_op, algorithm) is None:
        return None
    return dispatch_tensors(get_communicator(group), "reduce_scatter", output, input, op, algorithm, async_op,
                            fast is not None)


def all_gather_single(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Group = None,
                      async_op: bool = False, *, algorithm: str = "auto") -> Work | None:
    """Gather every rank's ``input_tensor`` ([n]) in rank order into ``output_tensor`` ([world * n])."""
    if _compiling():
        return _traced.all_gather(output_tensor, input_tensor, group, async_op, algorithm)
    fast = _dispatch._native_verb
    if fast is not None and fast("all_gather", output_tensor, input_tensor, None, group, async_op, algorithm) is None:
        return None
    return dispatch_tensors(get_communicator(group), "all_gather", output_tensor, input_tensor, None, algorithm,
                            async_op, fast is not None)


# torch 2.13 renamed these two; both names are offered.
reduce_scatter_tensor = reduce_scatter_single
all_gather_into_tensor = all_gather_single


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Any = None,
                      input_split_sizes: Any = None, group: Group = None, async_op: bool = False, *,
                      algorithm: str = "auto") -> Work | None:
    """Exchange rows of ``input`` (dim 0): ``input_split_sizes[q]`` rows go to rank q, and
    ``output_split_sizes[q]`` rows from rank q land in ``output``, in rank order. ``None`` splits
    dim 0 evenly. Uneven and zero-length splits are allowed (not with ``algorithm="bruck"``)."""
    if _compiling():
        return _traced.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op,
                                         algorithm)
    return get_communicator(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                     async_op, algorithm=algorithm)


def broadcast(tensor: torch.Tensor, src: int | None = None, group: Group = None, async_op: bool = False,
              group_src: int | None = None, *, algorithm: str = "auto") -> Work | None:
    """Copy ``tensor`` from global rank ``src`` (or group rank ``group_src``) to every rank, in place."""
    if _compiling():
        return _traced.broadcast(tensor, src, group, async_op, group_src, algorithm)
    return get_communicator(group).broadcast(tensor, src, async_op, group_src=group_src, algorithm=algorithm)


def reduce(tensor: torch.Tensor, dst: int | None = None, op: Any = ReduceOp.SUM, group: Group = None,
           async_op: bool = False, group_dst: int | None = None, *, algorithm: str = "auto") -> Work | None:
    """Reduce ``tensor`` across ranks into global rank ``dst`` (or group rank ``group_dst``).

    Only ``dst``'s tensor holds the result; with commops' own algorithms the other ranks' tensors
    are left unchanged (the backends' own may use them as scratch).
    """
    if _compiling():
        return _traced.reduce(tensor, dst, op, group, async_op, group_dst, algorithm)
    return get_communicator(group).reduce(tensor, dst, op, async_op, group_dst=group_dst, algorithm=algorithm)


# torch.distributed's list forms: each runs as one flat call of the verbs above (collectives/_lists.py).
def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group = None, async_op: bool = False,
               *, algorithm: str = "auto") -> Work | None:
    """Gather every rank's ``tensor`` into ``tensor_list[r]`` (``torch.distributed.all_gather``): a list
    of ``world`` tensors of ``tensor``'s dtype and element count, contiguous or not. Where they lie end to
    end in one storage (``list(out.chunk(world))``) the gather lands there with no copy."""
    return get_communicator(group).all_gather(tensor_list, tensor, async_op, algorithm=algorithm)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Group = None,
                   async_op: bool = False, *, algorithm: str = "auto") -> Work | None:
    """Reduce ``input_list[r]`` across ranks into rank r's ``output`` (``torch.distributed.reduce_scatter``):
    ``world`` tensors of ``output``'s dtype and element count."""
    return get_communicator(group).reduce_scatter(output, input_list, op, async_op, algorithm=algorithm)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group: Group = None,
               async_op: bool = False, *, algorithm: str = "auto") -> Work | None:
    """Send ``input_tensor_list[q]`` to rank q and receive rank q's into ``output_tensor_list[q]``
    (``torch.distributed.all_to_all``); sizes may differ per rank (rank q's ``input_tensor_list[r]``
    has as many elements as rank r's ``output_tensor_list[q]``)."""
    return get_communicator(group).all_to_all(output_tensor_list, input_tensor_list, async_op, algorithm=algorithm)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int | None = None,
           group: Group = None, async_op: bool = False, group_dst: int | None = None, *,
           algorithm: str = "auto") -> Work | None:
    """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst`` (or group rank
    ``group_dst``; neither: global rank 0), as ``torch.distributed.gather``: ``gather_list`` on that rank
    only. Runs as an all-to-all in which only the root receives (``algorithm=`` picks the all-to-all's)."""
    return get_communicator(group).gather(tensor, gather_list, dst, async_op, group_dst=group_dst,
                                          algorithm=algorithm)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int | None = None,
            group: Group = None, async_op: bool = False, group_src: int | None = None, *,
            algorithm: str = "auto") -> Work | None:
    """Rank r receives ``scatter_list[r]`` of global rank ``src`` (or group rank ``group_src``; neither:
    global rank 0) into ``tensor``, as ``torch.distributed.scatter``: ``scatter_list`` on that rank only.
    Runs as an all-to-all in which only the root sends (``algorithm=`` picks the all-to-all's)."""
    return get_communicator(group).scatter(tensor, scatter_list, src, async_op, group_src=group_src,
                                           algorithm=algorithm)


def barrier(group: Group = None, async_op: bool = False, device_ids: list[int] | None = None,
            timeout: datetime.timedelta | None = None) -> Work | None:
    """Wait until every rank of ``group`` has called ``barrier`` (``torch.distributed.barrier``:
    ``device_ids`` for NCCL; ``timeout``, a ``datetime.timedelta``, bounds the wait, past which
    ``CollectiveTimeout`` names the ranks that did not arrive)."""
    if _compiling():
        return _traced.barrier(group, async_op, device_ids, timeout)
    return get_communicator(group).barrier(async_op, device_ids, timeout)


def algorithms(op: str, group: Group = None, *, dtype: torch.dtype | None = None,
               backend: str | None = None) -> list[str]:
    """Algorithm names usable for canonical ``op`` ("all_reduce", "reduce_scatter", "all_gather",
    "all_to_all", "broadcast", "reduce") on ``group``'s backend (or the given ``backend``)."""
    if op not in OPS:
        raise InvalidArgumentError("op", op, "is not a canonical op name", f"pass one of {', '.join(OPS)}")
    if backend is None:
        comm = get_communicator(group)
        return comm.algorithms(op, dtype)
    return for_op(op, dtype, backend)


def last_choice(group: Group = None) -> Choice | None:
    """How ``algorithm="auto"`` decided the last call on ``group`` (algorithm, rule, reason)."""
    return get_communicator(group).last_choice
