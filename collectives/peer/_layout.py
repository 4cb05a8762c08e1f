"""The layout of the peer buffers, as the host spells it; ``peer.cuh`` spells the same (the
constants are checked against it by ``tests/test_peer_constants.py``).

Each rank allocates a slot buffer (two sets of ``set_bytes``, used on alternate calls) and a
flag allocation: the block flags (``[MAX_BLOCKS][N_STAGES][MAX_RANKS]`` words), the copy-engine
flags (``[CE_RING][CE_STAGES][MAX_RANKS]`` words), then, from ``LL_OFF``, the low-latency words'
own area: two sets, each with a region of ``2 x ONE_SHOT_LL_MAX_BYTES`` (a message's words) per
rank. The words have an area of their own because a word is taken as soon as its high half
holds the call's number, and raw data left in the slots by other calls may hold any number there.

A leaf module that ``memory.py`` and ``copy_engines.py`` both read (``memory.py`` builds a
``CopyEngines``, so ``copy_engines.py`` cannot take these from it).
"""

from __future__ import annotations

__all__ = ["MAX_RANKS", "MAX_BLOCKS", "N_STAGES", "CE_RING", "CE_STAGES", "CE_PUSHED", "CE_REDUCED", "CE_PULLED",
           "BLOCK_FLAG_WORDS", "FLAG_BYTES", "PACK_BYTES", "ONE_SHOT_LL_MAX_BYTES", "LL_OFF", "ll_set_bytes",
           "ce_flag_offset", "STREAM_WAIT", "FENCE_CLEAR", "FENCE_OPEN", "FENCE_CLOSE"]

MAX_RANKS = 8
MAX_BLOCKS = 128
N_STAGES = 2
CE_RING, CE_STAGES = 16, 3  # copy-engine ring slots and flag stages (pushed, reduced, pulled)
CE_PUSHED, CE_REDUCED, CE_PULLED = 0, 1, 2
BLOCK_FLAG_WORDS = MAX_BLOCKS * N_STAGES * MAX_RANKS
FLAG_BYTES = (BLOCK_FLAG_WORDS + CE_RING * CE_STAGES * MAX_RANKS) * 4
PACK_BYTES = 16  # the kernels' vector loads and stores: 16-byte aligned addresses
ONE_SHOT_LL_MAX_BYTES = 256 << 10
LL_OFF = -(-FLAG_BYTES // 4096) * 4096  # the low-latency words' area, after the flags

STREAM_WAIT = 20  # the error record's stage when the section watchdog released stream waits
# ce_fence's mode bits (kernels.cu): zero this rank's copy-engine flags; open a section; close one
FENCE_CLEAR, FENCE_OPEN, FENCE_CLOSE = 1, 2, 4


def ll_set_bytes(world: int) -> int:
    """Bytes of one set of the low-latency words' area for ``world`` ranks."""
    return world * 2 * ONE_SHOT_LL_MAX_BYTES


def ce_flag_offset(slot: int, stage: int, source: int) -> int:
    """Bytes into a rank's flag allocation of its copy-engine flag (ring ``slot``, ``stage``) that
    rank ``source`` signals (``ce_flag`` in ``peer.cuh``)."""
    return (BLOCK_FLAG_WORDS + (slot * CE_STAGES + stage) * MAX_RANKS + source) * 4
