"""Argument checks run by the dispatch point before anything is sent.

Each check raises a typed error naming the argument, its value, what is wrong and the fix. They
look only at this rank's arguments: ranks that disagree with each other are the debug-check mode's
business, not this module's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ._types import FLOAT_DTYPES, REDUCIBLE_DTYPES, REDUCING_OPS
from .errors import InvalidArgumentError, InvalidTypeError

if TYPE_CHECKING:
    from .communicator import Communicator
    from .dispatch import Call

__all__ = ["validate"]


# torch's own accessor of the current CUDA device (what torch.cuda.current_device() returns after
# its lazy-init check); this function is on every collective's path.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _tensor(name: str, t: object, comm: Communicator) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(name, t, f"is a {type(t).__name__}, not a torch.Tensor", f"pass {name} as a tensor")
    if not t.is_contiguous():
        raise InvalidArgumentError(
            name, t, f"is not contiguous (strides {tuple(t.stride())})",
            f"pass {name}.contiguous(), then copy the result back if you need it in place",
        )
    if t.is_cuda:
        if comm._backends.get("cuda") is None:
            _wrong_device(name, t, comm)
        if t.get_device() != _current_device():
            raise InvalidArgumentError(
                name, t, f"is on {t.device} but this rank's current device is cuda:{torch.cuda.current_device()}",
                "create the tensor on the rank's device or call torch.cuda.set_device(local_rank) first",
            )
    elif comm.backend_for(t.device.type) is None:
        _wrong_device(name, t, comm)
    return t


def _wrong_device(name: str, t: torch.Tensor, comm: Communicator) -> None:
    raise InvalidArgumentError(
        name, t, f"is on {t.device}, which backend {comm.backend!r} of this group cannot use",
        f"move it to {' or '.join(comm.device_types)} (e.g. {name}.to({comm.device_types[0]!r}))",
    )


def _same(name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if t.dtype != other.dtype:
        raise InvalidArgumentError(name, t, f"has dtype {t.dtype} but {other_name} has {other.dtype}",
                                   f"give {name} and {other_name} the same dtype")
    if t.device != other.device:
        raise InvalidArgumentError(name, t, f"is on {t.device} but {other_name} is on {other.device}",
                                   f"put {name} and {other_name} on the same device")


def _reducible(call: Call, name: str, t: torch.Tensor) -> None:
    if t.dtype not in REDUCIBLE_DTYPES:
        raise InvalidArgumentError(
            name, t, f"has dtype {t.dtype}, which {call.op} cannot reduce",
            "use a floating-point or integer dtype (float64/32/16, bfloat16, int8..int64, uint8)",
        )
    if call.reduce_op == "avg" and t.dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            "op", "avg", f"averaging {t.dtype} would truncate",
            "reduce with op='sum' and divide, or use a floating-point tensor",
        )


def _root(call: Call, name: str, group_name: str, value: int | None, group_value: int | None) -> int:
    comm = call.comm
    if value is None and group_value is None:
        raise InvalidArgumentError(name, None, "is required", f"pass {name}= (a global rank) or {group_name}= (a rank in the group)")
    if group_value is not None:
        if not isinstance(group_value, int) or not 0 <= group_value < comm.size:
            raise InvalidArgumentError(group_name, group_value, f"is not a rank of this group of {comm.size}",
                                       f"pass {group_name} in 0..{comm.size - 1}")
        if value is not None and comm.group_rank(value) != group_value:
            raise InvalidArgumentError(name, value, f"and {group_name}={group_value} name different ranks",
                                       f"pass only one of {name} and {group_name}")
        return group_value
    if not isinstance(value, int):
        raise InvalidTypeError(name, value, "is not an int", f"pass {name} as a global rank (int)")
    g = comm.group_rank(value)
    if g is None:
        raise InvalidArgumentError(name, value, f"is not a member of this group (global ranks {list(comm.global_ranks)})",
                                   f"pass one of those global ranks, or {group_name}= in 0..{comm.size - 1}")
    return g


def _splits(name: str, splits: object, rows: int, world: int) -> tuple[int, ...]:
    if splits is None:
        if rows % world:
            raise InvalidArgumentError(name, None, f"is None but dim 0 ({rows}) is not divisible by the world size {world}",
                                       f"pass {name} explicitly or make dim 0 a multiple of {world}")
        return (rows // world,) * world
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if not isinstance(splits, (list, tuple)) or not all(isinstance(s, int) and not isinstance(s, bool) for s in splits):
        raise InvalidTypeError(name, splits, "is not a list of ints", f"pass {name} as a list of {world} non-negative ints")
    if len(splits) != world:
        raise InvalidArgumentError(name, splits, f"has {len(splits)} entries but the group has {world} ranks",
                                   f"pass exactly one size per rank ({world})")
    if any(s < 0 for s in splits):
        raise InvalidArgumentError(name, splits, "has a negative size", "pass sizes >= 0")
    if sum(splits) != rows:
        raise InvalidArgumentError(name, splits, f"sums to {sum(splits)} but the tensor's dim 0 is {rows}",
                                   f"make {name} sum to {rows}, or resize the tensor")
    return tuple(splits)


def _all_reduce(call: Call) -> None:
    t = _tensor("tensor", call.output, call.comm)
    _reducible(call, "tensor", t)


def _reduce_scatter(call: Call) -> None:
    out = _tensor("output", call.output, call.comm)
    inp = _tensor("input", call.input, call.comm)
    _same("output", out, "input", inp)
    _reducible(call, "input", inp)
    w = call.comm.size
    if inp.numel() != w * out.numel():
        raise InvalidArgumentError(
            "input", inp, f"has {inp.numel()} elements, not world size {w} x output's {out.numel()} = {w * out.numel()}",
            f"make input {w} times the size of output",
        )


def _all_gather(call: Call) -> None:
    out = _tensor("output_tensor", call.output, call.comm)
    inp = _tensor("input_tensor", call.input, call.comm)
    _same("output_tensor", out, "input_tensor", inp)
    w = call.comm.size
    if out.numel() != w * inp.numel():
        raise InvalidArgumentError(
            "output_tensor", out,
            f"has {out.numel()} elements, not world size {w} x input_tensor's {inp.numel()} = {w * inp.numel()}",
            f"make output_tensor {w} times the size of input_tensor",
        )


def _all_to_all(call: Call) -> None:
    out = _tensor("output", call.output, call.comm)
    inp = _tensor("input", call.input, call.comm)
    _same("output", out, "input", inp)
    for name, t in (("input", inp), ("output", out)):
        if t.dim() == 0:
            raise InvalidArgumentError(name, t, "is 0-dimensional", f"pass {name} with a leading dimension to split")
    if inp.numel() and out.numel() and _overlaps(inp, out):
        raise InvalidArgumentError("output", out, "shares memory with input",
                                   "all_to_all_single is out of place: pass a separate output tensor")
    if inp.shape[1:] != out.shape[1:]:
        raise InvalidArgumentError("output", out, f"has rows of shape {tuple(out.shape[1:])} but input's are {tuple(inp.shape[1:])}",
                                   "give input and output the same shape after dim 0")
    w = call.comm.size
    call.in_rows = _splits("input_split_sizes", call.in_rows, inp.shape[0], w)
    call.out_rows = _splits("output_split_sizes", call.out_rows, out.shape[0], w)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _broadcast(call: Call) -> None:
    _tensor("tensor", call.output, call.comm)
    call.root = _root(call, "src", "group_src", call.root, call.group_root)


def _reduce(call: Call) -> None:
    t = _tensor("tensor", call.output, call.comm)
    _reducible(call, "tensor", t)
    call.root = _root(call, "dst", "group_dst", call.root, call.group_root)


def _barrier(call: Call) -> None:
    pass


_CHECKS = {
    "all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter, "all_gather": _all_gather,
    "all_to_all": _all_to_all, "broadcast": _broadcast, "reduce": _reduce, "barrier": _barrier,
}


def validate(call: Call) -> None:
    _CHECKS[call.op](call)
    assert call.op not in REDUCING_OPS or call.reduce_op is not None
