"""``MoELayer``: a mixture-of-experts MLP with expert parallelism (router, dispatch, experts, combine).

Design note. The layer is the plain composition: a replicated top-k softmax router (Mixtral's
renormalised choice), ``MoEDispatcher`` for the exchanges and ``GroupedSwiGLU`` for this rank's
experts, the forward going through ``MoEDispatcher.forward_pipelined`` so that a tuned table or
the caller's ``chunks`` can pipeline it. It lives beside the dispatcher (``overlap.layers``
re-exports it with the tensor-parallel layers) because it only composes MoE parts.

Under ``torch.compile`` the router is traced like any module and the rest (dispatch, experts,
combine) is one op, ``torch.ops.commops.moe_layer(x, topk_idx, topk_weights, params, layer,
keep)``, that finds its layer by name when it runs (vLLM's convention for its MoE layers): its
output has the input's shape, so the graph has no shape that depends on the routing, and the
host-side plan of the exchanges (the routing handles, counts and index tensors, sized by the
data) never enters the graph. Its gradient is ``moe_layer_backward``: with ``keep`` (autograd
will need it) the op runs the block with autograd on and keeps that eager graph under a ticket,
a one-element int64 tensor it returns; the backward op finds it by the ticket's value and
differentiates it (``torch.autograd.grad``). A kept graph is released by its backward or when
its ticket is freed without one. Tried and rejected: dispatch and combine as two ops with the
handle between them (the rows received, and so every expert's GEMM, have data-dependent sizes,
which the graph would hold as unbacked sizes through the user's expert code; the handle's
transport state is not a tensor).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import collectives as C
from collectives import _ops as _c_ops
from collectives.errors import InvalidArgumentError, UnsupportedError

from .dispatcher import MoEDispatcher
from .experts import GroupedSwiGLU
from .transport import TransportOptions

__all__ = ["MoELayer"]


class MoELayer(nn.Module):
    """A mixture-of-experts MLP with expert parallelism: top-k softmax router, SwiGLU experts.

    The router (``[num_experts, hidden]``, no bias) is replicated: it is initialised on rank 0
    and broadcast (construction is collective). Routing: softmax over the experts, the ``top_k`` largest, renormalised to sum
    to one (Mixtral's choice). Rank r holds experts ``r*E/W ... (r+1)*E/W - 1``
    (``GroupedSwiGLU``); tokens travel through ``MoEDispatcher``.

    Args:
        hidden, ffn_hidden: the model's width and each expert's inner width.
        num_experts: ``E``, divisible by the group's size.
        top_k: experts per token.
        group: the expert-parallel group (default: world).
        capacity_factor: ``None`` (dropless) or each expert's capacity factor.
        chunks: the pipeline's chunks (``MoEDispatcher.forward_pipelined``): "auto", a count, or
            "sources" (inference over transport "peer" with pipeline_transfers="copy_engine": the
            pipeline by source rank).
        transport: a registered transport's name or its options object (``MoEDispatcher``), e.g.
            ``PeerOptions(max_tokens=4096, top_k=2)``; :meth:`close` releases its buffers, if any
            (collectively).
        max_tokens, routing, exchange_pieces, pipeline_transfers: with a transport's name, its
            options as keyword arguments (``MoEDispatcher``; transport "peer" needs ``max_tokens``,
            the most tokens one forward takes on any rank, and takes this layer's ``top_k``).

    ``forward(x)`` takes this rank's tokens ``[..., hidden]`` (any count, zero included) and
    returns the same shape; every rank calls it together.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int, group: Any = None, *,
                 dtype: torch.dtype | None = None, device: Any = None, capacity_factor: float | None = None,
                 chunks: int | str = "auto", exchange_pieces: int | None = None,
                 transport: str | TransportOptions = "nccl", max_tokens: int | None = None, routing: str | None = None,
                 pipeline_transfers: str | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise InvalidArgumentError("top_k", top_k, f"is not in 1..num_experts ({num_experts})", "pick fewer experts per token")
        self.group, self.top_k, self.chunks = group, top_k, chunks
        self.dispatcher = MoEDispatcher(num_experts, hidden, group, dtype=dtype, device=device,
                                        capacity_factor=capacity_factor, exchange_pieces=exchange_pieces,
                                        transport=transport, max_tokens=max_tokens,
                                        # a transport's options object carries its own top_k, if it has one
                                        top_k=top_k if isinstance(transport, str) else None, routing=routing,
                                        pipeline_transfers=pipeline_transfers)
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)
        if dist.get_world_size(group) > 1:
            C.broadcast(self.router.weight.data, group=group, group_src=0)
        self.experts = GroupedSwiGLU(self.dispatcher.local_experts, hidden, ffn_hidden, dtype=dtype, device=device)
        self.op_name = f"moe{next(_NAMES)}"  # what torch.ops.commops.moe_layer finds this layer by
        _LAYERS[self.op_name] = self

    def close(self) -> None:
        """Release the dispatcher's peer buffers, if any (collective)."""
        self.dispatcher.close()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(``topk_idx``, ``topk_weights``) for tokens ``x [tokens, hidden]``."""
        logits = self.router(x)
        # at least fp32: a bf16 softmax ties experts that fp32 tells apart
        probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
        w, idx = probs.topk(self.top_k, dim=-1)
        return idx, (w / w.sum(-1, keepdim=True)).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        idx, w = self.route(flat)
        if _compiling():
            params = list(self.experts.parameters())
            keep = torch.is_grad_enabled() and (flat.requires_grad or w.requires_grad or
                                                any(p.requires_grad for p in params))
            out = torch.ops.commops.moe_layer(flat, idx, w, params, self.op_name, keep)[0]
        else:
            out = self._block(flat, idx, w)
        return out.view(x.shape)

    def _block(self, flat: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Dispatch, experts and combine of routed tokens ``flat [tokens, hidden]``."""
        return self.dispatcher.forward_pipelined(flat, idx, w, self.experts, chunks=self.chunks)


# -- under torch.compile ---------------------------------------------------------------------------
_compiling = torch.compiler.is_compiling
_NAMES = itertools.count()
_LAYERS: weakref.WeakValueDictionary[str, MoELayer] = weakref.WeakValueDictionary()
_LIB = torch.library.Library(_c_ops.NAMESPACE, "FRAGMENT")
SCHEMAS = {
    "moe_layer": "(Tensor x, Tensor topk_idx, Tensor topk_weights, Tensor[] params, str layer, bool keep) "
                 "-> (Tensor, Tensor)",
    # the gradients of x, topk_weights and each of params (zeros where none flows)
    "moe_layer_backward": "(Tensor grad, Tensor ticket, Tensor x, Tensor topk_weights, Tensor[] params) -> Tensor[]",
}


class _Kept:
    """Eager autograd graphs of ``moe_layer`` calls, by ticket, until their backward takes them."""

    def __init__(self) -> None:
        self._next = itertools.count(1)
        self._graphs: dict[int, tuple[Any, ...]] = {}

    def keep(self, graph: tuple[Any, ...]) -> torch.Tensor:
        n = next(self._next)
        self._graphs[n] = graph
        ticket = torch.tensor([n], dtype=torch.int64)
        weakref.finalize(ticket, self._graphs.pop, n, None)  # no backward came: release it with its ticket
        return ticket

    def take(self, ticket: torch.Tensor) -> tuple[Any, ...]:
        n = int(ticket.item())
        graph = self._graphs.pop(n, None)
        if graph is None:
            raise UnsupportedError("ticket", n, "names no kept MoELayer graph (its backward already ran, or the "
                                   "forward ran without autograd)", "run backward once per compiled forward "
                                   "(retain_graph=True is not supported through a compiled MoELayer)")
        return graph


_KEPT = _Kept()


def _layer(name: str) -> MoELayer:
    layer = _LAYERS.get(name)
    if layer is None:
        raise UnsupportedError("layer", name, "names no live MoELayer", "keep the layer alive while compiled code "
                               "that calls it runs")
    return layer


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
    mod = _layer(layer)
    if not keep:
        with torch.no_grad():
            return mod._block(x, topk_idx, topk_weights), torch.zeros(1, dtype=torch.int64)
    with _recording():
        xl = x.detach().requires_grad_()
        wl = topk_weights.detach().requires_grad_()
        out = mod._block(xl, topk_idx, wl)
    # the module's own parameters (what the eager graph holds), in the order of params
    return out.detach(), _KEPT.keep((out, xl, wl, list(mod.experts.parameters())))


def _moe_layer_backward(grad: torch.Tensor, ticket: torch.Tensor, x: torch.Tensor, topk_weights: torch.Tensor,
                        params: list[torch.Tensor]) -> list[torch.Tensor]:
    out, xl, wl, own = _KEPT.take(ticket)
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


def _register() -> None:
    if _c_ops.defined("moe_layer"):  # this module imported again (its first copy's ops serve)
        return
    for name, schema in SCHEMAS.items():
        _LIB.define(name + schema)
    _LIB.impl("moe_layer", _moe_layer, "CompositeExplicitAutograd")
    _LIB.impl("moe_layer_backward", _moe_layer_backward, "CompositeExplicitAutograd")
    torch.library.register_fake("commops::moe_layer", _fake_moe_layer, lib=_LIB)
    torch.library.register_fake("commops::moe_layer_backward", _fake_moe_layer_backward, lib=_LIB)
    torch.library.register_autograd("commops::moe_layer", _backward_moe_layer, setup_context=_setup_moe_layer,
                                    lib=_LIB)


_register()
