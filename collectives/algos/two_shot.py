"""Two shots over peer memory: a reduce-scatter by pushes, then an all-gather by pushes.

Rank r pushes shard p of its input into peer p's slots, sums the ``world`` copies of shard r,
and pushes the sum into every peer's gather slots. Each rank sends ``2 (world - 1) / world * n``
bytes, the bandwidth-optimal all-reduce, and reduces only ``n / world`` elements: the choice for
large messages. Runs on the GPUs of one node (``collectives/peer``).
"""

from __future__ import annotations

from ._peer import PeerAlgorithm

__all__ = ["TwoShot"]


class TwoShot(PeerAlgorithm):
    name = "two_shot"
    ops = frozenset({"all_reduce"})
    summary = "peer memory, reduce-scatter then all-gather by pushes (GPUs of one node)"
