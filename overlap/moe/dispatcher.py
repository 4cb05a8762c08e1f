"""Expert-parallel dispatch and combine over a transport, and a pipelined forward.

Design note. ``MoEDispatcher`` holds what every transport shares: the checks of each call (shapes,
dtypes, the routing's ids), the flow (dispatch -> experts -> combine; the chunks of a pipelined
forward; ``chunks="auto"``) and autograd. The rows themselves travel through a transport built
from the registry (``transport.py``: the contract; ``nccl.py``: ``all_to_all_single``;
``peer.py``: peer-memory kernels on the GPUs of one node), which the dispatcher never asks the
name of. Dispatch and combine are each other's adjoints, which is how autograd differentiates
them: ``_Dispatch``'s backward is the transport's ``dispatch_backward`` (a combine without
weights), ``_Combine``'s its ``combine_backward`` (a dispatch of the output gradient scaled by
the weights, plus the weights' own gradient).

``forward_pipelined`` splits the tokens into chunks. Without autograd the transport's own
pipeline runs, where it has one (``Transport.pipeline``: over NCCL chunk i+1's dispatch and chunk
i-1's combine travel while the experts compute chunk i; over the peer transport its kernels on a
side stream, or copy engines); with autograd, or where it has none, the chunks run one after
another through the differentiable halves. ``chunks="auto"`` asks the transport
(``Transport.auto_chunks``: the peer transport follows a tuned table, ``tuned.py``), and runs one
chunk with autograd; ``chunks="sources"`` is the peer transport's pipeline by source rank. On
2xH200 no pipeline measured faster than one chunk (``nccl.py``, ``peer.py`` say by how much).

``forward_micro_batches`` overlaps at the level of the contract instead, over any transport and
with autograd: micro-batch i+1's dispatch and micro-batch i's combine travel on a side stream
while the experts compute (``micro_batches.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

import collectives as C
from collectives.errors import InvalidArgumentError, UnsupportedError

from . import _ops
from .handles import DispatchHandle, LowLatencyHandle
from .fp8 import dispatch_fp8, dispatch_fp8_experts
from .micro_batches import forward_micro_batches, micro_batch_bounds, run_experts
from .transport import (
    CombineGrads,
    Experts,
    Transport,
    TransportArguments,
    TransportOptions,
    TransportSetup,
    low_latency_transports,
    resolve_transport,
)

__all__ = ["MoEDispatcher"]

_compiling = torch.compiler.is_compiling


class _Dispatch(torch.autograd.Function):
    """``transport.dispatch`` (or ``dispatch_rows`` of an already routed handle), the handle put
    in ``box``; backward: ``transport.dispatch_backward``, a combine without weights."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_idx: torch.Tensor | None, handle: DispatchHandle | None,
                transport: Transport, box: list[DispatchHandle]) -> torch.Tensor:
        if handle is None:
            assert topk_idx is not None  # a dispatch routes its ids unless it has a handle
            recv, handle = transport.dispatch(x, topk_idx)
        else:
            recv = transport.dispatch_rows(x, handle)
        box.append(handle)
        ctx.handle, ctx.transport, ctx.shape = handle, transport, x.shape
        return recv

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return ctx.transport.dispatch_backward(g.contiguous(), ctx.handle).view(ctx.shape), None, None, None, None


class _Combine(torch.autograd.Function):
    """``transport.combine``; backward: ``transport.combine_backward`` on what combine saved."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle,
                transport: Transport) -> torch.Tensor:
        out, saved = transport.combine(rows, weights, handle, ctx.needs_input_grad[1])
        ctx.save_for_backward(*saved)
        ctx.handle, ctx.transport, ctx.wshape, ctx.wdtype = handle, transport, tuple(weights.shape), weights.dtype
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        wanted = CombineGrads(ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.wshape, ctx.wdtype)
        grad_rows, grad_weights = ctx.transport.combine_backward(g, ctx.handle, ctx.saved_tensors, wanted)
        return grad_rows, grad_weights, None, None


class _TransportAttributes:
    """The dispatcher's attributes that its transport answers: its options (read as the old
    keyword arguments of the same names, one of which can be set) and its records."""

    transport: str
    transport_impl: Transport

    @property
    def transport_options(self) -> TransportOptions:
        """The transport's options."""
        opts: TransportOptions = self.transport_impl.options
        return opts

    @property
    def max_tokens(self) -> int:
        """Transport "peer": the most tokens of one dispatch (0 where it does not apply)."""
        return self.transport_options.arguments().max_tokens or 0

    @property
    def top_k(self) -> int:
        """Transport "peer": the k of every routing (0 where it does not apply)."""
        return self.transport_options.arguments().top_k or 0

    @property
    def routing(self) -> str:
        """Transport "nccl": where it works out a routing ("auto" where it does not apply)."""
        return self.transport_options.arguments().routing or "auto"

    @property
    def exchange_pieces(self) -> int:
        """Transport "nccl": the pieces of each row exchange (1 where it does not apply)."""
        return self.transport_options.arguments().exchange_pieces or 1

    @property
    def pipeline_transfers(self) -> str:
        """Transport "peer": how its pipelines move rows ("auto" where it does not apply). Setting
        it (between calls, on every rank alike) replaces the transport's options."""
        return self.transport_options.arguments().pipeline_transfers or "auto"

    @pipeline_transfers.setter
    def pipeline_transfers(self, value: str) -> None:
        args = replace(self.transport_options.arguments(), pipeline_transfers=value)  # (checks the value)
        self.transport_impl.options = type(self.transport_options).from_arguments(args)

    @property
    def last_routing(self) -> tuple[str, str] | None:
        """(where, why) the transport last worked a routing out, where it chooses (transport "nccl")."""
        return self.transport_impl.last_routing

    @property
    def last_pipeline(self) -> tuple[str, str] | None:
        """(how, why) the transport's last pipeline moved rows, where it chooses (transport "peer")."""
        return self.transport_impl.last_pipeline

    @property
    def offers_low_latency(self) -> bool:
        """Whether the transport has the low-latency pair (``dispatch_low_latency``)."""
        return self.transport_impl.offers_low_latency


class MoEDispatcher(_TransportAttributes):
    """Dispatch tokens to their experts' ranks and combine the experts' outputs, for one group.

    Args:
        num_experts: ``E``, divisible by the group's size ``W``; rank r owns experts
            ``r*E/W ... (r+1)*E/W - 1``.
        hidden: the tokens' width.
        group: the expert-parallel group (default: world).
        dtype, device: of the tokens (checked on every call).
        capacity_factor: ``None`` (dropless) or the factor of each expert's capacity per rank,
            ``ceil(capacity_factor * tokens * k / E)`` pairs.
        transport: a registered transport's name ("nccl": ``all_to_all_single``, ``NcclOptions``;
            "peer": the GPUs of one node, SM kernels that pull each token once per rank from the
            peers' memory and return one partial sum per token and rank, ``PeerOptions``; see
            ``registered_transports()``), or a transport's options object, e.g.
            ``PeerOptions(max_tokens=4096, top_k=8)``, which picks that transport.
        max_tokens, top_k, routing, exchange_pieces, pipeline_transfers: with a transport's name,
            its options as keyword arguments (``NcclOptions``: ``routing``, ``exchange_pieces``;
            ``PeerOptions``: ``max_tokens`` and ``top_k``, required there, ``pipeline_transfers``);
            each is checked whatever the transport, and one that does not apply to it is ignored.
            Not with an options object.

    Every rank calls ``dispatch`` and ``combine`` the same number of times, in the same order
    (they communicate); token counts may differ between ranks, and may be zero. A transport that
    owns buffers (the peer transport's) builds them on first use; :meth:`close` releases them
    (collective).

    Attributes:
        transport: the transport's registered name.
        transport_impl: the transport (``Transport``), built for this dispatcher.
        last_chunks: (chunks, why) of the last ``forward_pipelined``.
        last_routing, last_pipeline: the transport's records of its choices (or ``None``).
    """

    def __init__(self, num_experts: int, hidden: int, group: Any = None, *, dtype: torch.dtype | None = None,
                 device: Any = None, capacity_factor: float | None = None, exchange_pieces: int | None = None,
                 transport: str | TransportOptions = "nccl", max_tokens: int | None = None, top_k: int | None = None,
                 routing: str | None = None, pipeline_transfers: str | None = None) -> None:
        comm = C.get_communicator(group)
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % comm.size:
            raise InvalidArgumentError("num_experts", num_experts, f"is not a positive multiple of the group's {comm.size} ranks",
                                       f"use a multiple of {comm.size} (each rank owns the same number of experts)")
        if capacity_factor is not None and not capacity_factor > 0:
            raise InvalidArgumentError("capacity_factor", capacity_factor, "must be positive or None", "pass e.g. 1.25, or None")
        self.group, self.comm = group, comm
        self.num_experts, self.hidden = num_experts, hidden
        self.local_experts = num_experts // comm.size
        self.first_expert = comm.rank * self.local_experts
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.capacity_factor = capacity_factor
        args = TransportArguments(max_tokens=max_tokens, top_k=top_k, routing=routing, exchange_pieces=exchange_pieces,
                                  pipeline_transfers=pipeline_transfers)
        spec, options = resolve_transport(transport, args)
        self.transport: str = spec.name
        setup = TransportSetup(comm, group, num_experts, hidden, dtype, self.device, capacity_factor)
        self.transport_impl: Transport = spec.factory(setup, options)
        self.last_chunks: tuple[int, str] | None = None
        self.exchange_streams: dict[torch.device, Any] = {}  # forward_micro_batches' side streams
        # what the low-latency ops find it by under torch.compile (overlap/moe/_ops.py)
        self.op_name = _ops.name_for(self, _ops.DISPATCHERS, "dispatcher")

    def close(self) -> None:
        """Release the transport's buffers, if any (collective). The dispatcher can be used
        again afterwards (it builds them anew)."""
        self.transport_impl.close()

    # -- routing ---------------------------------------------------------------------------------
    def _check(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            raise InvalidArgumentError("x", x, f"is not [tokens, {self.hidden}]", f"pass x as [tokens, {self.hidden}]")
        if self.dtype is not None and x.dtype != self.dtype:
            raise InvalidArgumentError("x", x, f"has dtype {x.dtype}, the dispatcher {self.dtype}", f"pass {self.dtype} tokens")
        if self.device is not None and x.device != self.device:
            raise InvalidArgumentError("x", x, f"is on {x.device}, the dispatcher on {self.device}", f"move x to {self.device}")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0] or topk_idx.dtype.is_floating_point:
            raise InvalidArgumentError("topk_idx", topk_idx, f"is not an integer [{x.shape[0]}, k] tensor",
                                       "pass the router's expert ids, one row per token")
        if topk_weights is not None and topk_weights.shape != topk_idx.shape:
            raise InvalidArgumentError("topk_weights", topk_weights, f"has shape {tuple(topk_weights.shape)}, topk_idx "
                                       f"{tuple(topk_idx.shape)}", "pass one weight per (token, expert) pair")

    def route(self, topk_idx: torch.Tensor) -> DispatchHandle:
        """The handle for routing ``topk_idx`` (exchanges the per-expert counts: collective)."""
        return self.route_chunks(topk_idx, [(0, topk_idx.shape[0])])[0]

    def route_chunks(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]]) -> list[DispatchHandle]:
        """One handle per token range of ``bounds``, with one exchange of every range's counts
        (``Transport.route``: over NCCL worked out on the host in numpy, or for a large batch of
        CUDA ids on their device; over the peer transport planned on the host from every rank's
        ids). The ids are checked before any row is sent, on every rank."""
        return self.transport_impl.route(topk_idx, bounds)

    def routes_on_device(self, topk_idx: torch.Tensor) -> bool:
        """Whether a dispatch of ``topk_idx`` works its routing out on the ids' device rather than
        on the host (``Transport.routes_on_device``; ``last_routing`` says why, where the
        transport chooses)."""
        return self.transport_impl.routes_on_device(topk_idx)

    # -- the two halves --------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor | None = None, *,
                 fp8: bool = False) -> tuple[torch.Tensor, DispatchHandle]:
        """``recv_x [received pairs, hidden]`` grouped by local expert, and the routing handle.

        Differentiable in ``x``: its backward is a combine without weights (``_Dispatch``, the
        transport's ``dispatch_backward``). ``topk_weights`` is only checked here; ``combine``
        takes it. ``fp8``: the rows cross as e4m3 with a float32 scale per 128 elements, arrive
        and go back (backward) in ``x``'s dtype (``fp8.py``; hidden % 128 == 0; transport "nccl" or "peer")."""
        self._check(x, topk_idx, topk_weights)
        self.transport_impl.check_tokens(x)
        if fp8:
            return dispatch_fp8(self.transport_impl, x, topk_idx)
        return self._dispatch(x, topk_idx, None)

    def _dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor | None, handle: DispatchHandle | None
                  ) -> tuple[torch.Tensor, DispatchHandle]:
        """Through ``_Dispatch`` where ``x`` needs a gradient, else the same call without
        autograd's bookkeeping; ``handle``: already routed."""
        t = self.transport_impl
        if torch.is_grad_enabled() and x.requires_grad:
            box: list[DispatchHandle] = []
            recv = _Dispatch.apply(x, topk_idx, handle, t, box)
            return recv, box[0]
        if handle is None:
            assert topk_idx is not None  # a dispatch routes its ids unless it has a handle
            return t.dispatch(x, topk_idx)
        return t.dispatch_rows(x, handle), handle

    def combine(self, expert_out: torch.Tensor, handle: DispatchHandle, topk_weights: torch.Tensor) -> torch.Tensor:
        """``out [tokens, hidden]``, ``out[t] = sum_j topk_weights[t, j] * expert_out`` of pair (t, j).

        Differentiable in ``expert_out`` and ``topk_weights`` (``_Combine``: its backward is a
        dispatch of the output gradient scaled by the weights).
        """
        if expert_out.shape[0] != sum(handle.tokens_per_expert):
            raise InvalidArgumentError("expert_out", expert_out, f"has {expert_out.shape[0]} rows; the dispatch "
                                       f"delivered {sum(handle.tokens_per_expert)}", "pass rows in recv_x's layout")
        return self._combine(expert_out, topk_weights, handle)

    def _combine(self, rows: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Through ``_Combine`` where either input needs a gradient, else the same call without
        autograd's bookkeeping (the weights' ``requires_grad`` still says how the rows return)."""
        if torch.is_grad_enabled() and (rows.requires_grad or weights.requires_grad):
            return _Combine.apply(rows, weights, handle, self.transport_impl)
        return self.transport_impl.combine(rows, weights, handle, weights.requires_grad)[0]

    # -- the low-latency pair --------------------------------------------------------------------
    def _refuse_low_latency(self) -> None:
        if not self.transport_impl.offers_low_latency or self.capacity_factor is not None:
            names = " or ".join(f"transport={n!r}" for n in low_latency_transports()) or "a transport that offers one"
            raise UnsupportedError("transport", self.transport, f"has no low-latency dispatch here (it needs {names} "
                                   "and no capacity_factor)", f"build the dispatcher with {names}, dropless")

    def dispatch_low_latency(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, LowLatencyHandle]:
        """``recv_x [E/W, capacity, hidden]`` and its handle, without waiting for the host.

        The decode-time dispatch: every local expert gets a block of ``capacity`` rows (over the
        peer transport ``W * max_tokens``), its own rows first (``handle.tokens_per_expert``, on
        the device). Nothing here waits for the GPUs, so a dispatch, the experts
        (``GroupedSwiGLU.forward_padded``, given ``handle.tokens_per_expert`` to compute only the
        counted rows) and ``combine_low_latency`` can be captured in one CUDA graph and replayed.
        Where the transport offers it (``offers_low_latency``: transport "peer"), dropless,
        without autograd. The ids are not checked before the exchange (that would wait):
        ``check_routing(handle, topk_idx)`` does, waiting. Under ``torch.compile`` it is the op
        ``torch.ops.commops.moe_dispatch_low_latency`` (``overlap/moe/_ops.py``), and its handle
        is combined in the same compiled function.
        """
        if _compiling():
            return _ops.traced_dispatch_low_latency(self, x, topk_idx)
        self._check(x, topk_idx, None)
        self._refuse_low_latency()
        if torch.is_grad_enabled() and x.requires_grad:
            raise UnsupportedError("x", "a tensor that requires grad", "cannot go through the low-latency dispatch, "
                                   "which keeps no plan for a backward pass", "use dispatch(), or run under torch.no_grad()")
        self.transport_impl.check_tokens(x)
        return self.transport_impl.dispatch_low_latency(x, topk_idx)

    def combine_low_latency(self, expert_out: torch.Tensor, handle: LowLatencyHandle,
                            topk_weights: torch.Tensor) -> torch.Tensor:
        """``out [tokens, hidden]`` from ``expert_out [E/W, capacity, hidden]`` (``dispatch_low_latency``'s
        layout); only each block's first ``tokens_per_expert`` rows are read."""
        if _compiling():
            return _ops.traced_combine_low_latency(self, expert_out, handle, topk_weights)
        self._refuse_low_latency()
        return self.transport_impl.combine_low_latency(expert_out, handle, topk_weights)

    def check_routing(self, handle: LowLatencyHandle, topk_idx: torch.Tensor) -> None:
        """Raise ``InvalidArgumentError`` on every rank if any rank's ids in this low-latency
        dispatch were out of range or repeated an expert (waits for the dispatch)."""
        self._refuse_low_latency()
        self.transport_impl.check_routing(handle, topk_idx)

    # -- the forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                experts: Experts, *, fp8: bool = False) -> torch.Tensor:
        """dispatch (``fp8``: as ``dispatch``'s; FP8 experts: ``_fp8_experts``) -> ``experts(recv_x, counts)`` -> combine."""
        if fp8 and getattr(experts, "fp8", False):
            return _fp8_experts(self, x, topk_idx, topk_weights, experts)
        recv, handle = self.dispatch(x, topk_idx, topk_weights, fp8=fp8)
        return self.combine(run_experts(experts, recv, handle), handle, topk_weights)

    def forward_micro_batches(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                              experts: Experts, micro_batches: int = 2,
                              shared_expert: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """``forward`` in ``micro_batches`` token ranges whose exchanges travel on a side stream
        while another range's experts compute, with autograd (the backward overlaps the same
        way), over every transport; ``shared_expert`` (``[tokens, hidden] -> [tokens, hidden]``)
        runs while the first dispatch travels and is added. Every rank passes the same
        ``micro_batches``; token counts may differ or be zero. ``micro_batches.py`` has the
        timeline. Returns ``out [tokens, hidden]`` in token order."""
        return forward_micro_batches(self, x, topk_idx, topk_weights, experts, micro_batches, shared_expert)

    def forward_pipelined(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                          experts: Experts, chunks: int | str = "auto") -> torch.Tensor:
        """``forward`` with the tokens in ``chunks`` parts. Every rank must pass the same ``chunks``;
        ``last_chunks`` says what ran.

        Without autograd (``torch.no_grad()``, inference) the transport's pipeline runs, where it
        has one (``Transport.pipeline``): chunk i+1's rows travel while the experts compute chunk
        i, and chunk i's combine returns while chunk i+1 is computed (NCCL runs them on its own
        stream, Gloo on its threads, the peer transport's kernels on a side stream). With
        autograd, or where the transport has none, the chunks run one after another through the
        differentiable dispatch and combine (same results; overlapping the backward is not built
        yet).

        ``chunks="sources"`` pipelines by source rank instead of token ranges
        (``Transport.pipeline_by_source``; ``PeerRows.pipelined_sources``): this rank's own
        tokens' pairs first, which need no transfer, while the copy engines carry every rank's
        tokens; then each peer's, whose results return while the next computes. The experts'
        kernels read the tokens where the copy engines left them, so it asks for transport
        "peer" built with ``pipeline_transfers="copy_engine"``, no autograd, the dropless device
        layout, and ``experts`` a ``GroupedSwiGLU`` of this rank's experts whose Triton kernels
        take the rows (``overlap/moe/_grouped_gemm.py``); a typed error names what is missing.

        ``chunks="auto"`` asks the transport (``Transport.auto_chunks``), without autograd: over
        transport "peer" it follows a tuned table (``launch/bench_moe.py --tune``, read through
        ``overlap.set_tuned`` or ``COMMOPS_OVERLAP_TUNED``, like the overlap operators'): for a
        ``GroupedSwiGLU`` of the measured shape, the pipeline that measured faster than the
        sequential forward at the dispatcher's ``max_tokens`` (the same on every rank, so every
        rank picks the same), where this call can run it; else one chunk, the sequential
        forward. ``last_chunks`` says which and why.
        """
        t = self.transport_impl
        if chunks == "sources":
            return self._by_source(x, topk_idx, topk_weights, experts)
        if chunks == "auto":
            self._check(x, topk_idx, topk_weights)
            picked, why = self._auto_chunks(x, topk_idx, experts)
            if picked == "sources":
                return self._by_source(x, topk_idx, topk_weights, experts, why)
            n = int(picked)
        elif isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1:
            n, why = chunks, "requested by the caller"
        else:
            raise InvalidArgumentError("chunks", chunks, "is not 'auto', 'sources' or a positive int",
                                       "pass 'auto' or e.g. 4")
        self.last_chunks = (n, why)
        if n == 1:
            return self.forward(x, topk_idx, topk_weights, experts)
        self._check(x, topk_idx, topk_weights)
        t.check_tokens(x)
        bounds = micro_batch_bounds(x.shape[0], n)
        if not torch.is_grad_enabled():
            out = t.pipeline(x, topk_idx, topk_weights, experts, bounds)
            if out is not None:
                return out
        if not t.routes_ahead(topk_idx):  # chunk after chunk, each routed within its dispatch
            return torch.cat([self.forward(x[lo:hi], topk_idx[lo:hi], topk_weights[lo:hi], experts)
                              for lo, hi in bounds])
        handles = t.route(topk_idx, bounds)  # every chunk's counts in one small exchange
        recv = [self._dispatch(x[bounds[0][0]:bounds[0][1]], None, handles[0])[0]]
        outs = []
        for i, (lo, hi) in enumerate(bounds):
            if i + 1 < n:
                nlo, nhi = bounds[i + 1]
                recv.append(self._dispatch(x[nlo:nhi], None, handles[i + 1])[0])
            rows = experts(recv[i], handles[i].tokens_per_expert)
            outs.append(self._combine(rows, topk_weights[lo:hi], handles[i]))
        return torch.cat(outs)

    def _auto_chunks(self, x: torch.Tensor, topk_idx: torch.Tensor, experts: Experts) -> tuple[int | str, str]:
        """``chunks="auto"``: (what to run, why), the same on every rank given the same table."""
        if torch.is_grad_enabled():
            return 1, "one chunk: with autograd the chunks run one after another (the tuned pipelines ran without it)"
        return self.transport_impl.auto_chunks(x, topk_idx, experts)

    def _by_source(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   experts: Experts, why: str = "") -> torch.Tensor:
        """``forward_pipelined(..., chunks="sources")``: what it needs checked, then the
        transport's pipeline by source rank. ``why``: auto's reason, given once the transport's
        ``auto_chunks`` has found nothing missing (not looked for again)."""
        t = self.transport_impl
        self._check(x, topk_idx, topk_weights)
        t.check_tokens(x)
        missing = "" if why else t.pipeline_by_source_missing(x, topk_idx, experts)
        if missing:
            raise UnsupportedError("chunks", "sources", f"needs {missing}", "use chunks='auto' or an int")
        out = t.pipeline_by_source(x, topk_idx, topk_weights, experts)
        self.last_chunks = (self.comm.size, why or "by source rank (chunks='sources')")
        return out


def _fp8_experts(disp: MoEDispatcher, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 experts: Experts) -> torch.Tensor:
    """``disp.forward(..., fp8=True)`` into FP8 experts (``GroupedSwiGLU(..., fp8=True)``): the
    received e4m3 rows go to ``experts.forward_fp8`` as they arrive, with no dequantization
    (``fp8.dispatch_fp8_experts``), then the combine."""
    disp._check(x, topk_idx, topk_weights)
    disp.transport_impl.check_tokens(x)
    rows, handle = dispatch_fp8_experts(disp.transport_impl, x, topk_idx, experts)
    return disp.combine(rows, handle, topk_weights)
