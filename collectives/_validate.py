"""Argument checks run by the dispatch point before anything is sent.

Each check raises a typed error naming the argument, its value, what is wrong and the fix. They
look only at this rank's arguments: ranks that disagree with each other are the debug-check mode's
business, not this module's.

What each verb accepts is written once, in :data:`VERBS` (its tensor arguments, whether it
reduces, the fewest dimensions a tensor may have, its root argument) and in the dtype tables of
:mod:`collectives._types` (what each backend moves, what every algorithm reduces); the per-verb
functions below only add the size relations between a verb's tensors. Every argument the call
reads is checked here, types first, so that nothing a rank was given can fail inside a backend
after another rank has sent (tests/test_validate_fuzz.py throws random bad calls at it).
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import _native
from .algos import for_op
from ._types import BACKEND_DTYPES, FLOAT_DTYPES, REDUCIBLE_DTYPES, normalize_reduce_op, torch_reduce_op
from .errors import InvalidArgumentError, InvalidTypeError, UnsupportedError
from .selection import Choice

if TYPE_CHECKING:
    from .communicator import Communicator
    from .dispatch import Call

__all__ = ["validate", "check_tensor", "check_device", "check_root", "VERBS", "VerbRule"]


# torch's own accessor of the current CUDA device (what torch.cuda.current_device() returns after
# its lazy-init check); this function is on every collective's path.
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


class _Sparse(Exception):
    """Raised by ``_tensor`` for a tensor of a sparse layout; ``validate`` decides (``_sparse``)."""


def _tensor(name: str, t: object, comm: Communicator) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(name, t, f"is a {type(t).__name__}, not a torch.Tensor", f"pass {name} as a tensor")
    if not t.is_contiguous():  # False for a sparse layout too, so the dense path pays nothing for it
        if t.layout is not torch.strided:
            raise _Sparse(name)
        raise InvalidArgumentError(
            name, t, f"is not contiguous (strides {tuple(t.stride())})",
            f"pass {name}.contiguous(), then copy the result back if you need it in place",
        )
    return check_device(name, t, comm)


def check_device(name: str, t: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``t`` if it is on a device that ``comm``'s backends use (a CUDA tensor: the current one)."""
    if t.is_cuda:
        if comm._backends.get("cuda") is None:
            _wrong_device(name, t, comm)
        if t.get_device() != _current_device():
            raise InvalidArgumentError(
                name, t, f"is on {t.device} but this rank's current device is cuda:{torch.cuda.current_device()}",
                "create the tensor on the rank's device or call torch.cuda.set_device(local_rank) first",
            )
    elif comm._backends.get(t.device.type) is None:
        _wrong_device(name, t, comm)
    return t


# (op, dtype, backend) -> whether any registered algorithm moves that dtype for that op there
_MOVABLE: dict[tuple[str, torch.dtype, str | None], bool] = {}


def check_tensor(name: str, t: object, comm: Communicator) -> torch.Tensor:
    """``t`` if it is a dense contiguous tensor on a device ``comm``'s backends use, else a typed
    error naming ``name`` (for verbs built on the others, whose own arguments have other names)."""
    try:
        return _tensor(name, t, comm)
    except _Sparse:
        _refuse_sparse(name, t, "this verb")  # type: ignore[arg-type]
        raise


def _refuse_sparse(name: str, t: torch.Tensor, what: str) -> None:
    raise UnsupportedError(
        name, t, f"has the sparse layout {t.layout}, which {what} does not take (torch.distributed's backends move "
        "sparse tensors only in all_reduce, and Gloo only with op=SUM: \"allreduce of sparse tensors only works with "
        "ReduceOp.SUM\")", f"pass {name}.to_dense(), or all_reduce it with op=SUM on a Gloo group",
    )


def _sparse(call: Call, name: str) -> None:
    """A sparse tensor: what torch.distributed passes to the backend (Gloo's all_reduce with SUM,
    the only sparse collective it runs) goes to the backend's own all_reduce; the rest is refused
    before anything is sent."""
    t = call.output
    backend = call.comm._backends.get(t.device.type)
    if call.op != "all_reduce" or backend != "gloo":
        _refuse_sparse(name, t, f"{call.op} on backend {backend!r}")
    call.reduce_op = normalize_reduce_op(call.reduce_op)
    if call.reduce_op != "sum":
        _refuse_sparse(name, t, f"all_reduce with op={call.reduce_op}")
    if call.algorithm not in ("auto", "native"):
        raise UnsupportedError("algorithm", call.algorithm, "does not run sparse tensors",
                               "pass 'auto' or 'native' (the backend's own all_reduce takes them)")
    call.algorithm = "native"
    call.choice = call.comm.last_choice = Choice("native", "sparse", "a sparse tensor: only the backend's own "
                                                 "all_reduce takes one")


def _movable(call: Call, name: str, t: torch.Tensor, backend: str | None) -> None:
    key = (call.op, t.dtype, backend)
    ok = _MOVABLE.get(key)
    if ok is None:
        ok = _MOVABLE[key] = bool(for_op(call.op, t.dtype, backend))
    if not ok:
        moved = sorted(str(d).removeprefix("torch.") for d in BACKEND_DTYPES.get(backend or "", ()))
        raise InvalidArgumentError(
            name, t, f"has dtype {t.dtype}, which no algorithm moves for {call.op} on backend {backend!r}",
            f"cast it to one of {', '.join(moved)} (e.g. int16 -> int32), and back after the call",
        )


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
    if t.is_complex():  # torch's words first for a complex tensor, whatever the op (BAND included)
        try:
            call.reduce_op = normalize_reduce_op(call.reduce_op)
        except InvalidArgumentError:
            raise InvalidArgumentError("op", call.reduce_op, f"{call.op} does not support {call.reduce_op} on "
                                       "complex tensors", "reduce with op=SUM or AVG") from None
    call.reduce_op = normalize_reduce_op(call.reduce_op)
    if t.dtype not in REDUCIBLE_DTYPES:
        if t.is_complex():
            _complex(call)
            return
        raise InvalidArgumentError(
            name, t, f"has dtype {t.dtype}, which {call.op} cannot reduce",
            "use a floating-point or integer dtype (float64/32/16, bfloat16, int8..int64, uint8)",
        )
    if call.reduce_op == "avg" and t.dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            "op", "avg", f"averaging {t.dtype} would truncate",
            "reduce with op='sum' and divide, or use a floating-point tensor",
        )


def _complex(call: Call) -> None:
    """A complex tensor is reduced as its real view (``torch.view_as_real``), as torch.distributed
    does: a sum or an average of complex numbers is that of their real and imaginary parts. The
    other reduce ops mean nothing for complex numbers and are refused, with torch's phrase."""
    if call.reduce_op not in ("sum", "avg"):
        rop = torch_reduce_op(call.reduce_op or "sum")
        raise InvalidArgumentError("op", rop, f"{call.op} does not support {rop} on complex tensors",
                                   "reduce with op=SUM or AVG, or reduce torch.view_as_real(t) with this op "
                                   "if you mean it per real and imaginary part")
    same = call.input is call.output
    call.output = torch.view_as_real(call.output)
    call.input = call.output if same else torch.view_as_real(call.input)


def _rank_arg(name: str, value: object) -> int | None:
    """``value`` as an int rank (anything with ``__index__``, as torch takes), None if None."""
    if value is None:
        return None
    if isinstance(value, bool):  # an int to Python, never meant as a rank
        raise InvalidTypeError(name, value, "is a bool, not a rank", f"pass {name} as an int")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidTypeError(name, value, f"is a {type(value).__name__}, not an int",
                               f"pass {name} as an int rank") from None


def check_root(comm: Communicator, name: str, group_name: str, value: object, group_value: object) -> int:
    """The group rank that global rank ``value`` or group rank ``group_value`` names (exactly
    one given, or both naming the same rank), else a typed error naming the arguments."""
    value, group_value = _rank_arg(name, value), _rank_arg(group_name, group_value)
    if value is None and group_value is None:
        raise InvalidArgumentError(name, None, "is required", f"pass {name}= (a global rank) or {group_name}= (a rank in the group)")
    if group_value is not None:
        if not 0 <= group_value < comm.size:
            raise InvalidArgumentError(group_name, group_value, f"is not a rank of this group of {comm.size}",
                                       f"pass {group_name} in 0..{comm.size - 1}")
        if value is not None and comm.group_rank(value) != group_value:
            raise InvalidArgumentError(name, value, f"and {group_name}={group_value} name different ranks",
                                       f"pass only one of {name} and {group_name}")
        return group_value
    assert value is not None
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
        if splits.dtype.is_floating_point or splits.dtype.is_complex or splits.dim() != 1:
            raise InvalidTypeError(name, splits, "is not a 1-d integer tensor", f"pass {name} as a list of {world} ints")
        splits = splits.tolist()
    try:
        if not isinstance(splits, (list, tuple)) or any(isinstance(s, bool) for s in splits):
            raise TypeError
        splits = [operator.index(s) for s in splits]
    except TypeError:
        raise InvalidTypeError(name, splits, "is not a list of ints",
                               f"pass {name} as a list of {world} non-negative ints") from None
    if len(splits) != world:
        raise InvalidArgumentError(name, splits, f"has {len(splits)} entries but the group has {world} ranks",
                                   f"pass exactly one size per rank ({world})")
    if any(s < 0 for s in splits):
        raise InvalidArgumentError(name, splits, "has a negative size", "pass sizes >= 0")
    if sum(splits) != rows:
        raise InvalidArgumentError(name, splits, f"sums to {sum(splits)} but the tensor's dim 0 is {rows}",
                                   f"make {name} sum to {rows}, or resize the tensor")
    return tuple(splits)


def _reduce_scatter_sizes(call: Call, out: torch.Tensor, inp: torch.Tensor) -> None:
    w = call.comm.size
    if inp.numel() != w * out.numel():
        raise InvalidArgumentError(
            "input", inp, f"has {inp.numel()} elements, not world size {w} x output's {out.numel()} = {w * out.numel()}",
            f"make input {w} times the size of output",
        )


def _all_gather_sizes(call: Call, out: torch.Tensor, inp: torch.Tensor) -> None:
    w = call.comm.size
    if out.numel() != w * inp.numel():
        raise InvalidArgumentError(
            "output_tensor", out,
            f"has {out.numel()} elements, not world size {w} x input_tensor's {inp.numel()} = {w * inp.numel()}",
            f"make output_tensor {w} times the size of input_tensor",
        )


def _all_to_all_sizes(call: Call, out: torch.Tensor, inp: torch.Tensor) -> None:
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


@dataclass(frozen=True)
class VerbRule:
    """What one verb accepts, before the size relations between its tensors.

    Attributes:
        output: the argument name of ``Call.output`` (the tensor written), or None (barrier).
        input: the argument name of ``Call.input`` when it is a tensor of its own, else None.
        reduces: whether ``op=`` applies (checked against the reducible dtypes).
        min_dim: the fewest dimensions each tensor may have: an all-to-all splits dim 0 (a 0-d
            tensor has no rows); Gloo's reduce-scatter crashes on a 0-d tensor and its all-gather
            refuses one after the call has started, where NCCL takes both.
        min_dim_on: the backends ``min_dim`` applies to (None: every backend).
        root: the (global, group) argument names of the root, for rooted verbs.
        sizes: the check of the size relation between output and input, if any.
    """

    output: str | None
    input: str | None = None
    reduces: bool = False
    min_dim: int = 0
    min_dim_on: frozenset[str] | None = None
    root: tuple[str, str] | None = None
    sizes: Callable[[Call, torch.Tensor, torch.Tensor], None] | None = None


_GLOO = frozenset({"gloo"})
VERBS: dict[str, VerbRule] = {
    "all_reduce": VerbRule("tensor", reduces=True),
    "reduce_scatter": VerbRule("output", "input", reduces=True, min_dim=1, min_dim_on=_GLOO,
                               sizes=_reduce_scatter_sizes),
    "all_gather": VerbRule("output_tensor", "input_tensor", min_dim=1, min_dim_on=_GLOO, sizes=_all_gather_sizes),
    "all_to_all": VerbRule("output", "input", min_dim=1, sizes=_all_to_all_sizes),
    "broadcast": VerbRule("tensor", root=("src", "group_src")),
    "reduce": VerbRule("tensor", reduces=True, root=("dst", "group_dst")),
    "barrier": VerbRule(None),
}


def _min_dim(name: str, t: torch.Tensor, rule: VerbRule, op: str, backend: str | None) -> None:
    if t.dim() < rule.min_dim and (rule.min_dim_on is None or backend in rule.min_dim_on):
        raise InvalidArgumentError(name, t, f"is {t.dim()}-dimensional, but {op} on {backend} splits or gathers it by rank",
                                   f"pass {name} with a leading dimension (e.g. {name}.reshape(-1))")


def validate(call: Call) -> None:
    """Check ``call``'s arguments against :data:`VERBS` and the dtype tables; raise a typed error."""
    rule = VERBS[call.op]
    comm = call.comm
    if not isinstance(call.algorithm, str):
        raise InvalidTypeError("algorithm", call.algorithm, f"is a {type(call.algorithm).__name__}, not a name",
                               "pass 'auto' or a name from collectives.algorithms(op)")
    if call.async_op is not None and not isinstance(call.async_op, (bool, int)):
        raise InvalidTypeError("async_op", call.async_op, f"is a {type(call.async_op).__name__}, not a bool",
                               "pass async_op=True or False")
    if rule.output is None:
        return
    try:
        out = _tensor(rule.output, call.output, comm)
    except _Sparse:
        _sparse(call, rule.output)
        return
    backend = comm._backends.get("cuda" if out.is_cuda else out.device.type)
    _min_dim(rule.output, out, rule, call.op, backend)
    inp = out
    if rule.input is not None:
        inp = check_tensor(rule.input, call.input, comm)
        _min_dim(rule.input, inp, rule, call.op, backend)
        _same(rule.output, out, rule.input, inp)
    _movable(call, rule.input or rule.output, inp, backend)
    if rule.reduces:
        _reducible(call, rule.input or rule.output, inp)
    if rule.root is not None:
        call.root = check_root(comm, rule.root[0], rule.root[1], call.root, call.group_root)
    if rule.sizes is not None:
        rule.sizes(call, out, inp)


_native.provide("validate", sys.modules[__name__])  # what the compiled fast path reads (_native.py)
