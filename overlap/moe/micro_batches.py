"""Micro-batches through one MoE layer: one micro-batch's exchanges travel while another's experts compute.

Design note. A pipeline over token chunks inside the transport (``pipeline.py``) runs without
autograd and measured no gain on 2xH200; this one is built on the transport contract alone
(``dispatch``, ``combine`` and their autograd Functions), so it runs over every transport, with
autograd, in prefill and in training. The tokens are cut into ``n`` micro-batches (the same
``n`` on every rank; token counts may differ, and may be zero). The exchanges run on a side
stream of the dispatcher's (the transport sees it as the caller's stream: the contract says
work is issued there), the experts on the caller's stream, ordered by events::

    exchange stream:  dispatch 0 | dispatch 1 | combine 0 | dispatch 2 | combine 1 | ... | combine n-1
    caller's stream:  shared expert | experts 0 | experts 1 | experts 2 | ...            | (joins)

Each combine waits for its experts; each expert set for its dispatch. The host issues experts i
before dispatch i+1, so that a transport whose dispatch waits for its counts on the host (both
of ours do, once) waits while the GPU computes experts i, not while it idles. The shared expert,
if any, is issued first on the caller's stream, so it runs while dispatch 0 travels.

The backward pass overlaps the same way without code of its own: autograd runs each node's
backward on the stream its forward ran on and orders the streams by the gradients it hands on,
so combine i's backward (a dispatch of the output gradient) travels on the exchange stream while
the experts' data-gradient GEMMs of another micro-batch run on the caller's. Every rank builds
the same graph, so autograd's order of the backward exchanges is the same on every rank, as the
transports need.

On the CPU (Gloo) there are no streams: the same calls run in the same order, one after another.
Capacity drops (``capacity_factor``) apply per micro-batch, as they do per chunk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from collectives.errors import InvalidArgumentError

from .experts import GroupedSwiGLU
from .handles import DispatchHandle
from .transport import Experts

if TYPE_CHECKING:  # (the dispatcher imports this module)
    from .dispatcher import MoEDispatcher

__all__ = ["forward_micro_batches", "run_experts", "micro_batch_bounds", "check_micro_batches"]


def run_experts(experts: Experts, recv: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """``experts(recv_x, tokens_per_expert)``; a ``GroupedSwiGLU`` also gets the handle's
    ``expert_ends``, where the dispatch has them on the device."""
    if handle.expert_ends is not None and isinstance(experts, GroupedSwiGLU):
        return experts(recv, handle.tokens_per_expert, ends=handle.expert_ends)
    return experts(recv, handle.tokens_per_expert)


def check_micro_batches(n: Any) -> None:
    """Raise where ``n`` is not a micro-batch count (a positive int)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgumentError("micro_batches", n, "is not a positive int", "pass 2 (or 1: no overlap)")


def micro_batch_bounds(tokens: int, n: int) -> list[tuple[int, int]]:
    """``n`` token ranges of ``tokens``, as even as they go (some empty when ``tokens < n``)."""
    return [(tokens * i // n, tokens * (i + 1) // n) for i in range(n)]


class _Lanes:
    """The caller's stream and the exchange stream on CUDA, ordered by events; on the CPU both
    are the program order and every method does nothing."""

    def __init__(self, device: torch.device, streams: dict[torch.device, Any]) -> None:
        """``streams``: the dispatcher's exchange streams by device (one made and kept per device)."""
        self.cuda = device.type == "cuda"
        self.main: Any = torch.cuda.current_stream(device) if self.cuda else None  # (None on the CPU)
        if self.cuda and device not in streams:
            streams[device] = torch.cuda.Stream(device)
        self.side = streams[device] if self.cuda else None
        if self.side is not None:
            self.side.wait_stream(self.main)  # the inputs, and what the caller did before

    @contextlib.contextmanager
    def exchange(self, *used: torch.Tensor) -> Iterator[None]:
        """Issue on the exchange stream, after the caller's stream's work so far; ``used``:
        tensors of the caller's stream read there (kept alive for it)."""
        if self.side is None:
            yield
            return
        self.side.wait_stream(self.main)
        for t in used:
            t.record_stream(self.side)
        with torch.cuda.stream(self.side):
            yield

    def mark(self) -> Any:
        """An event after the exchange stream's work so far (``None`` on the CPU)."""
        if self.side is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self.side)
        return ev

    def compute_after(self, ev: Any, *used: torch.Tensor) -> None:
        """The caller's stream waits for ``ev``; ``used``: tensors of the exchange stream read there."""
        if ev is None:
            return
        self.main.wait_event(ev)
        for t in used:
            t.record_stream(self.main)

    def join(self, *used: torch.Tensor) -> None:
        """The caller's stream waits for every exchange issued; ``used`` are read on it after."""
        if self.side is None:
            return
        self.main.wait_stream(self.side)
        for t in used:
            t.record_stream(self.main)


def forward_micro_batches(disp: MoEDispatcher, x: torch.Tensor, topk_idx: torch.Tensor,
                          topk_weights: torch.Tensor, experts: Experts, n: int,
                          shared_expert: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
    """``MoEDispatcher.forward_micro_batches`` (see it and the module's design note)."""
    check_micro_batches(n)
    disp._check(x, topk_idx, topk_weights)
    disp.transport_impl.check_tokens(x)
    lanes = _Lanes(x.device, disp.exchange_streams)
    shared = shared_expert(x) if shared_expert is not None else None  # beside dispatch 0
    bounds = micro_batch_bounds(x.shape[0], n)
    parts = [(x[lo:hi], topk_idx[lo:hi], topk_weights[lo:hi]) for lo, hi in bounds]

    def dispatched(i: int) -> tuple[torch.Tensor, DispatchHandle, Any]:
        xi, ii, _ = parts[i]
        with lanes.exchange(xi, ii):
            recv, handle = disp._dispatch(xi, ii, None)
        return recv, handle, lanes.mark()

    got = dispatched(0)
    outs = []
    for i in range(n):
        recv, handle, arrived = got
        lanes.compute_after(arrived, recv)
        rows = run_experts(experts, recv, handle)
        if i + 1 < n:
            got = dispatched(i + 1)  # travels while experts i compute (issued after them)
        with lanes.exchange(rows, parts[i][2]):
            outs.append(disp._combine(rows, parts[i][2], handle))  # travels while experts i+1 compute
    lanes.join(*outs)
    out = torch.cat(outs) if n > 1 else outs[0]
    return out if shared is None else out + shared
