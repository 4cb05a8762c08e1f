"""One shot over peer memory: every rank pushes its data straight into its peers' slots.

All-reduce: each rank pushes its whole input to every peer, then sums the ``world`` copies that
sit in its own slots (in rank order, so every rank gets the same bits). One flag round trip per
call, ``(world - 1) * n`` bytes pushed per rank: the fastest for small messages. Reduce-scatter
and all-gather push each peer only its part, which is already the least traffic there is.
Runs on the GPUs of one node (``collectives/peer``); the dispatcher's check says why not elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..peer.memory import DTYPES
from ._base import Algorithm
from ._peer import check_peer_call, peer_fast_path, peer_run

if TYPE_CHECKING:
    from ..dispatch import Call

__all__ = ["OneShot"]


class OneShot(Algorithm):
    name = "one_shot"
    ops = frozenset({"all_reduce", "reduce_scatter", "all_gather"})
    dtypes = DTYPES
    backends = frozenset({"nccl"})
    topology_aware = True
    summary = "peer memory, one push and one reduction (GPUs of one node)"

    def check(self, call: Call) -> None:
        check_peer_call(self.name, call)

    def run(self, call: Call) -> None:
        peer_run(self.name, call)

    def fast_path(self, call: Call) -> Any:
        return peer_fast_path(self.name, call)
