"""torch.distributed's list forms, each run as one flat call through the dispatch point.

Each function here is also a :class:`~collectives.Communicator` method (``comm`` is ``self``).

``all_gather(tensor_list, tensor)``, ``reduce_scatter(output, input_list)``,
``all_to_all(output_tensor_list, input_tensor_list)``, ``gather(tensor, gather_list, dst)`` and
``scatter(tensor, scatter_list, src)`` take torch's arguments, check them as torch does (the same
accepted inputs and exception types) and run one of the flat verbs, so that ``algorithm=``,
``last_choice()``, the flight recorder and the fast failure of a rank that goes wrong apply to them:

- all_gather / reduce_scatter: the flat all-gather / reduce-scatter over one ``[world * n]``
  buffer. Where the list's tensors already lie end to end in one storage in rank order
  (``list(out.chunk(world))``, say) that storage is the buffer and nothing is copied; otherwise
  the list is copied into the buffer (reduce-scatter) or out of it (all-gather).
- all_to_all: the flat all-to-all of each tensor's elements, split by the tensors' sizes, so
  uneven sizes run (as on NCCL; Gloo's own all_to_all refuses them).
- gather / scatter: an all-to-all in which only the root receives (gather) or sends (scatter) a
  non-empty share: MPI's gatherv written as an alltoallv. A trace shows it as ``all_to_all``.

With ``async_op=True`` a copy still to do runs when the handle is waited on (:class:`ThenWork`).

Rejected: gather and scatter as ops of their own in the algorithm registry. Every algorithm, the
cost model, the recorder's fingerprint and the conformance suite would grow a case for two verbs
that tensor- and expert-parallel code seldom calls, where the all-to-all already has the backend's
own and a pairwise algorithm, its checks and its failure handling. The price: on Gloo a rank also
exchanges an empty message with each non-root peer (measured in ``launch/bench_dispatch.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._validate import _overlaps, check_device, check_root, check_tensor
from . import _watch
from .dispatch import refused
from ._types import ReduceOp
from .errors import InvalidArgumentError, InvalidTypeError
from .work import ThenWork, Work

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"]

_compiling = torch.compiler.is_compiling


def _tensor_list(name: str, ts: object, comm: Communicator, like: torch.Tensor | None,
                 numel: int | None) -> list[torch.Tensor]:
    """``ts`` if it is a list of ``comm.size`` tensors of ``like``'s dtype and device (and, given
    ``numel``, each of that many elements), else torch's exception type with our message."""
    if not isinstance(ts, list):  # torch takes a list only (a tuple is a TypeError there too)
        raise InvalidTypeError(name, ts, f"is a {type(ts).__name__}, not a list of tensors",
                               f"pass {name} as a list of {comm.size} tensors, one per rank")
    if len(ts) != comm.size:
        raise InvalidArgumentError(name, ts, f"has {len(ts)} tensors but the group has {comm.size} ranks",
                                   f"pass exactly one tensor per rank ({comm.size})")
    for i, t in enumerate(ts):
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(f"{name}[{i}]", t, f"is a {type(t).__name__}, not a torch.Tensor",
                                   f"pass {name} as a list of tensors")
        if t.layout is not torch.strided:
            check_tensor(f"{name}[{i}]", t, comm)  # raises: names the sparse layout
        ref = ts[0] if like is None else like
        ref_name = f"{name}[0]" if like is None else "the tensor argument"
        if t.dtype != ref.dtype:
            raise InvalidArgumentError(f"{name}[{i}]", t, f"has dtype {t.dtype} but {ref_name} has {ref.dtype}",
                                       "give every tensor of the call the same dtype (torch: \"Invalid usage of "
                                       "tensors with different dtypes\")")
        if t.device != ref.device:
            raise InvalidArgumentError(f"{name}[{i}]", t, f"is on {t.device} but {ref_name} is on {ref.device}",
                                       "put every tensor of the call on the same device")
        if numel is not None and t.numel() != numel:
            raise InvalidArgumentError(f"{name}[{i}]", t, f"has {t.numel()} elements, not {numel}",
                                       f"give every tensor of {name} {numel} elements, as the tensor argument has")
    if like is None and ts:
        check_device(f"{name}[0]", ts[0], comm)
    return ts


def _adjacent(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view of the storage that ``ts`` lie in end to end, in order; None if they do not."""
    if _compiling() or not ts:
        return None
    t0 = ts[0]
    try:
        base, start = t0.untyped_storage().data_ptr(), t0.storage_offset()
    except RuntimeError:  # no storage (a tensor subclass, a fake tensor)
        return None
    at = start
    for t in ts:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != base or t.storage_offset() != at:
            return None
        at += t.numel()
    return t0.as_strided((at - start,), (1,), start)


def _flat_in(ts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``ts`` end to end as one 1-d tensor: their own storage where they lie so, else a copy."""
    flat = _adjacent(ts)
    if flat is not None:
        return flat
    if not ts:
        return like.new_empty(0)
    return torch.cat([t.reshape(-1) for t in ts])


def _copy_out(flat: torch.Tensor, ts: list[torch.Tensor]) -> Callable[[], None]:
    def copy() -> None:
        at = 0
        with torch.no_grad():
            for t in ts:
                n = t.numel()
                t.copy_(flat[at:at + n].view(t.shape))
                at += n
    return copy


def _then(work: Work | None, step: Callable[[], None] | None, outputs: list[torch.Tensor]) -> Work | None:
    """Run ``step`` now (a synchronous call) or when ``work`` is waited on."""
    if step is None:
        return work
    if work is None:
        step()
        return None
    return ThenWork(work, step, outputs)


def _checked(comm: Communicator, verb: str, check: Callable[[], Any]) -> Any:
    """``check()``, and if it raises, tell the other ranks as the dispatch point does for a call
    it refuses (they may already wait in this call), then raise. An earlier failure is settled first,
    as the dispatch point settles it: a check that failed before it did would leave that failure
    unsettled, and the watch would later take it for a failure of a call in flight."""
    if comm._trouble is not None:
        _watch.settle(comm, verb)
    try:
        return check()
    except BaseException as exc:
        if not _compiling():
            refused(comm, verb, exc)
        raise


def all_gather(comm: Communicator, tensor_list: list[torch.Tensor], tensor: torch.Tensor, async_op: bool = False,
               *, algorithm: str = "auto") -> Work | None:
    """Gather every rank's ``tensor`` into ``tensor_list[r]`` (``torch.distributed.all_gather``)."""
    def check() -> int:
        t = check_tensor("tensor", tensor, comm)
        _tensor_list("tensor_list", tensor_list, comm, t, t.numel())
        return t.numel()
    _checked(comm, "all_gather", check)
    flat = _adjacent(tensor_list)
    step = None
    if flat is None or (tensor.numel() and _overlaps(flat, tensor)):
        flat = tensor.new_empty(comm.size * tensor.numel())
        step = _copy_out(flat, tensor_list)
    work = comm.all_gather_single(flat, tensor.view(-1), async_op, algorithm=algorithm)
    return _then(work, step, tensor_list)


def reduce_scatter(comm: Communicator, output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   async_op: bool = False, *, algorithm: str = "auto") -> Work | None:
    """Reduce ``input_list[r]`` over the group into rank r's ``output`` (``torch.distributed.reduce_scatter``)."""
    def check() -> None:
        t = check_tensor("output", output, comm)
        _tensor_list("input_list", input_list, comm, t, t.numel())
    _checked(comm, "reduce_scatter", check)
    flat = _flat_in(input_list, output)
    if output.numel() and _overlaps(flat, output):  # the output is one of the inputs: reduce from a copy
        flat = flat.clone()
    return comm.reduce_scatter_single(output.view(-1), flat, op, async_op, algorithm=algorithm)


def all_to_all(comm: Communicator, output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               async_op: bool = False, *, algorithm: str = "auto") -> Work | None:
    """Send ``input_tensor_list[q]`` to rank q; receive rank q's into ``output_tensor_list[q]``."""
    def check() -> None:
        ins = _tensor_list("input_tensor_list", input_tensor_list, comm, None, None)
        _tensor_list("output_tensor_list", output_tensor_list, comm, ins[0], None)
    _checked(comm, "all_to_all", check)
    like = input_tensor_list[0]
    flat_in = _flat_in(input_tensor_list, like)
    out_sizes = [t.numel() for t in output_tensor_list]
    flat_out = _adjacent(output_tensor_list)
    step = None
    if flat_out is None or (flat_out.numel() and flat_in.numel() and _overlaps(flat_out, flat_in)):
        flat_out = like.new_empty(sum(out_sizes))
        step = _copy_out(flat_out, output_tensor_list)
    work = comm.all_to_all_single(flat_out, flat_in, out_sizes, [t.numel() for t in input_tensor_list], async_op,
                                  algorithm=algorithm)
    return _then(work, step, output_tensor_list)


def _root_list(comm: Communicator, verb: str, list_name: str, ts: object, root: int, like: torch.Tensor) -> list[torch.Tensor]:
    """The root's list (checked), or [] on the other ranks, where torch wants none."""
    side = "destination" if verb == "gather" else "source"
    if comm.rank == root:
        if ts is None or (isinstance(ts, list) and not ts):
            raise InvalidArgumentError(list_name, ts, f"is required on the {side} rank (group rank {root}) "
                                       f"(torch: \"Argument ``{list_name}`` must be specified on {side} rank.\")",
                                       f"pass {list_name} as a list of {comm.size} tensors there")
        return _tensor_list(list_name, ts, comm, like, like.numel())
    if ts is not None and not (isinstance(ts, list) and not ts):
        raise InvalidArgumentError(list_name, ts, f"is given on a non-{side} rank (torch: \"Argument ``{list_name}`` "
                                   f"must NOT be specified on non-{side} ranks.\")",
                                   f"pass {list_name}=None on every rank but the {side} (group rank {root})")
    return []


def _rooted(comm: Communicator, verb: str, tensor: object, ts: object, value: int | None,
            group_value: int | None) -> tuple[int, list[torch.Tensor]]:
    """A gather's or scatter's checked arguments: the root's group rank (global rank 0 where
    neither root argument is given, as torch) and the root's list ([] elsewhere)."""
    src = verb == "scatter"
    name, group_name, list_name = ("src", "group_src", "scatter_list") if src else ("dst", "group_dst", "gather_list")

    def check() -> tuple[int, list[torch.Tensor]]:
        t = check_tensor("tensor", tensor, comm)
        root = check_root(comm, name, group_name, 0 if value is None and group_value is None else value, group_value)
        return root, _root_list(comm, verb, list_name, ts, root, t)
    return _checked(comm, verb, check)  # type: ignore[no-any-return]


def gather(comm: Communicator, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
           dst: int | None = None, async_op: bool = False, *, group_dst: int | None = None,
           algorithm: str = "auto") -> Work | None:
    """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst`` (or group rank ``group_dst``)."""
    root, outs = _rooted(comm, "gather", tensor, gather_list, dst, group_dst)
    n, w = tensor.numel(), comm.size
    send = tensor.view(-1)
    step = None
    if comm.rank == root:
        flat = _adjacent(outs)
        if flat is None or (n and _overlaps(flat, send)):
            flat = tensor.new_empty(w * n)
            step = _copy_out(flat, outs)
        out_sizes = [n] * w
    else:
        flat, out_sizes = tensor.new_empty(0), [0] * w
    in_sizes = [n if q == root else 0 for q in range(w)]
    work = comm.all_to_all_single(flat, send, out_sizes, in_sizes, async_op, algorithm=algorithm)
    return _then(work, step, outs)


def scatter(comm: Communicator, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
            src: int | None = None, async_op: bool = False, *, group_src: int | None = None,
            algorithm: str = "auto") -> Work | None:
    """Rank r receives ``scatter_list[r]`` of global rank ``src`` (or group rank ``group_src``) into ``tensor``."""
    root, ins = _rooted(comm, "scatter", tensor, scatter_list, src, group_src)
    n, w = tensor.numel(), comm.size
    recv = tensor.view(-1)
    if comm.rank == root:
        flat_in, in_sizes = _flat_in(ins, tensor), [n] * w
    else:
        flat_in, in_sizes = tensor.new_empty(0), [0] * w
    step = None
    if n and flat_in.numel() and _overlaps(flat_in, recv):  # the root's own share is its tensor: receive into a copy
        recv = tensor.new_empty(n)
        step = _copy_out(recv, [tensor])
    out_sizes = [n if q == root else 0 for q in range(w)]
    work = comm.all_to_all_single(recv, flat_in, out_sizes, in_sizes, async_op, algorithm=algorithm)
    return _then(work, step, [tensor])
