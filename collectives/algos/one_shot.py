"""One shot over peer memory: every rank pushes its data straight into its peers' slots.

All-reduce: each rank pushes its whole input to every peer, then sums the ``world`` copies that
sit in its own slots (in rank order, so every rank gets the same bits). One flag round trip per
call, ``(world - 1) * n`` bytes pushed per rank: the fastest for small messages. Reduce-scatter
and all-gather push each peer only its part, which is already the least traffic there is.
Messages up to ``pm.ll_max_bytes`` travel as low-latency words (4 data bytes and the call's
number per 8-byte store, ``kernels.cu``): no flag to wait for after the data. Larger ones run in
pieces that fit one set of slots. Runs on the GPUs of one node (``collectives/peer``); the
dispatcher's check says why not elsewhere.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..peer.memory import ONE_SHOT_LL_MAX_BYTES, PACK_BYTES, PeerMemory
from ._peer import Launch, PeerAlgorithm, PeerState, Plan

__all__ = ["OneShot", "ll_limit"]


def ll_limit(pm: PeerMemory) -> int:
    """The largest message sent in low-latency words: ``pm.ll_max_bytes``, within their area."""
    return min(pm.ll_max_bytes, ONE_SHOT_LL_MAX_BYTES)


class OneShot(PeerAlgorithm):
    name = "one_shot"
    ops = frozenset({"all_reduce", "reduce_scatter", "all_gather"})
    summary = "peer memory, one push and one reduction (GPUs of one node)"

    def plan(self, pm: PeerMemory, tensor: torch.Tensor) -> Plan:
        """Pieces of whole slots (``world`` per set); a message within ``ll_limit`` in one launch of
        low-latency words when aligned (each rank's region holds the words of
        ``ONE_SHOT_LL_MAX_BYTES``)."""
        n, es, dtype = tensor.numel(), tensor.element_size(), tensor.dtype
        pack = PACK_BYTES // es
        slot = pm.set_bytes // es // pm.world // pack * pack
        pieces = []
        for off in range(0, n, slot):
            m = min(slot, n - off)
            pieces.append((pm.blocks(m * es), off * es, m, slot))
        plan = Plan(pm.kernel(self.name, dtype, True), pm.kernel(self.name, dtype, False), tuple(pieces),
                    tuple(pieces))
        if n * es <= ll_limit(pm):
            ll = pm.kernel("one_shot_ll", dtype, True, 4)
            plan = Plan(ll, plan.unaligned, ((pm.blocks(n * es), 0, n, ONE_SHOT_LL_MAX_BYTES // 4),),
                        plan.unaligned_pieces)
        return plan

    def reduce_scatter(self, pm: PeerMemory, output: torch.Tensor, input: torch.Tensor, average: bool = False) -> None:
        """``output`` ([m]) = this rank's shard of the sum of every rank's ``input`` ([world * m]), by SM pushes."""
        _by_shard(pm, "reduce_scatter", output, input, output.numel())
        if average:
            output.detach().div_(pm.world)

    def all_gather(self, pm: PeerMemory, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` ([world * m]) = every rank's ``input`` ([m]) in rank order, by SM pushes."""
        _by_shard(pm, "all_gather", output, input, input.numel())

    def one_launch(self, pm: PeerMemory, state: PeerState, op: str, output: torch.Tensor,
                   input: torch.Tensor) -> Launch | None:
        if op == "all_reduce":
            return super().one_launch(pm, state, op, output, input)
        launches = list(_shard_launches(pm, op, output, input, output.numel() if op == "reduce_scatter" else
                                        input.numel()))
        return launches[0] if len(launches) == 1 else None


def _by_shard(pm: PeerMemory, kind: str, output: torch.Tensor, input: torch.Tensor, m: int) -> None:
    """Launch ``kind`` over shards of ``m`` elements, in pieces that fit one set of slots."""
    pm.validate(output)
    pm.validate(input)
    stream = pm.stream()
    for k, blocks, args in _shard_launches(pm, kind, output, input, m):
        k(blocks, stream, *args)


def _shard_launches(pm: PeerMemory, kind: str, output: torch.Tensor, input: torch.Tensor, m: int) -> Iterator[Launch]:
    """``_by_shard``'s launches."""
    es = output.element_size()
    pack = PACK_BYTES // es
    piece = pm.set_bytes // es // pm.world // pack * pack
    src, dst = input.data_ptr(), output.data_ptr()
    aligned = dst % PACK_BYTES == 0 and src % PACK_BYTES == 0
    vec = aligned and m % pack == 0
    # low-latency words: shards of whole 4-byte words, the whole message in their area
    if aligned and m * es % 4 == 0 and m * es * pm.world <= ll_limit(pm):
        yield Launch(pm.kernel(kind + "_ll", output.dtype, True), pm.blocks(m * es), (src, dst, m, m))
        return
    k = pm.kernel(kind, output.dtype, vec)
    for off in range(0, m, piece):
        n = min(piece, m - off)
        yield Launch(k, pm.blocks(n * es * pm.world), (src + off * es, dst + off * es, n, m))
