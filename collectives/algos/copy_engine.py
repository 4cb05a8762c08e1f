"""Copy engine over peer memory: the bytes cross NVLink by cudaMemcpyAsync, SMs only reduce.

A reduce-scatter by copy-engine pushes into the peers' slots, a reduction on SMs, then an
all-gather by copy-engine pulls of the peers' reduced shards, pipelined in chunks through a ring
of slots on a second stream (``collectives/peer/kernels.cu``). Each rank moves the least bytes
an all-reduce can, without taking SMs from concurrent kernels: the choice for large messages,
where SM-driven stores peak below the copy engines (``launch/tune_peer.py`` measures both).
Reduce-scatter and all-gather are the two halves: copy-engine pushes into the peers' slots,
then an SM reduction into the output (reduce-scatter) or copy-engine copies out of the slots
(all-gather, no SMs at all; ``PeerMemory._ce_by_shard``). Runs on the GPUs of one node
(``collectives/peer``).
"""

from __future__ import annotations

from ._peer import PeerAlgorithm

__all__ = ["CopyEngine"]


class CopyEngine(PeerAlgorithm):
    name = "copy_engine"
    ops = frozenset({"all_reduce", "reduce_scatter", "all_gather"})
    summary = "peer memory, copy-engine pushes and pulls with an SM reduction, pipelined (GPUs of one node)"
