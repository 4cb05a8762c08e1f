"""Names shared by the whole package: canonical op names, reduce ops, dtype classes, backends.

Reduce ops are accepted as torch's ``ReduceOp`` members or as lower-case strings and normalised to
the strings below once, at the dispatch point; algorithms only ever see the strings.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .errors import InvalidArgumentError, InvalidTypeError

__all__ = ["OPS", "REDUCE_OPS", "ReduceOp", "BACKEND_DTYPES", "P2P_DTYPES", "backend_moves", "normalize_reduce_op", "torch_reduce_op"]

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
_RED_OP_TYPE = type(ReduceOp.SUM)  # ReduceOp.RedOpType

FLOAT_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})
INT_DTYPES = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64})
COMPLEX_DTYPES = frozenset({torch.complex64, torch.complex128})
FLOAT8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})
# Dtypes every reducing algorithm handles; moving data (gather, all-to-all, broadcast) takes any
# dtype the backend moves (BACKEND_DTYPES).
REDUCIBLE_DTYPES = FLOAT_DTYPES | INT_DTYPES

# Device type each backend moves data on.
BACKEND_DEVICES = {"gloo": "cpu", "mpi": "cpu", "nccl": "cuda", "hccl": "npu"}

# The dtypes each backend's own collectives take (complex ones as a real view, as torch does), and
# those its point-to-point ops move. Gloo: probed with torch 2.13 (tests/test_validate_fuzz.py
# probes it again): its collectives raise "Invalid scalar type" for int16, the unsigned 16-64 bit
# types and float8, after the call has started; its send and receive move any dtype's bytes, so
# the point-to-point algorithms (ring, recursive doubling, ...) run those. NCCL: the dtypes torch's
# ProcessGroupNCCL maps to an NCCL type (float8 as bytes: moved, never reduced), for collectives
# and point-to-point alike (probed on an H200 by tests/test_gpu_dtype_table.py). A backend missing
# here (MPI, HCCL) is not checked by dtype. ``Algorithm.supports`` applies the row that its kind of
# algorithm uses, so ``auto`` never picks one that cannot move the dtype, and a dtype no
# algorithm moves is refused by name before anything is sent.
_MOVED = FLOAT_DTYPES | frozenset({torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool}) | COMPLEX_DTYPES
BACKEND_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "gloo": _MOVED,
    "nccl": _MOVED | FLOAT8_DTYPES,
}
P2P_DTYPES: dict[str, frozenset[torch.dtype]] = {
    "nccl": BACKEND_DTYPES["nccl"],
}


def backend_moves(backend: str | None, dtype: torch.dtype, p2p: bool = False) -> bool:
    """Whether ``backend``'s collectives (or with ``p2p`` its point-to-point ops) move ``dtype``
    (True for what the tables do not list)."""
    known = (P2P_DTYPES if p2p else BACKEND_DTYPES).get(backend or "")
    return known is None or dtype in known


def normalize_reduce_op(op: object) -> str:
    """Return the canonical lower-case name of ``op`` or raise a typed error naming the choices.

    Only a ``ReduceOp`` member or a string is a reduce op. torch's enum compares equal to its
    integer value, so an int (or a bool) would otherwise pass as one: 3 is MIN, True is AVG.
    """
    if isinstance(op, str):
        key = _ALIASES.get(op.lower(), op.lower())
        if key in _TO_TORCH:
            return key
    elif isinstance(op, (_RED_OP_TYPE, ReduceOp)):
        # a ReduceOp object (ReduceOp(ReduceOp.MAX)) carries its member in .op
        name = _FROM_TORCH.get(op if isinstance(op, _RED_OP_TYPE) else op.op)  # type: ignore[call-overload, union-attr]
        if name is not None:
            return name
    else:
        raise InvalidTypeError(
            "op", op, f"is a {type(op).__name__}, not a reduce op",
            f"pass one of {', '.join(REDUCE_OPS)} as torch.distributed.ReduceOp.<NAME> or a string",
        )
    raise InvalidArgumentError(
        "op", op, "not a supported reduce op",
        f"pass one of {', '.join(REDUCE_OPS)} (as torch.distributed.ReduceOp or a string)",
    )


def torch_reduce_op(name: str) -> Any:  # a ReduceOp member (typed RedOpType by torch's stubs)
    return _TO_TORCH[name]
