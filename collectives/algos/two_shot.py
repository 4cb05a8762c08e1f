"""Two shots over peer memory: a reduce-scatter by pushes, then an all-gather by pushes.

Rank r pushes shard p of its input into peer p's slots, sums the ``world`` copies of shard r,
and pushes the sum into every peer's gather slots. Each rank sends ``2 (world - 1) / world * n``
bytes, the bandwidth-optimal all-reduce, and reduces only ``n / world`` elements: the choice for
large messages. Larger messages than one set of slots holds run in pieces (``two_shot_piece``).
Runs on the GPUs of one node (``collectives/peer``).
"""

from __future__ import annotations

import math

import torch

from ..peer.memory import PACK_BYTES, PeerMemory
from ._peer import PeerAlgorithm, Plan

__all__ = ["TwoShot", "two_shot_piece"]


def two_shot_piece(set_bytes: int, world: int, element_size: int) -> int:
    """Elements of the largest two-shot all-reduce piece one set of ``set_bytes`` holds (a reduce
    slot and a gather slot per rank, shards in whole 16-byte packs)."""
    pack = PACK_BYTES // element_size
    return set_bytes // element_size // (2 * world) // pack * pack * world


class TwoShot(PeerAlgorithm):
    name = "two_shot"
    ops = frozenset({"all_reduce"})
    summary = "peer memory, reduce-scatter then all-gather by pushes (GPUs of one node)"

    def plan(self, pm: PeerMemory, tensor: torch.Tensor) -> Plan:
        """Pieces of ``two_shot_piece`` elements, each cut into ``world`` shards of whole packs."""
        n, es, dtype = tensor.numel(), tensor.element_size(), tensor.dtype
        pack = PACK_BYTES // es
        piece = two_shot_piece(pm.set_bytes, pm.world, es)
        pieces = []
        for off in range(0, n, piece):
            m = min(piece, n - off)
            shard = math.ceil(math.ceil(m / pm.world) / pack) * pack
            pieces.append((pm.blocks(m * es), off * es, m, shard))
        return Plan(pm.kernel(self.name, dtype, True), pm.kernel(self.name, dtype, False), tuple(pieces), tuple(pieces))
