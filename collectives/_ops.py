"""The verbs as ``torch.ops.commops.*``: what ``torch.compile`` traces and CUDA graphs capture.

Every verb is a ``torch.library`` op in one namespace, in two forms, the way torch offers its
own collectives (``torch.distributed`` in place, ``_functional_collectives`` out of place):

- in place, declaring what it writes: ``all_reduce_``, ``reduce_scatter_``, ``all_gather_``,
  ``all_to_all_single_``, ``broadcast_``, ``reduce_``, and ``barrier``;
- functional, returning a new tensor, differentiable: ``all_reduce``, ``reduce_scatter_tensor``,
  ``all_gather_tensor``, ``all_to_all_single``, ``broadcast`` (``collectives.functional``).

An op names its group by ``ProcessGroup.group_name`` ("" for the default group) and takes the
reduce op and the algorithm as strings: what a graph can hold as constants. An op whose output's
shape depends on the group's size takes that size too (``group_size``, as torch's functional
collectives do), so that the graph states it: compilers cache a compiled graph by its code and
its inputs' shapes, and a name alone ("" at every world size) once let a world of 3 load the
graph compiled for 2 (its shapes asserted wrong; found by the Inductor run at world 3). The
op checks the size against the group when it runs. The algorithm is
chosen inside the op, at run time, by the same dispatch point as an eager call
(:mod:`collectives.dispatch`), so ``algorithm="auto"``, validation, the flight recorder and the
bounded waits behave as they do eagerly: a compiled call is recorded, and a bad argument raises
the same typed error naming it, when the call runs. A fake implementation gives each op's output
shape from its inputs and the group's size, and refuses there what its shape alone rules out.

The public verbs (``collectives.all_reduce`` and the others) keep their signatures: eagerly they
call the dispatch point directly, as before (``torch.compiler.is_compiling`` is their one added
check: +0.22 us, 7.9%, on a repeated call's 2.9 us of host time on a 2-core CPU,
``launch/bench_fastpath_host.py``; a dispatcher round trip through a Python op would add 2.5-10
us); under ``torch.compile`` they trace to these ops
(``_traced.py``). With ``async_op=True`` a traced verb returns a handle that is already
complete: in a graph the op is ordered on its stream like any other op, which is what waiting
on the handle gives eagerly.

Gradients (the functional forms): the loss is the sum of every rank's loss, so an all-reduce
(sum) of ``x`` has the all-reduce of its output's gradient as ``x``'s gradient, an all-gather the
reduce-scatter of its gradient, a reduce-scatter the all-gather, an all-to-all the all-to-all with
the splits swapped, a broadcast the gradients' sum on the source (zero elsewhere). Averages
scale them by the group size; max, min and prod have none. The backward passes pick their
algorithm with ``auto``: the forward's may not run the other verb. No backward depends on the
rank where it is traced: compilers cache the backward graph by the forward's, the same on every
rank (a first version's broadcast gradient, traced per rank, came out wrong under Inductor), so
what differs by rank is decided inside an op. The in-place forms, like ``torch.distributed``'s,
are invisible to autograd.

Tried and rejected: ``torch.compiler.substitute_in_graph`` for the verbs (no check added to the
eager path, but it needs ``torch._dynamo`` imported, 1.2 s, before any verb could register);
``torch.library.custom_op`` for the op definitions (its Python wrapper costs 15 us a call; the
schema strings of ``Library.define`` with Python kernels cost 2.5 us in place).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op
from torch.distributed.distributed_c10d import _resolve_process_group

from ._types import normalize_reduce_op
from ._traced import group_name
from .communicator import Communicator, get_communicator
from .dispatch import dispatch_tensors
from .errors import InvalidArgumentError, UnsupportedError

__all__ = ["NAMESPACE", "SCHEMAS", "group_name", "communicator"]

NAMESPACE = "commops"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

# op name -> schema. "(a!)" marks what an in-place op writes; "SymInt[]?" splits may be symbolic.
SCHEMAS = {
    "all_reduce_": "(Tensor(a!) tensor, str op, str group, str algorithm) -> ()",
    "reduce_scatter_": "(Tensor(a!) output, Tensor input, str op, str group, str algorithm) -> ()",
    "all_gather_": "(Tensor(a!) output, Tensor input, str group, str algorithm) -> ()",
    "all_to_all_single_": "(Tensor(a!) output, Tensor input, SymInt[]? output_split_sizes, "
                          "SymInt[]? input_split_sizes, str group, str algorithm) -> ()",
    "broadcast_": "(Tensor(a!) tensor, int? src, int? group_src, str group, str algorithm) -> ()",
    "reduce_": "(Tensor(a!) tensor, int? dst, int? group_dst, str op, str group, str algorithm) -> ()",
    "barrier": "(str group) -> ()",
    "all_reduce": "(Tensor input, str op, str group, str algorithm) -> Tensor",
    "reduce_scatter_tensor": "(Tensor input, str op, int scatter_dim, int group_size, str group, str algorithm) "
                             "-> Tensor",
    "all_gather_tensor": "(Tensor input, int gather_dim, int group_size, str group, str algorithm) -> Tensor",
    "all_to_all_single": "(Tensor input, SymInt[]? output_split_sizes, SymInt[]? input_split_sizes, str group, "
                         "str algorithm) -> Tensor",
    "broadcast": "(Tensor input, int group_src, str group, str algorithm) -> Tensor",
    # broadcast's gradient: the sum of every rank's on group rank group_src, zero elsewhere
    "broadcast_backward": "(Tensor grad, int group_src, str group) -> Tensor",
}


# -- groups by name --------------------------------------------------------------------------------
def _process_group(name: str) -> dist.ProcessGroup | None:
    # torch 2.13 types the name as GroupName, a NewType of str that 2.11 lacks
    return None if name == "" else _resolve_process_group(name)  # type: ignore[arg-type]


def communicator(name: str) -> Communicator:
    """The communicator of the group an op names (:func:`group_name`)."""
    return get_communicator(_process_group(name))


def _size(name: str) -> int:
    return dist.get_world_size(_process_group(name))


def _check_size(group_size: int, group: str) -> None:
    world = _size(group)
    if group_size != world:
        raise InvalidArgumentError("group_size", group_size, f"is not the size of group {group!r} ({world} ranks)",
                                   f"pass {world}, the group's size (collectives.functional passes it for you)")


def _dim(name: str, dim: int, t: torch.Tensor) -> int:
    if not -t.dim() <= dim < max(t.dim(), 1):
        raise InvalidArgumentError(name, dim, f"is not a dimension of a {t.dim()}-d tensor",
                                   f"pass one in [{-t.dim()}, {t.dim() - 1}]")
    return dim % max(t.dim(), 1)


# -- in place --------------------------------------------------------------------------------------
def _all_reduce_(tensor: torch.Tensor, op: str, group: str, algorithm: str) -> None:
    dispatch_tensors(communicator(group), "all_reduce", tensor, tensor, op, algorithm, False)


def _reduce_scatter_(output: torch.Tensor, input: torch.Tensor, op: str, group: str, algorithm: str) -> None:
    dispatch_tensors(communicator(group), "reduce_scatter", output, input, op, algorithm, False)


def _all_gather_(output: torch.Tensor, input: torch.Tensor, group: str, algorithm: str) -> None:
    dispatch_tensors(communicator(group), "all_gather", output, input, None, algorithm, False)


def _all_to_all_single_(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None,
                        input_split_sizes: list[int] | None, group: str, algorithm: str) -> None:
    communicator(group).all_to_all_single(output, input, output_split_sizes, input_split_sizes, False,
                                          algorithm=algorithm)


def _broadcast_(tensor: torch.Tensor, src: int | None, group_src: int | None, group: str, algorithm: str) -> None:
    communicator(group).broadcast(tensor, src, False, group_src=group_src, algorithm=algorithm)


def _reduce_(tensor: torch.Tensor, dst: int | None, group_dst: int | None, op: str, group: str,
             algorithm: str) -> None:
    communicator(group).reduce(tensor, dst, op, False, group_dst=group_dst, algorithm=algorithm)


def _barrier(group: str) -> None:
    communicator(group).barrier(False)


# -- functional ------------------------------------------------------------------------------------
def _all_reduce(input: torch.Tensor, op: str, group: str, algorithm: str) -> torch.Tensor:
    out = input.clone(memory_format=torch.contiguous_format)
    _all_reduce_(out, op, group, algorithm)
    return out


def _scattered_shape(input: torch.Tensor, scatter_dim: int, world: int) -> list[int]:
    d = _dim("scatter_dim", scatter_dim, input)
    if input.dim() == 0 or input.shape[d] % world:
        raise InvalidArgumentError("scatter_dim", scatter_dim, f"has size {input.shape[d] if input.dim() else 0} in "
                                   f"input {tuple(input.shape)}, which {world} ranks do not divide",
                                   f"make dimension {scatter_dim} a multiple of {world}")
    shape = list(input.shape)
    shape[d] //= world
    return shape


def _reduce_scatter_tensor(input: torch.Tensor, op: str, scatter_dim: int, group_size: int, group: str,
                           algorithm: str) -> torch.Tensor:
    _check_size(group_size, group)
    shape = _scattered_shape(input, scatter_dim, group_size)
    d = _dim("scatter_dim", scatter_dim, input)
    lead = input.movedim(d, 0).contiguous()  # rank r's block is rows [r*n, (r+1)*n) of dimension d
    out = lead.new_empty((lead.shape[0] // group_size, *lead.shape[1:]))
    _reduce_scatter_(out, lead, op, group, algorithm)
    return out.movedim(0, d).contiguous() if d else out.view(shape)


def _all_gather_tensor(input: torch.Tensor, gather_dim: int, group_size: int, group: str,
                       algorithm: str) -> torch.Tensor:
    _check_size(group_size, group)
    d = _dim("gather_dim", gather_dim, input)
    lead = input.movedim(d, 0).contiguous()
    out = lead.new_empty((lead.shape[0] * group_size, *lead.shape[1:]))
    _all_gather_(out, lead, group, algorithm)
    return out.movedim(0, d).contiguous() if d else out


def _all_to_all_rows(input: torch.Tensor, output_split_sizes: list[int] | None) -> Any:
    return input.shape[0] if output_split_sizes is None else sum(output_split_sizes)


def _all_to_all_single(input: torch.Tensor, output_split_sizes: list[int] | None,
                       input_split_sizes: list[int] | None, group: str, algorithm: str) -> torch.Tensor:
    out = input.new_empty((_all_to_all_rows(input, output_split_sizes), *input.shape[1:]))
    _all_to_all_single_(out, input.contiguous(), output_split_sizes, input_split_sizes, group, algorithm)
    return out


def _broadcast(input: torch.Tensor, group_src: int, group: str, algorithm: str) -> torch.Tensor:
    out = input.clone(memory_format=torch.contiguous_format)
    _broadcast_(out, None, group_src, group, algorithm)
    return out


# -- fake (shape-only) implementations -------------------------------------------------------------
def _fake_none(*args: Any) -> None:
    return None


def _fake_all_reduce(input: torch.Tensor, op: str, group: str, algorithm: str) -> torch.Tensor:
    return torch.empty_like(input, memory_format=torch.contiguous_format)


def _fake_reduce_scatter_tensor(input: torch.Tensor, op: str, scatter_dim: int, group_size: int, group: str,
                                algorithm: str) -> torch.Tensor:
    return input.new_empty(_scattered_shape(input, scatter_dim, group_size))


def _fake_all_gather_tensor(input: torch.Tensor, gather_dim: int, group_size: int, group: str,
                            algorithm: str) -> torch.Tensor:
    d = _dim("gather_dim", gather_dim, input)
    shape = list(input.shape)
    shape[d] *= group_size
    return input.new_empty(shape)


def _fake_all_to_all_single(input: torch.Tensor, output_split_sizes: list[int] | None,
                            input_split_sizes: list[int] | None, group: str, algorithm: str) -> torch.Tensor:
    return input.new_empty((_all_to_all_rows(input, output_split_sizes), *input.shape[1:]))


def _fake_broadcast(input: torch.Tensor, group_src: int, group: str, algorithm: str) -> torch.Tensor:
    return torch.empty_like(input, memory_format=torch.contiguous_format)


# -- gradients of the functional forms -------------------------------------------------------------
def _no_gradient(op: str, verb: str) -> UnsupportedError:
    return UnsupportedError("op", op, f"has no gradient through {verb}",
                            "reduce with 'sum' or 'avg' where a gradient must flow, or detach the input")


def _setup_all_reduce(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.op, ctx.group = normalize_reduce_op(inputs[1]), inputs[2]


def _backward_all_reduce(ctx: Any, grad: torch.Tensor) -> Any:
    if ctx.op not in ("sum", "avg"):
        raise _no_gradient(ctx.op, "all_reduce")
    return torch.ops.commops.all_reduce(grad, ctx.op, ctx.group, "auto"), None, None, None


def _setup_reduce_scatter(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.op, ctx.dim, ctx.size, ctx.group = normalize_reduce_op(inputs[1]), inputs[2], inputs[3], inputs[4]


def _backward_reduce_scatter(ctx: Any, grad: torch.Tensor) -> Any:
    if ctx.op not in ("sum", "avg"):
        raise _no_gradient(ctx.op, "reduce_scatter_tensor")
    g = torch.ops.commops.all_gather_tensor(grad, ctx.dim, ctx.size, ctx.group, "auto")
    return (g / ctx.size if ctx.op == "avg" else g), None, None, None, None, None


def _setup_all_gather(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.dim, ctx.size, ctx.group = inputs[1], inputs[2], inputs[3]


def _backward_all_gather(ctx: Any, grad: torch.Tensor) -> Any:
    g = torch.ops.commops.reduce_scatter_tensor(grad, "sum", ctx.dim, ctx.size, ctx.group, "auto")
    return g, None, None, None, None


def _setup_all_to_all(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.out_splits, ctx.in_splits, ctx.group = inputs[1], inputs[2], inputs[3]


def _backward_all_to_all(ctx: Any, grad: torch.Tensor) -> Any:
    g = torch.ops.commops.all_to_all_single(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group, "auto")
    return g, None, None, None, None


def _setup_broadcast(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.src, ctx.group = inputs[1], inputs[2]


def _backward_broadcast(ctx: Any, grad: torch.Tensor) -> Any:
    # One op, deciding by rank when it runs: a backward traced to depend on the rank would be a
    # different graph on each rank under the same forward graph, and compilers cache backward
    # graphs by their forward graph (one rank's would serve the others).
    return torch.ops.commops.broadcast_backward(grad, ctx.src, ctx.group), None, None, None


def _broadcast_backward(grad: torch.Tensor, group_src: int, group: str) -> torch.Tensor:
    out = grad.clone(memory_format=torch.contiguous_format)
    comm = communicator(group)
    comm.reduce(out, None, "sum", False, group_dst=group_src)
    if comm.rank != group_src:
        out.zero_()
    return out


_KERNELS: dict[str, Any] = {
    "all_reduce_": _all_reduce_, "reduce_scatter_": _reduce_scatter_, "all_gather_": _all_gather_,
    "all_to_all_single_": _all_to_all_single_, "broadcast_": _broadcast_, "reduce_": _reduce_,
    "barrier": _barrier, "all_reduce": _all_reduce, "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_gather_tensor": _all_gather_tensor, "all_to_all_single": _all_to_all_single, "broadcast": _broadcast,
    "broadcast_backward": _broadcast_backward,
}
_FAKES: dict[str, Any] = {
    "all_reduce": _fake_all_reduce, "reduce_scatter_tensor": _fake_reduce_scatter_tensor,
    "all_gather_tensor": _fake_all_gather_tensor, "all_to_all_single": _fake_all_to_all_single,
    "broadcast": _fake_broadcast, "broadcast_backward": lambda grad, group_src, group: torch.empty_like(
        grad, memory_format=torch.contiguous_format),
}
_GRADIENTS: dict[str, tuple[Any, Any]] = {
    "all_reduce": (_backward_all_reduce, _setup_all_reduce),
    "reduce_scatter_tensor": (_backward_reduce_scatter, _setup_reduce_scatter),
    "all_gather_tensor": (_backward_all_gather, _setup_all_gather),
    "all_to_all_single": (_backward_all_to_all, _setup_all_to_all),
    "broadcast": (_backward_broadcast, _setup_broadcast),
}


def defined(name: str) -> bool:
    """Whether ``torch.ops.commops.<name>`` exists (a re-imported module finds its ops there)."""
    return hasattr(getattr(torch.ops, NAMESPACE), name)


def _register() -> None:
    if defined("all_reduce_"):  # this module imported again (its first copy's ops serve)
        return
    for name, schema in SCHEMAS.items():
        _LIB.define(name + schema)
        _LIB.impl(name, _KERNELS[name], "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _FAKES.get(name, _fake_none), lib=_LIB)
    for name, (backward, setup) in _GRADIENTS.items():
        torch.library.register_autograd(f"{NAMESPACE}::{name}", backward, setup_context=setup, lib=_LIB)
    # a barrier writes and returns nothing: marked ordered, so that no compiler drops or moves it
    _register_effectful_op(getattr(torch.ops, NAMESPACE).barrier.default, _EffectType.ORDERED)


_register()
