"""Expert-parallel dispatch and combine, the experts, and the MoE layer built on them.

    from overlap.moe import MoEDispatcher, GroupedSwiGLU, reference_moe
"""

from .dispatcher import (
    DEVICE_ROUTING_MIN_PAIRS,
    MOE_TUNE_MIN_SPEEDUP,
    DispatchHandle,
    GroupedSwiGLU,
    LowLatencyHandle,
    MoEDispatcher,
    _block_permutation,
    _DenseCombine,
    _DenseDispatch,
    _from_moe_table,
    _grouped_mm_works,
    _PinnedSlots,
    reference_moe,
    sorted_pairs,
)

__all__ = ["MoEDispatcher", "DispatchHandle", "LowLatencyHandle", "GroupedSwiGLU", "reference_moe", "sorted_pairs",
           "DEVICE_ROUTING_MIN_PAIRS", "MOE_TUNE_MIN_SPEEDUP"]
