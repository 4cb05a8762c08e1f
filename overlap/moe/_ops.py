"""The MoE layer's exchange and the low-latency pair as ``torch.ops.commops`` ops (for ``torch.compile``).

Design note. Under ``torch.compile`` the router of a ``MoELayer`` is traced like any module and
the rest (dispatch, experts, combine) is one op, ``moe_layer(x, topk_idx, topk_weights, params,
layer, keep)``, that finds its layer by name when it runs (vLLM's convention for its MoE layers):
its output has the input's shape, so the graph holds no shape that depends on the routing, and
the host-side plan of the exchanges (the routing handles, counts and index tensors, sized by the
data) never enters the graph. Its gradient is ``moe_layer_backward``: with ``keep`` (autograd
will need it) the op runs the block with autograd recording and keeps that eager graph under a
ticket, a one-element int64 tensor it returns; the backward op finds it by the ticket's value
and differentiates it (``torch.autograd.grad``). A kept graph is released by its backward or
when its ticket is freed without one. An op's implementation runs below the Autograd dispatch
key, where ``enable_grad`` alone records nothing, so the forward re-includes the autograd keys
while it records (``_recording``).

The low-latency pair has static shapes (``[E/W, capacity, hidden]`` blocks) and is two ops,
``moe_dispatch_low_latency(x, topk_idx, local_experts, capacity, dispatcher) -> (recv_x,
tokens_per_expert, ticket)`` and
``moe_combine_low_latency(expert_out, ticket, topk_weights, dispatcher)``; the handle's transport
state stays on the host under the ticket (``CompiledState`` in the traced handle holds it), and
the combine takes it. The dispatcher is found by name, like the layer.

Tried and rejected: dispatch and combine as two ops with the handle between them (the rows
received, and so every expert's GEMM, have data-dependent sizes, which the graph would hold as
unbacked sizes through the user's expert code; the handle's transport state is not a tensor).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from collectives import _ops as _c_ops
from collectives.errors import UnsupportedError

from .handles import LowLatencyHandle, TransportState

__all__ = ["SCHEMAS", "LAYERS", "DISPATCHERS", "CompiledState", "name_for", "traced_dispatch_low_latency",
           "traced_combine_low_latency"]

_LIB = torch.library.Library(_c_ops.NAMESPACE, "FRAGMENT")
SCHEMAS = {
    "moe_layer": "(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor[] params, str layer, bool keep) "
                 "-> (Tensor, Tensor)",
    # the gradients of x, topk_weights and each of params (zeros where none flows)
    "moe_layer_backward": "(Tensor grad, Tensor ticket, Tensor x, Tensor topk_weights, Tensor[] params) -> Tensor[]",
    # its blocks' shape as arguments: the graph states it (collectives/_ops.py says why)
    "moe_dispatch_low_latency": "(Tensor x, Tensor topk_idx, int local_experts, int capacity, str dispatcher) "
                                "-> (Tensor, Tensor, Tensor)",
    "moe_combine_low_latency": "(Tensor expert_out, Tensor ticket, Tensor topk_weights, str dispatcher) -> Tensor",
}

# what the ops find their layer and dispatcher by (MoELayer.op_name, MoEDispatcher.op_name)
LAYERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
DISPATCHERS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
_NAMES = itertools.count()


def name_for(obj: Any, registry: weakref.WeakValueDictionary[str, Any], prefix: str) -> str:
    """A new name for ``obj`` in ``registry``, under which the ops find it while it lives."""
    name = f"{prefix}{next(_NAMES)}"
    registry[name] = obj
    return name


def _found(registry: weakref.WeakValueDictionary[str, Any], what: str, name: str) -> Any:
    obj = registry.get(name)
    if obj is None:
        raise UnsupportedError(what, name, f"names no live {what}", f"keep the {what} alive while compiled code "
                               "that calls it runs")
    return obj


class _Tickets:
    """Host-side objects by ticket (a one-element int64 tensor), until the op that needs them takes them."""

    def __init__(self, what: str, fix: str) -> None:
        self._next = itertools.count(1)
        self._kept: dict[int, Any] = {}
        self._what, self._fix = what, fix

    def keep(self, obj: Any) -> torch.Tensor:
        n = next(self._next)
        self._kept[n] = obj
        ticket = torch.tensor([n], dtype=torch.int64)
        weakref.finalize(ticket, self._kept.pop, n, None)  # never taken: released with its ticket
        return ticket

    def take(self, ticket: torch.Tensor) -> Any:
        n = int(ticket.item())
        obj = self._kept.pop(n, None)
        if obj is None:
            raise UnsupportedError("ticket", n, f"names no kept {self._what} (already taken, or never kept)",
                                   self._fix)
        return obj


_GRAPHS = _Tickets("MoELayer graph", "run backward once per compiled forward (retain_graph=True is not "
                   "supported through a compiled MoELayer), with autograd on in the forward")
_HANDLES = _Tickets("low-latency dispatch", "combine each low-latency dispatch once")


# -- the layer -------------------------------------------------------------------------------------
# the dispatch keys that turn autograd's recording off below the Autograd kernel, which is where
# the dispatcher runs an op's implementation
_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor)


@contextlib.contextmanager
def _recording() -> Iterator[None]:
    """Autograd recording on inside an op's implementation (the eager graph ``moe_layer`` keeps)."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


def _moe_layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, params: list[torch.Tensor],
               layer: str, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    mod = _found(LAYERS, "MoELayer", layer)
    if not keep:
        with torch.no_grad():
            return mod._block(x, topk_idx, topk_weights), torch.zeros(1, dtype=torch.int64)
    with _recording():
        xl = x.detach().requires_grad_()
        wl = topk_weights.detach().requires_grad_()
        out = mod._block(xl, topk_idx, wl)
    # the module's own parameters (what the eager graph holds), in the order of params
    return out.detach(), _GRAPHS.keep((out, xl, wl, list(mod.experts.parameters())))


def _moe_layer_backward(grad: torch.Tensor, ticket: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                        params: list[torch.Tensor]) -> list[torch.Tensor]:
    out, xl, wl, own = _GRAPHS.take(ticket)
    inputs = [xl, wl, *own]
    if not out.requires_grad:  # nothing was recorded (no tokens reached any expert): no gradient flows
        return [torch.zeros_like(t) for t in inputs]
    wanted = [t for t in inputs if t.requires_grad]
    grads = dict(zip(map(id, wanted), torch.autograd.grad(out, wanted, grad, allow_unused=True), strict=True))
    return [g if (g := grads.get(id(t))) is not None else torch.zeros_like(t) for t in inputs]


def _fake_moe_layer(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, params: list[torch.Tensor],
                    layer: str, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty(1, dtype=torch.int64)


def _fake_moe_layer_backward(grad: torch.Tensor, ticket: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                             params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in (x, topk_weights, *params)]


def _setup_moe_layer(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    x, _, w, params, _, ctx.keep = inputs
    ctx.save_for_backward(output[1], x, w, *params)


def _backward_moe_layer(ctx: Any, grad: torch.Tensor, _grad_ticket: Any) -> Any:
    if not ctx.keep:
        raise UnsupportedError("keep", False, "kept no graph for a backward pass", "call the layer with autograd on")
    ticket, x, w, *params = ctx.saved_tensors
    gx, gw, *gparams = torch.ops.commops.moe_layer_backward(grad.contiguous(), ticket, x, w, params)
    return gx, None, gw, gparams, None, None


# -- the low-latency pair --------------------------------------------------------------------------
class CompiledState(TransportState):
    """A traced low-latency dispatch's handle state: the ticket its transport state is kept under."""

    def __init__(self, ticket: torch.Tensor) -> None:
        self.ticket = ticket


def _dispatch_low_latency(x: torch.Tensor, topk_idx: torch.Tensor, local_experts: int, capacity: int,
                          dispatcher: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    disp = _found(DISPATCHERS, "MoEDispatcher", dispatcher)
    shape = (disp.local_experts, disp.transport_impl.low_latency_capacity())
    if (local_experts, capacity) != shape:
        raise UnsupportedError("capacity", (local_experts, capacity), f"is not the dispatcher's blocks {shape} "
                               "(the graph was traced for another dispatcher or group size)",
                               "compile the function again for this dispatcher")
    recv, handle = disp.dispatch_low_latency(x, topk_idx)
    return recv.clone(), handle.tokens_per_expert.clone(), _HANDLES.keep(handle)


def _combine_low_latency(expert_out: torch.Tensor, ticket: torch.Tensor, topk_weights: torch.Tensor,
                         dispatcher: str) -> torch.Tensor:
    return _found(DISPATCHERS, "MoEDispatcher", dispatcher).combine_low_latency(expert_out, _HANDLES.take(ticket),
                                                                               topk_weights)


def _fake_dispatch_low_latency(x: torch.Tensor, topk_idx: torch.Tensor, local_experts: int, capacity: int,
                               dispatcher: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (x.new_empty((local_experts, capacity, x.shape[1])),
            torch.empty(local_experts, dtype=torch.int64, device=x.device), torch.empty(1, dtype=torch.int64))


def _fake_combine_low_latency(expert_out: torch.Tensor, ticket: torch.Tensor, topk_weights: torch.Tensor,
                              dispatcher: str) -> torch.Tensor:
    return expert_out.new_empty((topk_weights.shape[0], expert_out.shape[-1]))


def traced_dispatch_low_latency(disp: Any, x: torch.Tensor, topk_idx: torch.Tensor
                                ) -> tuple[torch.Tensor, LowLatencyHandle]:
    """``MoEDispatcher.dispatch_low_latency`` under torch.compile: the op, and a handle holding its ticket."""
    cap = disp.transport_impl.low_latency_capacity()
    recv, counts, ticket = torch.ops.commops.moe_dispatch_low_latency(x, topk_idx, disp.local_experts, cap,
                                                                      disp.op_name)
    return recv, LowLatencyHandle(counts, cap, x.shape[0], topk_idx.shape[1], CompiledState(ticket))


def traced_combine_low_latency(disp: Any, expert_out: torch.Tensor, handle: LowLatencyHandle,
                               topk_weights: torch.Tensor) -> torch.Tensor:
    """``MoEDispatcher.combine_low_latency`` under torch.compile, of a traced dispatch's handle."""
    state = handle.state
    if not isinstance(state, CompiledState):
        raise UnsupportedError("handle", "an eager low-latency handle", "cannot be combined in compiled code",
                               "dispatch and combine in the same compiled function, or both eagerly")
    return torch.ops.commops.moe_combine_low_latency(expert_out, state.ticket, topk_weights, disp.op_name)


def _register() -> None:
    if _c_ops.defined("moe_layer"):  # this module imported again (its first copy's ops serve)
        return
    kernels: dict[str, Callable[..., Any]] = {
        "moe_layer": _moe_layer, "moe_layer_backward": _moe_layer_backward,
        "moe_dispatch_low_latency": _dispatch_low_latency, "moe_combine_low_latency": _combine_low_latency}
    fakes: dict[str, Callable[..., Any]] = {
        "moe_layer": _fake_moe_layer, "moe_layer_backward": _fake_moe_layer_backward,
        "moe_dispatch_low_latency": _fake_dispatch_low_latency, "moe_combine_low_latency": _fake_combine_low_latency}
    for name, schema in SCHEMAS.items():
        _LIB.define(name + schema)
        _LIB.impl(name, kernels[name], "CompositeExplicitAutograd")
        torch.library.register_fake(f"commops::{name}", fakes[name], lib=_LIB)
    torch.library.register_autograd("commops::moe_layer", _backward_moe_layer, setup_context=_setup_moe_layer,
                                    lib=_LIB)


_register()
