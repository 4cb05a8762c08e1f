"""Expert-parallel dispatch and combine, the experts, and the MoE layer built on them.

    from overlap.moe import MoEDispatcher, GroupedSwiGLU, reference_moe
"""

from .dispatcher import (
    DEVICE_ROUTING_MIN_PAIRS,
    MOE_TUNE_MIN_SPEEDUP,
    DispatchHandle,
    LowLatencyHandle,
    MoEDispatcher,
    _block_permutation,
    _DenseCombine,
    _DenseDispatch,
    _from_moe_table,
    sorted_pairs,
)
from .experts import GroupedSwiGLU
from .layer import MoELayer
from .reference import reference_moe

__all__ = ["MoEDispatcher", "MoELayer", "DispatchHandle", "LowLatencyHandle", "GroupedSwiGLU", "reference_moe", "sorted_pairs",
           "DEVICE_ROUTING_MIN_PAIRS", "MOE_TUNE_MIN_SPEEDUP"]
