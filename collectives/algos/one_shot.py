"""One shot over peer memory: every rank pushes its data straight into its peers' slots.

All-reduce: each rank pushes its whole input to every peer, then sums the ``world`` copies that
sit in its own slots (in rank order, so every rank gets the same bits). One flag round trip per
call, ``(world - 1) * n`` bytes pushed per rank: the fastest for small messages. Reduce-scatter
and all-gather push each peer only its part, which is already the least traffic there is.
Runs on the GPUs of one node (``collectives/peer``); the dispatcher's check says why not elsewhere.
"""

from __future__ import annotations

from ._peer import PeerAlgorithm

__all__ = ["OneShot"]


class OneShot(PeerAlgorithm):
    name = "one_shot"
    ops = frozenset({"all_reduce", "reduce_scatter", "all_gather"})
    summary = "peer memory, one push and one reduction (GPUs of one node)"
