"""GEMM + collective operators, each equal to a plain sequence that ships beside it as its reference.

Design note. An operator takes the GEMM's operands and the group, checks them, flattens them to
rows and runs one strategy (``overlap/strategies/``, one module each behind one contract,
registered by name; this module never tests a strategy's name):

* ``sequential``: the GEMM, then the collective (through ``collectives``, so ``auto`` picks its
  algorithm): the baseline, and what ``auto`` runs wherever overlap is not known to pay;
* ``chunked``: the GEMM in chunks, each chunk's collective issued asynchronously as soon as the
  chunk is computed, so that it runs while the next chunk is computed;
* ``copy_engine`` (the GPUs of one node): the data moves by copy engines through peer memory
  while the GEMM chunks run, and reductions ride in the GEMM's epilogue (``_copy_engine.py``).

Chunk counts and the choice between strategies come from measurements (``launch/bench_overlap.py``);
until a machine has them, ``auto`` runs ``sequential`` and says so. Shapes follow torch:
``a`` is ``[..., K]``, ``b`` is ``[K, N]``, the result ``[..., N]``; the collective's dimension
(``scatter_dim``/``gather_dim``) indexes the result (``a``'s leading dimensions).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist

import collectives as C
from collectives import _env
from collectives import _ops as _c_ops
from collectives import _traced
from collectives.errors import InvalidArgumentError, UnsupportedError

from .strategies import REGISTRY

__all__ = [
    "gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm",
    "reference_gemm_all_reduce", "reference_gemm_reduce_scatter", "reference_all_gather_gemm",
    "OverlapChoice", "last_choice", "set_tuned", "tuned_table", "STRATEGIES",
]

STRATEGIES = REGISTRY  # name -> strategy (overlap/strategies/)
DEFAULT_CHUNKS = 4

# torch 2.13 renamed the single-tensor collectives; 2.11 only has the old names.
_rs_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ag_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class OverlapChoice:
    """The strategy that ran an operator call and why."""

    op: str
    strategy: str
    chunks: int
    reason: str


_LAST: WeakKeyDictionary[C.Communicator, OverlapChoice] = WeakKeyDictionary()


def last_choice(group: Any = None) -> OverlapChoice | None:
    """What the last operator call on ``group`` (from this process) ran, and why."""
    return _LAST.get(C.get_communicator(group))


# -- the plain sequences ---------------------------------------------------------------------------
def reference_gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, group: Any = None, *,
                              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``all_reduce(a @ b) + bias``, with torch.distributed."""
    out = torch.matmul(a, b)
    dist.all_reduce(out, group=group)
    return out if bias is None else out + bias


def reference_gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: Any = None, *,
                                  scatter_dim: int = 0) -> torch.Tensor:
    """``reduce_scatter(a @ b)`` along ``scatter_dim``, with torch.distributed."""
    full = torch.matmul(a, b).movedim(scatter_dim, 0).contiguous()
    w = dist.get_world_size(group)
    out = full.new_empty((full.shape[0] // w, *full.shape[1:]))
    _rs_tensor(out, full, group=group)
    return out.movedim(0, scatter_dim)


def reference_all_gather_gemm(a_shard: torch.Tensor, b: torch.Tensor, group: Any = None, *,
                              gather_dim: int = 0) -> torch.Tensor:
    """``all_gather(a_shard)`` along ``gather_dim``, then ``@ b``, with torch.distributed."""
    part = a_shard.movedim(gather_dim, 0).contiguous()
    w = dist.get_world_size(group)
    full = part.new_empty((part.shape[0] * w, *part.shape[1:]))
    _ag_tensor(full, part, group=group)
    return torch.matmul(full.movedim(0, gather_dim), b)


# -- checks ----------------------------------------------------------------------------------------
def _check_operands(op: str, a: Any, b: Any, name_a: str = "a") -> None:
    for name, t in ((name_a, a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise C.InvalidTypeError(name, t, f"is a {type(t).__name__}, not a torch.Tensor", f"pass {name} as a tensor")
    if b.dim() != 2:
        raise InvalidArgumentError("b", b, f"has {b.dim()} dimensions; {op} takes b as [K, N]", "pass a 2-D b")
    if a.dim() < 1 or a.shape[-1] != b.shape[0]:
        raise InvalidArgumentError(name_a, a, f"has inner dimension {a.shape[-1] if a.dim() else None} but b is "
                                   f"{tuple(b.shape)}", f"give {name_a} shape [..., {b.shape[0]}]")
    if a.device != b.device:
        raise InvalidArgumentError("b", b, f"is on {b.device} but {name_a} is on {a.device}", "put both on one device")
    if a.dtype != b.dtype:
        raise InvalidArgumentError("b", b, f"has dtype {b.dtype} but {name_a} has {a.dtype}", "give both one dtype")


def _check_dim(name: str, dim: int, t: torch.Tensor, leading: int) -> int:
    """``dim`` as a non-negative index into the result's leading dimensions (not the last)."""
    if not isinstance(dim, int) or not -leading - 1 <= dim < leading or dim == -1:
        raise InvalidArgumentError(name, dim, f"is not one of the leading dimensions of a {tuple(t.shape)} result",
                                   f"pass {name} in 0..{leading - 1}")
    return dim % (leading + 1)


_TUNED: dict[str, Any] = {}
# auto's decisions per (op, world, dtype, device type, M, K, N): a small call's budget has no room
# for a table search on every call.
_AUTO: dict[tuple[Any, ...], OverlapChoice] = {}


def set_tuned(table: Any) -> None:
    """Follow this tuned table (the dict ``launch/bench_overlap.py --tune`` or ``launch/bench_moe.py
    --tune`` writes, or its path) in ``strategy="auto"`` and ``forward_pipelined(chunks="auto")``;
    ``None`` goes back to ``COMMOPS_OVERLAP_TUNED``. Give every rank the same one."""
    if isinstance(table, (str, bytes)) or hasattr(table, "__fspath__"):
        table = json.loads(Path(table).read_text())
    _TUNED.clear()
    _AUTO.clear()
    if table is not None:
        _TUNED["table"] = table


def tuned_table() -> Any:
    """The tuned table ``strategy="auto"`` follows (:func:`set_tuned`'s, else the file named by
    ``COMMOPS_OVERLAP_TUNED``, read once), or None."""
    if "table" not in _TUNED:
        path = _env.OVERLAP_TUNED.get()
        if not path:
            return None
        set_tuned(path)
    return _TUNED["table"]


def _from_table(op: str, comm: C.Communicator, dtype: torch.dtype, m: int, k: int, n: int,
                graph: bool = False) -> OverlapChoice | None:
    """The table's strategy for the measured shape nearest in M with the same op, dtype, K and N,
    from the entries timed in the same mode (``graph``: while a CUDA graph is being captured,
    entries timed replaying graphs, where no host cost is paid), else from the other mode's."""
    table = tuned_table()
    if table is None or table.get("meta", {}).get("world", comm.size) != comm.size:
        return None
    name = str(dtype).removeprefix("torch.")
    rows = [e for e in table.get("entries", []) if e["op"] == op and e["dtype"] == name and e["K"] == k and e["N"] == n]
    same = [e for e in rows if bool(e.get("graph", False)) == graph]
    rows = same or rows
    if not rows:
        return None
    e = min(rows, key=lambda e: abs(math.log2(max(e["M"], 1)) - math.log2(max(m, 1))))
    mode = "graph" if e.get("graph") else "eager"
    return OverlapChoice(op, e["strategy"], int(e.get("chunks", 1)),
                         f"tuned table ({mode}): measured best for {op} {name} M={e['M']} K={k} N={n} "
                         f"({e.get('note', '')})")


# whether the current CUDA stream is being captured (torch's C accessor; its Python wrapper
# where the C one is missing)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing


def _strategy(op: str, comm: C.Communicator, strategy: str, chunks: int, a: torch.Tensor, b: torch.Tensor,
              m: int) -> OverlapChoice:
    if strategy not in ("auto", *STRATEGIES):
        raise UnsupportedError("strategy", strategy, f"is not a strategy of {op}", f"pass 'auto' or one of {list(STRATEGIES)}")
    if not isinstance(chunks, int) or chunks < 1:
        raise InvalidArgumentError("chunks", chunks, "must be a positive int", f"pass {DEFAULT_CHUNKS}")
    if strategy == "auto":
        # on every call of every operator: the cheap accessors (a device object or torch's
        # Python wrapper of the capture query costs more than the lookup itself)
        cuda = a.is_cuda
        graph = cuda and _capturing()
        k, n = b.shape
        key = (op, comm.size, a.dtype, "cuda" if cuda else a.device.type, m, k, n, graph)
        found = _AUTO.get(key)
        if found is None:
            found = _from_table(op, comm, a.dtype, m, b.shape[0], b.shape[1], graph)
            if found is None:
                where = "CUDA" if a.device.type == "cuda" else a.device.type
                found = OverlapChoice(op, "sequential", 1, f"no overlap measurement for {op} on {where} at this "
                                      "shape: the plain sequence (launch/bench_overlap.py --tune measures the others)")
            why = STRATEGIES[found.strategy].refuses(comm, op, a, b, found.chunks)
            if why:  # the table's entry was measured at another shape
                found = OverlapChoice(op, "sequential", 1, f"{found.reason}; but {found.strategy} cannot take this "
                                      f"shape: {why}")
            found = _capturable(op, comm, a, b, m, graph, found)
            _AUTO[key] = found
        return found
    why = STRATEGIES[strategy].unavailable(comm, a.device, a.dtype)
    if why:
        others = [name for name in STRATEGIES if name != strategy]
        raise UnsupportedError("strategy", strategy, f"cannot run here: {why}", f"use 'auto' or one of {others}")
    return OverlapChoice(op, strategy, chunks if STRATEGIES[strategy].chunked else 1, "requested by the caller")


def _capturable(op: str, comm: C.Communicator, a: torch.Tensor, b: torch.Tensor, m: int, graph: bool,
                found: OverlapChoice) -> OverlapChoice:
    """``found``, unless a capture chose a strategy whose buffers do not exist yet (the copy
    engines' peer buffers cannot be built while capturing: the sequence then, saying so).
    Eagerly, when the table's graph entry for this shape is such a strategy, build them now, so
    that a capture after this warm-up call can follow it."""
    if graph:
        if not STRATEGIES[found.strategy].ready_for(comm, op, a, b, found.chunks):
            return OverlapChoice(op, "sequential", 1, f"{found.reason}; but its buffers do not exist and "
                                 "cannot be built while capturing: call the operator once before capturing")
        return found
    if a.device.type == "cuda":
        in_graph = _from_table(op, comm, a.dtype, m, b.shape[0], b.shape[1], True)
        if in_graph is not None and not STRATEGIES[in_graph.strategy].unavailable(comm, a.device, a.dtype):
            # collective: every rank makes this call with this shape
            STRATEGIES[in_graph.strategy].prepare_for(comm, op, a, b, in_graph.chunks)
    return found


# -- operators -------------------------------------------------------------------------------------
def _gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, group: Any, bias: torch.Tensor | None, strategy: str,
                     chunks: int) -> torch.Tensor:
    """The primitive of ``gemm_all_reduce`` (see there), without autograd."""
    comm = C.get_communicator(group)
    choice = _LAST[comm] = _strategy("gemm_all_reduce", comm, strategy, chunks, a, b, a.numel() // max(1, a.shape[-1]))
    a2 = a.reshape(-1, a.shape[-1])
    out = STRATEGIES[choice.strategy].gemm_all_reduce(comm, a2, b, choice.chunks).view(*a.shape[:-1], b.shape[1])
    return out if bias is None else out + bias


def _gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: Any, scatter_dim: int, strategy: str,
                         chunks: int) -> torch.Tensor:
    """The primitive of ``gemm_reduce_scatter`` (see there), without autograd."""
    comm = C.get_communicator(group)
    d = _check_dim("scatter_dim", scatter_dim, a, a.dim() - 1)
    w = comm.size
    if a.shape[d] % w:
        raise InvalidArgumentError("scatter_dim", scatter_dim, f"has size {a.shape[d]}, which {w} ranks do not divide",
                                   f"make dimension {scatter_dim} a multiple of {w} or scatter along another")
    choice = _LAST[comm] = _strategy("gemm_reduce_scatter", comm, strategy, chunks, a, b, a.numel() // max(1, a.shape[-1]))
    lead = a.movedim(d, 0)
    rows = lead.reshape(-1, a.shape[-1])  # the scattered dimension first, flattened with the others
    out2 = STRATEGIES[choice.strategy].gemm_reduce_scatter(comm, rows, b, choice.chunks)
    return out2.view(lead.shape[0] // w, *lead.shape[1:-1], b.shape[1]).movedim(0, d)


def _all_gather_gemm(a_shard: torch.Tensor, b: torch.Tensor, group: Any, gather_dim: int, strategy: str,
                     chunks: int, keep_gathered: bool = False) -> Any:
    """The primitive of ``all_gather_gemm`` (see there), without autograd; with ``keep_gathered``
    also the gathered operand as rows ``[world * m, K]`` (for a backward)."""
    comm = C.get_communicator(group)
    d = _check_dim("gather_dim", gather_dim, a_shard, a_shard.dim() - 1)
    w = comm.size
    choice = _LAST[comm] = _strategy("all_gather_gemm", comm, strategy, chunks, a_shard, b,
                                     a_shard.numel() // max(1, a_shard.shape[-1]) * w)
    lead = a_shard.movedim(d, 0)
    rows = lead.reshape(-1, a_shard.shape[-1]).contiguous()
    n = b.shape[1]
    out2, full = STRATEGIES[choice.strategy].all_gather_gemm(comm, rows, b, choice.chunks, keep_gathered)
    out = out2.view(lead.shape[0] * w, *lead.shape[1:-1], n).movedim(0, d)
    if d:  # the plain sequence's matmul returns a contiguous result: so do we
        out = out.contiguous()
    return (out, full) if keep_gathered else out


# -- ops and autograd ------------------------------------------------------------------------------
# Each operator is also a torch.library op of collectives' namespace (torch.ops.commops.<name>,
# collectives/_ops.py says how ops name their group), with a shape-only fake implementation and
# its gradient registered: torch.compile keeps it in the graph, backward passes included, and
# the strategy is still chosen inside it when it runs. Backward passes follow the tensor-parallel
# convention (Megatron's mappings): an all-reduced result is the same on every rank and its loss
# is counted once, so its gradient needs no communication; a reduce-scattered or all-gathered
# result is a different slice on every rank, so its gradient is all-gathered, resp.
# reduce-scattered, overlapped with the GEMM it feeds. Results have the plain sequences' layouts.
_LIB = torch.library.Library("commops", "FRAGMENT")
SCHEMAS = {
    "gemm_all_reduce": "(Tensor a, Tensor b, Tensor? bias, str group, str strategy, int chunks) -> Tensor",
    # group_size: the result's shape depends on it (collectives/_ops.py says why it is an argument)
    "gemm_reduce_scatter": "(Tensor a, Tensor b, int scatter_dim, int group_size, str group, str strategy, "
                           "int chunks) -> Tensor",
    # the gathered operand too, as rows [world * m, K]: the weight gradient's
    "all_gather_gemm": "(Tensor a_shard, Tensor b, int gather_dim, int group_size, str group, str strategy, "
                       "int chunks) -> (Tensor, Tensor)",
}


def _group(name: str) -> Any:
    return _c_ops.communicator(name).group


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` (its sizes and strides, which the op's fake gives too) as a tensor that is not a view: an
    op's output that is a view of a temporary is refused by autograd when the caller then changes it
    in place (a model's ``out.add_(...)``)."""
    if t._base is None:
        return t
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


def _op_gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: str, strategy: str,
                        chunks: int) -> torch.Tensor:
    return _own(_gemm_all_reduce(a, b, _group(group), bias, strategy, chunks).contiguous())


def _op_gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, group_size: int, group: str,
                            strategy: str, chunks: int) -> torch.Tensor:
    _c_ops._check_size(group_size, group)
    return _own(_gemm_reduce_scatter(a, b, _group(group), scatter_dim, strategy, chunks))


def _op_all_gather_gemm(a_shard: torch.Tensor, b: torch.Tensor, gather_dim: int, group_size: int, group: str,
                        strategy: str, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    _c_ops._check_size(group_size, group)
    out, full = _all_gather_gemm(a_shard, b, _group(group), gather_dim, strategy, chunks, keep_gathered=True)
    return _own(out.contiguous()), _own(full.contiguous())


def _result_shape(a: torch.Tensor, b: torch.Tensor, dim: int | None = None, factor: float = 1) -> list[int]:
    shape = [*a.shape[:-1], b.shape[1]]
    if dim is not None:
        shape[dim] = int(shape[dim] * factor)
    return shape


def _fake_gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, group: str, strategy: str,
                          chunks: int) -> torch.Tensor:
    return a.new_empty(_result_shape(a, b))


def _fake_gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, group_size: int, group: str,
                              strategy: str, chunks: int) -> torch.Tensor:
    d = _check_dim("scatter_dim", scatter_dim, a, a.dim() - 1)
    w = group_size
    if a.shape[d] % w:
        raise InvalidArgumentError("scatter_dim", scatter_dim, f"has size {a.shape[d]}, which {w} ranks do not divide",
                                   f"make dimension {scatter_dim} a multiple of {w} or scatter along another")
    # the plain sequence's layout: the scattered dimension outermost in memory
    shape = _result_shape(a, b, d, 1 / w)
    return a.new_empty((shape[d], *shape[:d], *shape[d + 1:])).movedim(0, d)


def _fake_all_gather_gemm(a_shard: torch.Tensor, b: torch.Tensor, gather_dim: int, group_size: int, group: str,
                          strategy: str, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = _check_dim("gather_dim", gather_dim, a_shard, a_shard.dim() - 1)
    w = group_size
    rows = a_shard.numel() // max(1, a_shard.shape[-1]) * w
    return a_shard.new_empty(_result_shape(a_shard, b, d, w)), a_shard.new_empty((rows, a_shard.shape[-1]))


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    return t.movedim(d, 0).reshape(-1, t.shape[-1])


def _setup_gemm_all_reduce(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    a, b, bias = inputs[:3]
    ctx.save_for_backward(a, b)
    ctx.bias_shape = None if bias is None else bias.shape


def _backward_gemm_all_reduce(ctx: Any, g: torch.Tensor) -> Any:
    a, b = ctx.saved_tensors
    ga = torch.matmul(g, b.t()) if ctx.needs_input_grad[0] else None
    gb = _rows(a, 0).t() @ _rows(g, 0) if ctx.needs_input_grad[1] else None
    gbias = g.sum_to_size(ctx.bias_shape) if ctx.bias_shape is not None and ctx.needs_input_grad[2] else None
    return ga, gb, gbias, None, None, None


def _setup_gemm_reduce_scatter(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    a, b, ctx.dim, ctx.size, ctx.group, ctx.strategy, ctx.chunks = inputs
    ctx.save_for_backward(a, b)


def _backward_gemm_reduce_scatter(ctx: Any, g: torch.Tensor) -> Any:
    a, b = ctx.saved_tensors
    d = ctx.dim % a.dim()
    # the gradient's all-gather, overlapped with the data-gradient GEMM
    ga, g_rows = torch.ops.commops.all_gather_gemm(g.contiguous(), b.t().contiguous(), d, ctx.size, ctx.group,
                                                   ctx.strategy, ctx.chunks)
    gb = _rows(a, d).t() @ g_rows if ctx.needs_input_grad[1] else None
    return (ga if ctx.needs_input_grad[0] else None), gb, None, None, None, None, None


def _setup_all_gather_gemm(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    _, b, ctx.dim, ctx.size, ctx.group, ctx.strategy, ctx.chunks = inputs
    ctx.save_for_backward(output[1], b)


def _backward_all_gather_gemm(ctx: Any, g: torch.Tensor, _g_gathered: Any) -> Any:
    full_rows, b = ctx.saved_tensors
    d = ctx.dim % g.dim()
    gb = full_rows.t() @ _rows(g, d) if ctx.needs_input_grad[1] else None
    # the data gradient's reduce-scatter, overlapped with its GEMM
    ga = torch.ops.commops.gemm_reduce_scatter(g.contiguous(), b.t().contiguous(), d, ctx.size, ctx.group,
                                               ctx.strategy, ctx.chunks) if ctx.needs_input_grad[0] else None
    return ga, gb, None, None, None, None, None


def _register() -> None:
    kernels: dict[str, Callable[..., Any]] = {
        "gemm_all_reduce": _op_gemm_all_reduce, "gemm_reduce_scatter": _op_gemm_reduce_scatter,
        "all_gather_gemm": _op_all_gather_gemm}
    fakes: dict[str, Callable[..., Any]] = {
        "gemm_all_reduce": _fake_gemm_all_reduce, "gemm_reduce_scatter": _fake_gemm_reduce_scatter,
        "all_gather_gemm": _fake_all_gather_gemm}
    gradients: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
        "gemm_all_reduce": (_backward_gemm_all_reduce, _setup_gemm_all_reduce),
        "gemm_reduce_scatter": (_backward_gemm_reduce_scatter, _setup_gemm_reduce_scatter),
        "all_gather_gemm": (_backward_all_gather_gemm, _setup_all_gather_gemm)}
    if _c_ops.defined("gemm_all_reduce"):  # this module imported again (its first copy's ops serve)
        return
    for name, schema in SCHEMAS.items():
        _LIB.define(name + schema)
        _LIB.impl(name, kernels[name], "CompositeExplicitAutograd")
        torch.library.register_fake(f"commops::{name}", fakes[name], lib=_LIB)
        backward, setup = gradients[name]
        torch.library.register_autograd(f"commops::{name}", backward, setup_context=setup, lib=_LIB)


_register()


# -- public operators ------------------------------------------------------------------------------
_compiling = torch.compiler.is_compiling


def _direct(*ts: torch.Tensor | None) -> bool:
    """Whether to run the primitive without the op: eager, and nothing for autograd to record
    (the dispatcher's round trip is a measurable share of a decode-sized call's host time)."""
    return not _compiling() and not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts))


def gemm_all_reduce(a: torch.Tensor, b: torch.Tensor, group: Any = None, *, bias: torch.Tensor | None = None,
                    strategy: str = "auto", chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """``all_reduce(a @ b) + bias`` (``reference_gemm_all_reduce``), the bias added once.

    Args:
        a: ``[..., K]``, this rank's partial operand (e.g. a row-parallel layer's input shard).
        b: ``[K, N]``.
        group: the process group (default: world); every rank passes the same shapes and dtype.
        bias: broadcastable to the ``[..., N]`` result, added after the reduction.
        strategy: "auto", "sequential", "chunked" (``chunks`` row blocks of ``a``) or "copy_engine"
            (``chunks`` per rank's row block).
    Returns:
        A new ``[..., N]`` tensor, the same on every rank. The op ``torch.ops.commops.gemm_all_reduce``
        paired with ``_backward_gemm_all_reduce``: the backward pass communicates nothing.
    """
    _check_operands("gemm_all_reduce", a, b)
    if _direct(a, b, bias):
        return _gemm_all_reduce(a, b, group, bias, strategy, chunks)
    return torch.ops.commops.gemm_all_reduce(a, b, bias, _c_ops.group_name(group), strategy, chunks)


def gemm_reduce_scatter(a: torch.Tensor, b: torch.Tensor, group: Any = None, *, scatter_dim: int = 0,
                        strategy: str = "auto", chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """``reduce_scatter(a @ b)`` along ``scatter_dim`` (``reference_gemm_reduce_scatter``).

    Args:
        a: ``[..., K]``; the result's dimension ``scatter_dim`` (one of ``a``'s leading ones) must
            be a multiple of the group's size.
        b: ``[K, N]``.
        scatter_dim: the dimension of the result that is reduced and split across ranks.
        strategy: "auto", "sequential", "chunked" (``chunks`` column blocks of ``b``) or
            "copy_engine" (``chunks`` per rank's row block).
    Returns:
        This rank's slice: the result with ``scatter_dim`` divided by the group's size. The op
        ``torch.ops.commops.gemm_reduce_scatter`` paired with ``_backward_gemm_reduce_scatter``:
        the backward all-gathers the gradient, overlapped with the data-gradient GEMM.
    """
    _check_operands("gemm_reduce_scatter", a, b)
    if _direct(a, b):
        return _gemm_reduce_scatter(a, b, group, scatter_dim, strategy, chunks)
    return torch.ops.commops.gemm_reduce_scatter(a, b, scatter_dim, _traced.group_size(group), _c_ops.group_name(group),
                                                 strategy, chunks)


def all_gather_gemm(a_shard: torch.Tensor, b: torch.Tensor, group: Any = None, *, gather_dim: int = 0,
                    strategy: str = "auto", chunks: int = DEFAULT_CHUNKS) -> torch.Tensor:
    """``all_gather(a_shard)`` along ``gather_dim``, then ``@ b`` (``reference_all_gather_gemm``).

    Args:
        a_shard: ``[..., K]``, this rank's slice of the full operand along ``gather_dim``.
        b: ``[K, N]`` (a column-parallel layer's weight shard, transposed).
        gather_dim: the dimension (one of ``a_shard``'s leading ones) the ranks' slices join along.
        strategy: "auto", "sequential", "chunked" or "copy_engine" (``chunks`` row blocks of every
            rank's slice).
    Returns:
        ``[..., N]`` with ``gather_dim`` multiplied by the group's size. The op
        ``torch.ops.commops.all_gather_gemm`` paired with ``_backward_all_gather_gemm``: the
        backward reduce-scatters the data gradient, overlapped with its GEMM; the gathered
        operand is kept for the weight gradient.
    """
    _check_operands("all_gather_gemm", a_shard, b, "a_shard")
    if _direct(a_shard, b):
        return _all_gather_gemm(a_shard, b, group, gather_dim, strategy, chunks)
    return torch.ops.commops.all_gather_gemm(a_shard, b, gather_dim, _traced.group_size(group),
                                             _c_ops.group_name(group), strategy, chunks)[0]
