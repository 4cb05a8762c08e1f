"""Names shared by the whole package: canonical op names, reduce ops, dtype classes, backends.

Reduce ops are accepted as torch's ``ReduceOp`` members or as lower-case strings and normalised to
the strings below once, at the dispatch point; algorithms only ever see the strings.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError

__all__ = ["OPS", "REDUCE_OPS", "ReduceOp", "normalize_reduce_op", "torch_reduce_op"]

ReduceOp = dist.ReduceOp

# Canonical op names, as used by the registry, the tracing hook and the benchmarks.
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce", "barrier")
# The ops that move data (everything but the barrier): what tests and benchmarks sweep.
DATA_OPS = OPS[:-1]
REDUCING_OPS = frozenset({"all_reduce", "reduce_scatter", "reduce"})

REDUCE_OPS = ("sum", "avg", "max", "min", "prod")

_FROM_TORCH = {
    ReduceOp.SUM: "sum",
    ReduceOp.AVG: "avg",
    ReduceOp.MAX: "max",
    ReduceOp.MIN: "min",
    ReduceOp.PRODUCT: "prod",
}
_TO_TORCH = {v: k for k, v in _FROM_TORCH.items()}
_ALIASES = {"product": "prod", "mean": "avg"}

FLOAT_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
INT_DTYPES = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})
# Dtypes every reducing algorithm handles; moving data (gather, all-to-all, broadcast) takes any.
REDUCIBLE_DTYPES = FLOAT_DTYPES | INT_DTYPES

# Device type each backend moves data on.
BACKEND_DEVICES = {"gloo": "cpu", "mpi": "cpu", "nccl": "cuda", "hccl": "npu"}


def normalize_reduce_op(op: object) -> str:
    """Return the canonical lower-case name of ``op`` or raise a typed error naming the choices."""
    try:
        name = _FROM_TORCH.get(op)  # type: ignore[call-overload]
    except TypeError:  # unhashable values
        name = None
    if name is not None:
        return name
    if isinstance(op, str):
        key = _ALIASES.get(op.lower(), op.lower())
        if key in _TO_TORCH:
            return key
    raise InvalidArgumentError(
        "op", op, "not a supported reduce op",
        f"pass one of {', '.join(REDUCE_OPS)} (as torch.distributed.ReduceOp or a string)",
    )


def torch_reduce_op(name: str) -> Any:  # a ReduceOp member (typed RedOpType by torch's stubs)
    return _TO_TORCH[name]
