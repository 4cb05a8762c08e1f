"""Two shots over peer memory: a reduce-scatter by pushes, then an all-gather by pushes.

Rank r pushes shard p of its input into peer p's slots, sums the ``world`` copies of shard r,
and pushes the sum into every peer's gather slots. Each rank sends ``2 (world - 1) / world * n``
bytes, the bandwidth-optimal all-reduce, and reduces only ``n / world`` elements: the choice for
large messages. Runs on the GPUs of one node (``collectives/peer``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..peer.memory import DTYPES
from ._base import Algorithm
from ._peer import check_peer_call, peer_fast_path, peer_run

if TYPE_CHECKING:
    from ..dispatch import Call

__all__ = ["TwoShot"]


class TwoShot(Algorithm):
    name = "two_shot"
    ops = frozenset({"all_reduce"})
    dtypes = DTYPES
    backends = frozenset({"nccl"})
    topology_aware = True
    summary = "peer memory, reduce-scatter then all-gather by pushes (GPUs of one node)"

    def check(self, call: Call) -> None:
        check_peer_call(self.name, call)

    def run(self, call: Call) -> None:
        peer_run(self.name, call)

    def fast_path(self, call: Call) -> Any:
        return peer_fast_path(self.name, call)
