"""Transport "peer": SM kernels that read and write the peers' memory, on the GPUs of one node.

Design note. Over ``all_to_all_single`` a dispatch costs three passes over every (token, expert)
row, and a token bound for four experts of one rank crosses the link four times. Here every rank
learns every rank's routing instead of the counts, and kernels read each token once per
destination rank straight out of the source's peer buffer into ``recv_x``, and return one
weighted partial sum per (token, rank) (``peer_rows.py`` says how). Dropless, the routing is laid
out on the GPUs (``PeerRows.dispatch_dense``: one small copy to the host for the counts) and both
backward passes run on the same kernels; with a ``capacity_factor`` every rank all-gathers the
ids and plans its pulls in numpy (``peer_plan.py``), and the backward passes use the host plan's
all-to-all (``exchange.py``). ``dispatch_low_latency`` gives each local expert a fixed block of
rows instead, so that nothing waits for the host and a decode step's exchange can be captured in
a CUDA graph.

The transport's pipelines: over token chunks (``PeerRows.pipelined_dense``: the row kernels on a
side stream, or with ``pipeline_transfers="copy_engine"`` peer copies that take no SMs from the
experts), and by source rank (``PeerRows.pipelined_sources``: this rank's own tokens need no
transfer, so their experts run while copy engines carry every rank's tokens to its peers; the
experts' Triton gate/up kernel reads each pair's token where it landed; each peer's results
return by copy engine while the next source computes). On 2xH200 neither pipeline over token
chunks beat the plain sequence (their exchanges are 17-40% of the layer, and token chunks shrink
every expert's GEMM); keeping SMs for the exchanges did not change that: with torch's SM
carveout at 24 for the experts and the row kernels capped at 48 blocks beside them, the peer
pipeline ran at 0.73-0.89x the sequential forward's speed against 0.79-0.96x without, at 2
chunks (Qwen3-30B-like, top-2 and top-1 prefill; a scratch probe on 2xH200, 2026-12-01, not
kept): the experts lost more to the SMs kept than the exchanges gained. ``chunks="auto"``
follows a tuned table (``tuned.py``).

Every call is recorded like a collective (``collectives.dispatch.recorded``): its communication
runs outside the verbs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, cast

import numpy as np
import torch

import collectives as C
from collectives.dispatch import recorded
from collectives.errors import InvalidArgumentError, UnsupportedError

from .. import _copy_engine
from . import _grouped_gemm
from .exchange import combine_backward, combine_rows, dispatch_backward, route_rows, sent_weights
from .experts import GroupedSwiGLU
from .handles import DispatchHandle, LowLatencyHandle, TransportState
from .peer_plan import MAX_BASE, DeviceLayout, PeerPlan, build, dense_backward_fits, plan
from .peer_rows import PeerRows
from .routing import HostRange, check_ids, host_ranges, plan_handles, sorted_pairs
from .transport import CombineGrads, Experts, Transport, TransportArguments, TransportOptions, TransportSetup
from .tuned import TunedChoices, TunedLayer

__all__ = ["PeerOptions", "PeerTransport", "PeerPlanState", "PeerDenseState", "PeerPaddedState"]


@dataclass(frozen=True)
class PeerOptions(TransportOptions):
    """The options of transport "peer"; the bounds size its peer buffers, which ``close()``
    releases (collective).

    Attributes:
        max_tokens: the most tokens one dispatch takes on any rank.
        top_k: the k of every ``topk_idx`` (at most the experts).
        pipeline_transfers: how a pipelined forward moves rows between GPUs: "sm" (the SM
            kernels, on a side stream), "copy_engine" (peer copies, which take no SMs from the
            experts; every kernel then runs on the caller's stream, on local memory; the peer
            buffers are sized for it, about 1.5x at 2 ranks) or "auto" ("sm": the copy engines
            measured no gain on 2xH200). ``last_pipeline`` records (which, why).
    """

    max_tokens: int
    top_k: int
    pipeline_transfers: str = "auto"

    def __post_init__(self) -> None:
        TransportArguments(pipeline_transfers=self.pipeline_transfers)  # the value's check
        # the peer buffers are sized once, from these bounds (like any buffer-owning object)
        for name, v in (("max_tokens", self.max_tokens), ("top_k", self.top_k)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgumentError(name, v, "is needed by transport='peer' (it sizes the peer buffers)",
                                           f"pass {name}= as a positive int, e.g. max_tokens=4096, top_k=8")

    @classmethod
    def from_arguments(cls, args: TransportArguments) -> PeerOptions:
        if args.routing == "device":
            raise UnsupportedError("routing", args.routing, "applies to transport='nccl' with exchange_pieces=1",
                                   "pass routing='auto' (or 'host')")
        # (None bounds are refused by __post_init__, with the error these arguments always raised)
        return cls(cast(int, args.max_tokens), cast(int, args.top_k),
                   "auto" if args.pipeline_transfers is None else args.pipeline_transfers)

    def arguments(self) -> TransportArguments:
        return TransportArguments(max_tokens=self.max_tokens, top_k=self.top_k,
                                  pipeline_transfers=self.pipeline_transfers)


@dataclass(frozen=True)
class PeerPlanState(TransportState):
    """A handle the peer transport planned on the host (a capacity factor): its buffers and this
    rank's plan; the backward passes use the host plan's all-to-all."""

    rows: PeerRows
    plan: PeerPlan


@dataclass(frozen=True)
class PeerDenseState(TransportState):
    """A dispatch laid out on the GPUs (dropless): its buffers and device layout, which the combine
    and both backward passes run on."""

    rows: PeerRows
    layout: DeviceLayout


@dataclass(frozen=True)
class PeerPaddedState(TransportState):
    """A low-latency dispatch: its buffers and padded layout (``combine_low_latency``,
    ``check_routing``)."""

    rows: PeerRows
    layout: DeviceLayout


class PeerTransport(Transport):
    """Rows by peer-memory kernels (``options``: :class:`PeerOptions`); its buffers
    (:meth:`rows`) are built on first use, collectively, and released by :meth:`close`."""

    options: PeerOptions
    offers_low_latency: ClassVar[bool] = True
    packed_rows: ClassVar[bool] = True  # the row kernels copy words, whatever they hold

    def __init__(self, setup: TransportSetup, options: PeerOptions, memory: object = None) -> None:
        """``memory``: a ``PeerMemory`` (or a stand-in) for :meth:`rows` to use instead of building one."""
        if options.top_k > setup.num_experts:
            raise InvalidArgumentError("top_k", options.top_k, f"exceeds the {setup.num_experts} experts",
                                       f"pass top_k<={setup.num_experts}")
        super().__init__(setup, options)
        self._memory = memory
        self._rows: PeerRows | None = None
        # the buffers are sized by the rows' bytes: known from the dtype, or at the first dispatch
        self._row_bytes = 0 if setup.dtype is None else setup.hidden * torch.empty((), dtype=setup.dtype).element_size()
        self._no_plan: dict[torch.device, torch.Tensor] = {}
        self._meta: dict[tuple[torch.dtype, int], torch.Tensor] = {}  # dispatch's output, as recorded
        self._tuned = TunedChoices()

    def rows(self) -> PeerRows:
        """The peer buffers and their kernels, built on first use (collective: every rank
        dispatches); ``PeerRows.trace`` and ``timeline`` trace a pipelined forward."""
        if self._rows is None:
            self._rows = PeerRows(self.comm, self.options.max_tokens, self.options.top_k, self._row_bytes,
                                  self.setup.num_experts, memory=self._memory,
                                  pipeline_transfers=self.options.pipeline_transfers)
        self._rows.pipeline_transfers = self.options.pipeline_transfers
        return self._rows

    def close(self) -> None:
        """Release the peer buffers, if any (collective); they are built anew on the next use."""
        if self._rows is not None:
            self._rows.close()
            self._rows = None

    def check_tokens(self, x: torch.Tensor) -> None:
        why = _copy_engine.unavailable(self.comm, x.device, x.dtype)
        if why:
            raise UnsupportedError("transport", "peer", f"cannot run here: {why}", "use transport='nccl'")
        self._row_bytes = x.shape[1] * x.element_size()

    def routes_on_device(self, topk_idx: torch.Tensor) -> bool:
        """Whether this dispatch lays its routing out on the GPUs: no host plan; for the layouts
        the kernels serve (dropless; k up to a warp's 32 lanes; local experts x ranks up to their
        table). Differentiable through the same kernels."""
        return (self.setup.capacity_factor is None  # drops need each expert's count before the rows
                and topk_idx.dim() == 2 and topk_idx.shape[1] <= 32  # one lane per pair of a token
                and self.setup.num_experts <= MAX_BASE  # the kernels' (local expert, source) table
                # combine's backward keeps the per-pair dot products beside the gradient rows
                and dense_backward_fits(self.comm.size, topk_idx.shape[1], self.setup.hidden * self._es()))

    def routes_ahead(self, topk_idx: torch.Tensor) -> bool:
        return not self.routes_on_device(topk_idx)  # the device layout comes with the rows

    def _es(self) -> int:
        """The tokens' element size (2 until the first dispatch tells, if ``dtype`` was not given)."""
        return self._row_bytes // self.setup.hidden if self._row_bytes else 2

    def _check_k(self, topk_idx: torch.Tensor) -> None:
        k = self.options.top_k
        if topk_idx.shape[1] != k:
            raise InvalidArgumentError("topk_idx", topk_idx, f"has k={topk_idx.shape[1]}; the dispatcher was built "
                                       f"for top_k={k}", f"pass [tokens, {k}] expert ids")

    # -- planned on the host (a capacity factor) --------------------------------------------------
    def _gather_routing(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]], k: int
                        ) -> tuple[list[np.ndarray], list[list[tuple[int, int]]]]:
        """Every rank's ``topk_idx`` and ranges, checked on every rank, so a bad routing on one
        rank raises the same error on all of them."""
        w, T, max_tokens = self.comm.size, topk_idx.shape[0], self.options.max_tokens
        if k != self.options.top_k:
            raise InvalidArgumentError("topk_idx", topk_idx, f"has k={k}; the dispatcher was built for top_k="
                                       f"{self.options.top_k}", f"pass [tokens, {self.options.top_k}] expert ids")
        if T > max_tokens:
            raise InvalidArgumentError("x", topk_idx, f"has {T} tokens; the peer transport was built for max_tokens="
                                       f"{max_tokens}", f"pass max_tokens>={T} to MoEDispatcher")
        head = [T, *(v for b in bounds for v in b)]
        size = len(head) + max_tokens * k
        mine = torch.full((size,), -1, dtype=torch.int32, device=topk_idx.device)
        mine[:len(head)].copy_(torch.tensor(head, dtype=torch.int32))
        mine[len(head):len(head) + T * k].copy_(topk_idx.detach().reshape(-1))
        every = torch.empty(w * size, dtype=torch.int32, device=topk_idx.device)
        C.all_gather_single(every, mine, group=self.group)
        rows = every.cpu().numpy().reshape(w, size).astype(np.int64)
        ids, ranges = [], []
        for s in range(w):
            t = int(rows[s, 0])
            mine_ids = rows[s, len(head):len(head) + t * k].reshape(t, k)
            check_ids(mine_ids, topk_idx, "topk_idx" if s == self.comm.rank else f"topk_idx of rank {s}",
                      self.setup.num_experts)
            ids.append(mine_ids)
            ranges.append([(int(rows[s, 1 + 2 * i]), int(rows[s, 2 + 2 * i])) for i in range(len(bounds))])
        return ids, ranges

    def route(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]]) -> list[DispatchHandle]:
        """``Transport.route`` on the host: every rank's routing (each plans its pulls from all of
        them) in one small all-gather, then each range's pulls and partial sums (``plan``)."""
        k = topk_idx.shape[1] if topk_idx.dim() == 2 else 1
        w, e_loc, n, me = self.comm.size, self.setup.local_experts, len(bounds), self.comm.rank
        every_ids, every_bounds = self._gather_routing(topk_idx, bounds, k)
        sources = [[sorted_pairs(every_ids[s][lo:hi], self.setup.num_experts, self.setup.capacity_factor)
                    for lo, hi in every_bounds[s]] for s in range(w)]
        local = sources[me]
        every = np.stack([np.stack([c for _, _, c, _, _ in sources[s]]) for s in range(w)]).reshape(w, n, w, e_loc)
        counts = np.stack([c for _, _, c, _, _ in local]).reshape(n, w, e_loc)
        if not self._row_bytes:
            raise InvalidArgumentError("dtype", self.setup.dtype, "is needed by the peer transport before the first "
                                       "dispatch (it sizes the peer buffers' regions by the rows' bytes)",
                                       "pass dtype= to MoEDispatcher, or dispatch before calling route")
        got = np.ascontiguousarray(every[:, :, me, :])
        scalars: list[tuple[int, int]] = []

        def extra(c: int, rg: HostRange, arrays: list[np.ndarray]) -> list[np.ndarray]:
            p_scalars, more = plan(me, w, e_loc, k, self.options.max_tokens,
                                   [(every_ids[s][lo:hi], sources[s][c][0], hi - lo)
                                    for s, (lo, hi) in enumerate(b[c] for b in every_bounds)])
            scalars.append(p_scalars)
            return more

        def state(c: int, views: list[torch.Tensor]) -> PeerPlanState:
            return PeerPlanState(self.rows(), build(scalars[c], views))

        return plan_handles(host_ranges(local, counts, got), k, topk_idx.device, extra, state)

    def dispatch_rows(self, x: torch.Tensor, handle: DispatchHandle, packed: bool = False) -> torch.Tensor:
        """``packed``: rows of 4-byte words no wider than the tokens' (:meth:`dispatch_packed`)."""
        state = handle.state
        if not isinstance(state, PeerPlanState):  # a host plan of another kind: over all_to_all_single
            return route_rows(handle, x, self.group)
        total = sum(handle.recv_counts)
        shown = x.view(torch.uint8) if packed else x  # the flight recorder notes packed rows as their bytes
        with recorded(self.comm, "moe_dispatch", "peer", torch.empty((total, shown.shape[1]), dtype=shown.dtype,
                                                                       device="meta"), shown):
            return state.rows.dispatch(state.plan, x.contiguous(), total, packed)

    def dispatch_packed(self, packed: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, DispatchHandle]:
        """The FP8 dispatch's rows as float32 words (``_as_words``), over the device layout or the
        host plan as :meth:`dispatch` chooses; the handle is the tokens'."""
        recv, handle = self.dispatch(_as_words(packed, self._row_bytes), topk_idx, packed=True)
        return recv.view(torch.uint8), handle

    # -- laid out on the GPUs (dropless) ----------------------------------------------------------
    def dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, packed: bool = False
                 ) -> tuple[torch.Tensor, DispatchHandle]:
        """Over the device layout where :meth:`routes_on_device` (the handle carries the counts
        the host learned, and the layout for the combine and both backward passes), else planned
        on the host. ``packed``: as :meth:`dispatch_rows`'s."""
        if not self.routes_on_device(topk_idx):
            handle = self.route(topk_idx, [(0, topk_idx.shape[0])])[0]
            return self.dispatch_rows(x, handle, packed), handle
        w, e_loc = self.comm.size, self.setup.local_experts
        self._check_k(topk_idx)
        rows = self.rows()
        shown = x.view(torch.uint8) if packed else x  # the flight recorder notes packed rows as their bytes
        meta = self._meta.get((shown.dtype, shown.shape[1]))  # what it notes of the output
        if meta is None:
            meta = self._meta[shown.dtype, shown.shape[1]] = torch.empty((0, shown.shape[1]), dtype=shown.dtype,
                                                                         device="meta")
        with recorded(self.comm, "moe_dispatch", "peer", meta, shown):
            recv, layout = rows.dispatch_dense(x.contiguous(), topk_idx, packed)
        none = self._no_plan.get(x.device)  # no host plan (see DispatchHandle): one empty tensor, shared
        if none is None:
            none = self._no_plan[x.device] = torch.empty(0, dtype=torch.int64, device=x.device)
        counts = layout.counts
        assert counts is not None  # the compact layout's counts are on the host
        matrix = counts[:w * e_loc].reshape(w, e_loc).astype(np.int64)
        handle = DispatchHandle(matrix.sum(0).tolist(), counts[w * e_loc + w:w * e_loc + 2 * w].astype(np.int64).tolist(),
                                matrix.sum(1).tolist(), torch.from_numpy(matrix), none, none, none, x.shape[0],
                                topk_idx.shape[1], 0, PeerDenseState(rows, layout), expert_ends=layout.ends)
        return recv, handle

    def dispatch_backward(self, grad_recv: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """A combine with unit weights (over the device layout, or the host plan's all-to-all)."""
        state = handle.state
        if not isinstance(state, PeerDenseState):
            return dispatch_backward(handle, grad_recv, self.group)
        lay = state.layout
        ones = torch.ones((lay.tokens, self.options.top_k), dtype=torch.float32, device=grad_recv.device)
        return state.rows.combine_dense(lay, grad_recv, ones)

    def combine(self, rows: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle, weights_grad: bool
                ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        state = handle.state
        if isinstance(state, PeerDenseState):
            meta = torch.empty((handle.num_tokens, rows.shape[1]), dtype=rows.dtype, device="meta")
            with recorded(self.comm, "moe_combine", "peer", meta, rows):
                return state.rows.combine_dense(state.layout, rows.contiguous(), weights), (rows, weights)
        w = sent_weights(handle, weights, rows.dtype)  # each sent row's weight
        if isinstance(state, PeerPlanState) and not weights_grad:
            meta = torch.empty((handle.num_tokens, *rows.shape[1:]), dtype=rows.dtype, device="meta")
            with recorded(self.comm, "moe_combine", "peer", meta, rows):
                return state.rows.combine(state.plan, rows.contiguous(), weights), (None, w)
        return combine_rows(handle, rows, weights, w, self.group)

    def combine_backward(self, grad_out: torch.Tensor, handle: DispatchHandle,
                         saved: tuple[torch.Tensor | None, ...], wanted: CombineGrads
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Over the device layout: the gradient dispatched scaled by the weights, and the weights'
        gradient from dot products taken where the rows are; else the host plan's all-to-all."""
        state = handle.state
        if not isinstance(state, PeerDenseState):
            return combine_backward(handle, grad_out, saved, wanted, self.group)
        rows, weights = saved
        assert rows is not None and weights is not None  # what combine saved over the device layout
        grad_rows, gw = state.rows.combine_backward_dense(state.layout, grad_out.contiguous(), rows.contiguous(),
                                                          weights, wanted.weights)
        return grad_rows, (gw.view(weights.shape).to(weights.dtype) if gw is not None else None)

    # -- the low-latency pair ---------------------------------------------------------------------
    def low_latency_capacity(self) -> int:
        return self.comm.size * self.options.max_tokens  # PeerRows.dispatch_padded's cap

    def dispatch_low_latency(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, LowLatencyHandle]:
        k = self.options.top_k
        if not self.routes_on_device(topk_idx) or topk_idx.shape[1] != k:
            raise InvalidArgumentError("topk_idx", topk_idx, f"is not [tokens, {k}] with k <= 32 (the layout "
                                       "the low-latency kernels serve)", f"pass [tokens, {k}] expert ids")
        rows = self.rows()
        meta = torch.empty((0, x.shape[1]), dtype=x.dtype, device="meta")
        with recorded(self.comm, "moe_dispatch", "peer_low_latency", meta, x):
            recv, counts, layout = rows.dispatch_padded(x.contiguous(), topk_idx)
        return recv, LowLatencyHandle(counts, layout.cap, x.shape[0], topk_idx.shape[1], PeerPaddedState(rows, layout))

    def combine_low_latency(self, expert_out: torch.Tensor, handle: LowLatencyHandle,
                            weights: torch.Tensor) -> torch.Tensor:
        state = _padded(handle)
        meta = torch.empty((handle.num_tokens, self.setup.hidden), dtype=expert_out.dtype, device="meta")
        with recorded(self.comm, "moe_combine", "peer_low_latency", meta, expert_out):
            return state.rows.combine_padded(state.layout, expert_out, weights)

    def check_routing(self, handle: LowLatencyHandle, topk_idx: torch.Tensor) -> None:
        state = _padded(handle)
        state.rows.check_padded(state.layout, topk_idx)

    # -- the pipelined forward --------------------------------------------------------------------
    def pipeline(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: Experts,
                 bounds: list[tuple[int, int]]) -> torch.Tensor | None:
        """Over the device layout: every chunk routed on the GPUs first, then the rows of chunk
        i+1 travel (peer kernels on a side stream, or copy engines) while the experts compute
        chunk i (``PeerRows.pipelined_dense``). Planned on the host: none."""
        if not self.routes_on_device(topk_idx):
            return None
        return self._pipelined(x, topk_idx, topk_weights, lambda rows, xc: rows.pipelined_dense(
            xc, topk_idx, topk_weights, experts, bounds))

    def pipeline_by_source(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                           experts: Experts) -> torch.Tensor:
        return self._pipelined(x, topk_idx, topk_weights, lambda rows, xc: rows.pipelined_sources(
            xc, topk_idx, topk_weights, experts))

    def _pipelined(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   run: Callable[[PeerRows, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """A pipelined forward, ``run(rows, x)``: the ids and weights checked against ``top_k``,
        the call recorded, ``last_pipeline`` kept."""
        k = self.options.top_k
        if topk_idx.shape[1] != k or tuple(topk_weights.shape) != tuple(topk_idx.shape):
            raise InvalidArgumentError("topk_idx", topk_idx, f"is not [tokens, {k}] with weights of its "
                                       "shape", f"pass [tokens, {k}] ids and weights")
        rows = self.rows()
        meta = torch.empty((x.shape[0], self.setup.hidden), dtype=x.dtype, device="meta")
        with recorded(self.comm, "moe_forward", "peer", meta, x):
            out = run(rows, x.contiguous())
        self.last_pipeline = rows.last_pipeline
        return out

    def pipeline_by_source_missing(self, x: torch.Tensor, topk_idx: torch.Tensor, experts: Experts) -> str:
        transfers, e_loc = self.options.pipeline_transfers, self.setup.local_experts
        missing = ""
        if transfers != "copy_engine":
            missing = (f"transport='peer' with pipeline_transfers='copy_engine' (this dispatcher: transport='peer', "
                       f"pipeline_transfers={transfers!r})")
        elif torch.is_grad_enabled():
            missing = "no autograd (it runs the experts' inference kernels): call it under torch.no_grad()"
        elif not self.routes_on_device(topk_idx):
            missing = "the dropless device layout (CUDA ids, no capacity_factor)"
        elif not isinstance(experts, GroupedSwiGLU) or experts.w1.shape[0] != e_loc:
            missing = f"experts a GroupedSwiGLU of this rank's {e_loc} experts, not {type(experts).__name__}"
        else:
            # the kernels read the tokens from the peer buffer (aligned), not from x: x's dtype and width
            why = _grouped_gemm.supported(x.new_empty((1, x.shape[1])), experts.w1, experts.w3, experts.w2)
            if why:
                missing = f"rows the experts' Triton kernels take: {why}"
        return missing

    def auto_chunks(self, x: torch.Tensor, topk_idx: torch.Tensor, experts: Experts) -> tuple[int | str, str]:
        """The tuned table's pipeline at ``max_tokens`` (the same on every rank, so every rank picks
        the same), where this call can run it; else one chunk (``tuned.py``)."""
        layer = TunedLayer(self.comm.size, "peer", self.options.max_tokens, self.setup.hidden, self.setup.num_experts,
                           self.options.pipeline_transfers)
        picked, why = found = self._tuned.choose(layer, x, topk_idx.shape[1], experts)
        if picked == "sources":
            missing = self.pipeline_by_source_missing(x, topk_idx, experts)
            if missing:
                return 1, f"one chunk: the tuned table's pipeline by source needs {missing}"
        return found


def _as_words(packed: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``packed`` (uint8 rows) as float32 words: the row kernels copy a row's words whatever they
    hold, and the buffers' regions hold the tokens' rows of ``row_bytes`` (0: not known yet), no
    narrower. Refused before anything is exchanged: rows not of whole 4-byte words, or wider."""
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % 4:
        raise InvalidArgumentError("packed", packed, "is not uint8 [tokens, width] with width a multiple of 4",
                                   "pack the rows with fp8.quantize_rows (hidden % 128 == 0)")
    if row_bytes and packed.shape[1] > row_bytes:
        raise InvalidArgumentError("packed", packed, f"has rows of {packed.shape[1]} B, wider than the tokens' "
                                   f"{row_bytes} B (at most that; the buffers are sized by them)",
                                   "pack rows no wider than the tokens (fp8.packed_width)")
    return packed.contiguous().view(torch.float32)


def _padded(handle: LowLatencyHandle) -> PeerPaddedState:
    if not isinstance(handle.state, PeerPaddedState):
        raise InvalidArgumentError("handle", handle, "is not a low-latency handle of transport 'peer'",
                                   "pass what this dispatcher's dispatch_low_latency returned")
    return handle.state
