"""``MoELayer``: a mixture-of-experts MLP with expert parallelism (router, dispatch, experts, combine).

Design note. The layer is the plain composition: a replicated top-k softmax router (Mixtral's
renormalised choice), ``MoEDispatcher`` for the exchanges and ``GroupedSwiGLU`` for this rank's
experts, the forward going through ``MoEDispatcher.forward_pipelined`` so that a tuned table or
the caller's ``chunks`` can pipeline it. It lives beside the dispatcher (``overlap.layers``
re-exports it with the tensor-parallel layers) because it only composes MoE parts.

Under ``torch.compile`` the router is traced and the rest is one op, ``moe_layer``
(``overlap/moe/_ops.py`` says how it keeps the routing out of the graph and differentiates it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import collectives as C
from collectives.errors import InvalidArgumentError, UnsupportedError

from . import _ops, fp8
from .dispatcher import MoEDispatcher
from .experts import GroupedSwiGLU
from .micro_batches import check_micro_batches
from .transport import TransportOptions

__all__ = ["MoELayer", "register_block", "routed_block"]


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
        micro_batches: more than 1: the forward runs ``MoEDispatcher.forward_micro_batches``
            (one micro-batch's exchanges travel while another's experts compute, with autograd,
            over any transport) instead of ``forward_pipelined``; then ``chunks`` must be "auto".
        shared_expert: a module ``[tokens, hidden] -> [tokens, hidden]`` every token also goes
            through (a model's shared expert; replicated, not expert-parallel), added to the
            routed experts' output; it runs while the first dispatch travels
            (``forward_micro_batches``, at ``micro_batches`` micro-batches, 1 included).
        fp8_dispatch: the tokens cross as e4m3 with a float32 scale per 128 elements
            (``MoEDispatcher.dispatch(..., fp8=True)``, ``fp8.py``; hidden a multiple of 128, a
            transport that moves packed rows: "nccl" or "peer"); the forward is then the plain
            dispatch -> experts -> combine (with ``micro_batches`` 1 and ``chunks`` "auto"), the
            shared expert added after it. Under ``torch.compile`` it runs inside the layer's op.
        fp8_experts: the FP8 dispatch (as ``fp8_dispatch``, which it implies) into FP8 experts:
            the received e4m3 rows go to e4m3 grouped GEMMs against blockwise-quantized weights
            (``GroupedSwiGLU(..., fp8=True)``, ``overlap/moe/_fp8_gemm.py``; ffn_hidden a multiple
            of 128 too); the backward runs in the layer's dtype from the saved FP8 rows.

    ``forward(x)`` takes this rank's tokens ``[..., hidden]`` (any count, zero included) and
    returns the same shape; every rank calls it together.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int, group: Any = None, *,
                 dtype: torch.dtype | None = None, device: Any = None, capacity_factor: float | None = None,
                 chunks: int | str = "auto", exchange_pieces: int | None = None,
                 transport: str | TransportOptions = "nccl", max_tokens: int | None = None, routing: str | None = None,
                 pipeline_transfers: str | None = None, micro_batches: int = 1,
                 shared_expert: nn.Module | None = None, fp8_dispatch: bool = False, fp8_experts: bool = False) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise InvalidArgumentError("top_k", top_k, f"is not in 1..num_experts ({num_experts})", "pick fewer experts per token")
        check_micro_batches(micro_batches)
        if micro_batches > 1 and chunks != "auto":
            raise InvalidArgumentError("chunks", chunks, f"cannot be set with micro_batches={micro_batches} (the "
                                       "micro-batches are the overlap)", "leave chunks='auto', or micro_batches=1")
        fp8_dispatch = fp8_dispatch or fp8_experts
        if fp8_dispatch and (micro_batches > 1 or chunks != "auto"):
            asked = f"micro_batches={micro_batches}" if micro_batches > 1 else f"chunks={chunks!r}"
            raise InvalidArgumentError("fp8_dispatch", fp8_dispatch, f"runs the plain sequence; {asked} asks for "
                                       "an overlap",
                                       "leave micro_batches=1 and chunks='auto', or fp8_dispatch=False")
        if fp8_dispatch and hidden % fp8.BLOCK:
            raise InvalidArgumentError("hidden", hidden, f"is not a multiple of {fp8.BLOCK} (one FP8 scale per "
                                       f"{fp8.BLOCK} elements)", "fp8_dispatch=False, or pad hidden")
        if fp8_experts and ffn_hidden % fp8.BLOCK:
            raise InvalidArgumentError("ffn_hidden", ffn_hidden, f"is not a multiple of {fp8.BLOCK} (FP8 experts scale "
                                       f"their weights per {fp8.BLOCK} x {fp8.BLOCK} block)",
                                       "fp8_experts=False, or pad ffn_hidden")
        self.group, self.top_k, self.chunks, self.micro_batches = group, top_k, chunks, micro_batches
        self.fp8_dispatch = fp8_dispatch
        self.dispatcher = MoEDispatcher(num_experts, hidden, group, dtype=dtype, device=device,
                                        capacity_factor=capacity_factor, exchange_pieces=exchange_pieces,
                                        transport=transport, max_tokens=max_tokens,
                                        # a transport's options object carries its own top_k, if it has one
                                        top_k=top_k if isinstance(transport, str) else None, routing=routing,
                                        pipeline_transfers=pipeline_transfers)
        if fp8_dispatch and not self.dispatcher.transport_impl.packed_rows:
            raise UnsupportedError("fp8_dispatch", True, f"needs a transport that moves packed rows; "
                                   f"{type(self.dispatcher.transport_impl).__name__} does not",
                                   "use transport='nccl' or 'peer', or fp8_dispatch=False")
        self.router = nn.Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)
        if dist.get_world_size(group) > 1:
            C.broadcast(self.router.weight.data, group=group, group_src=0)
        self.experts = GroupedSwiGLU(self.dispatcher.local_experts, hidden, ffn_hidden, dtype=dtype, device=device,
                                     fp8=fp8_experts)
        self.shared_expert = shared_expert
        self.op_name = register_block(self)

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
        if not _compiling():
            return self._block(flat, idx, w, self.shared_expert).view(x.shape)
        # the op differentiates the routed experts' parameters: the shared expert stays in the graph
        out = routed_block(self, flat, idx, w)
        return (out if self.shared_expert is None else out + self.shared_expert(flat)).view(x.shape)

    def _block(self, flat: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
               shared: nn.Module | None = None) -> torch.Tensor:
        """Dispatch, experts and combine of routed tokens ``flat [tokens, hidden]`` (plus
        ``shared(flat)``, overlapping the first dispatch, where given)."""
        if self.fp8_dispatch:
            out = self.dispatcher.forward(flat, idx, w, self.experts, fp8=True)
            return out if shared is None else out + shared(flat)
        if self.micro_batches > 1 or shared is not None:
            return self.dispatcher.forward_micro_batches(flat, idx, w, self.experts, self.micro_batches, shared)
        return self.dispatcher.forward_pipelined(flat, idx, w, self.experts, chunks=self.chunks)


def register_block(module: nn.Module) -> str:
    """Make ``module`` findable by ``torch.ops.commops.moe_layer`` (weakly held); the name to pass.

    ``module`` has ``_block(x [tokens, hidden], topk_idx, topk_weights) -> [tokens, hidden]`` (its
    dispatch, experts and combine) and ``experts``, the module whose parameters those use."""
    return _ops.name_for(module, _ops.LAYERS, "moe")


def routed_block(module: Any, flat: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``module._block(flat, idx, w)`` for routed tokens; under ``torch.compile`` the one op
    ``moe_layer`` (found by ``module.op_name``, from :func:`register_block`), so that the graph
    holds the exchange and the experts whole, their data-dependent shapes outside it."""
    if not _compiling():
        return module._block(flat, idx, w)  # type: ignore[no-any-return]
    params = list(module.experts.parameters())
    keep = torch.is_grad_enabled() and (flat.requires_grad or w.requires_grad or any(p.requires_grad for p in params))
    return torch.ops.commops.moe_layer(flat, idx, w, params, module.op_name, keep)[0]  # type: ignore[no-any-return]


_compiling = torch.compiler.is_compiling
