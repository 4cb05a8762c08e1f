"""commops overlap: GEMM + collective operators and the tensor-parallel layers built on them.

    from overlap import gemm_all_reduce, gemm_reduce_scatter, all_gather_gemm
    from overlap.layers import ColumnParallelLinear, RowParallelLinear
    from overlap import MoEDispatcher, MoELayer, GroupedSwiGLU, reference_moe   # overlap.moe
    from overlap import parallelize       # a transformers model, sharded in place (overlap.models)
    from overlap import fused_all_reduce_rmsnorm   # all-reduce + residual + RMSNorm (overlap.norm)

Each operator equals a plain sequence (``reference_*`` beside it) and is differentiable; the
layers follow Megatron-LM's semantics (``overlap/layers.py``). The mixture of experts lives in
``overlap/moe/`` (its design note says what each module holds).
"""

from .moe import (
    DispatchHandle,
    GroupedSwiGLU,
    LowLatencyHandle,
    MoEDispatcher,
    MoELayer,
    NcclOptions,
    PeerOptions,
    reference_moe,
    register_transport,
)
from .models import parallelize
from .norm import fused_all_reduce_rmsnorm, reference_all_reduce_rmsnorm
from .ops import (
    STRATEGIES,
    OverlapChoice,
    all_gather_gemm,
    gemm_all_reduce,
    gemm_reduce_scatter,
    last_choice,
    reference_all_gather_gemm,
    reference_gemm_all_reduce,
    reference_gemm_reduce_scatter,
    set_tuned,
)

__all__ = [
    "gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm",
    "reference_gemm_all_reduce", "reference_gemm_reduce_scatter", "reference_all_gather_gemm",
    "OverlapChoice", "last_choice", "set_tuned", "STRATEGIES",
    "MoEDispatcher", "MoELayer", "GroupedSwiGLU", "reference_moe", "DispatchHandle", "LowLatencyHandle",
    "NcclOptions", "PeerOptions", "register_transport", "parallelize",
    "fused_all_reduce_rmsnorm", "reference_all_reduce_rmsnorm",
]
