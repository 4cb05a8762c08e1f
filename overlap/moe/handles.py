"""The handles a dispatch returns: what its combine and both backward passes replay.

Design note. A handle is plain data: the counts every transport agrees on (``tokens_per_expert``,
``send_counts``, ...), the host plan's index tensors where there is one, and ``state``, an object
of the transport's own (``TransportState``) for what only that transport reads: the peer
transport's buffers and device layout, the NCCL transport's exchange pieces. That replaced a dict
read by string keys (``handle.extra["peer_dense"]``), which nothing documented or checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TransportState", "DispatchHandle", "LowLatencyHandle"]


class TransportState:
    """Base of the transports' own records of one dispatch (``DispatchHandle.state``).

    Each transport defines its states as frozen dataclasses deriving from this class, documents
    them, and reads only its own; the dispatcher never looks inside.
    """


@dataclass
class DispatchHandle:
    """The routing of one dispatch, which its combine (and both backward passes) replay.

    Attributes:
        tokens_per_expert: ``[E/W]`` rows received for each local expert (``recv_x`` is grouped
            by these, in ascending local expert order).
        send_counts: rows sent to each rank (``[W]``, the all-to-all's input splits).
        recv_counts: rows received from each rank (``[W]``, its output splits).
        recv_matrix: ``[W, E/W]`` rows received from each rank for each local expert.
        order: the kept pairs' flat indices into ``topk_idx.view(-1)``, in send order.
        token_of: the token of each sent row (``order // k``).
        regroup: the permutation taking received rows (by source rank) to ``recv_x`` (by expert).
        num_tokens, top_k: the dispatched batch's shape.
        (``order``, ``token_of`` and ``regroup`` are empty when the transport laid the routing
        out on the GPUs, as transport "peer" does dropless: its combine and both backward passes
        use that layout, which ``state`` holds.)
        dropped: pairs dropped by the capacity limit on this rank (0 when dropless).
        state: what the dispatch's transport keeps for its combine and both backward passes, of
            a type of that transport's (``None``: the host plan above is all it needs).
        ungroup: the inverse of ``regroup`` (``recv_x``'s rows back to arrival order, by a gather).
        pair_row: for each of the ``num_tokens * top_k`` pairs, its sent row (dropless only;
            empty otherwise): the returned rows are put in pair order by a gather, not a scatter.
        expert_ends: ``[E/W]`` int32 on the device, the running sum of ``tokens_per_expert``
            (where each local expert's rows of ``recv_x`` end), where the routing was laid out on
            the GPUs (else ``None``): ``GroupedSwiGLU(..., ends=)`` takes it instead of copying
            the counts from the host after they arrived.
    """

    tokens_per_expert: list[int]
    send_counts: list[int]
    recv_counts: list[int]
    recv_matrix: torch.Tensor
    order: torch.Tensor
    token_of: torch.Tensor
    regroup: torch.Tensor
    num_tokens: int
    top_k: int
    dropped: int = 0
    state: TransportState | None = None
    ungroup: torch.Tensor | None = None
    pair_row: torch.Tensor | None = None
    expert_ends: torch.Tensor | None = None


@dataclass
class LowLatencyHandle:
    """The routing of one ``MoEDispatcher.dispatch_low_latency``, kept on the device.

    Attributes:
        tokens_per_expert: ``[E/W]`` int64 on the device: local expert e's rows are the first
            ``tokens_per_expert[e]`` of its block of ``recv_x`` (the rest of the block is undefined).
        capacity: rows per local expert block (``W * max_tokens``, more than any routing fills).
        num_tokens, top_k: the dispatched batch's shape.
        state: the transport's own record of the dispatch, which ``combine_low_latency`` and
            ``check_routing`` read.
    """

    tokens_per_expert: torch.Tensor
    capacity: int
    num_tokens: int
    top_k: int
    state: TransportState | None = None
