"""How ``algorithm="auto"`` picks an algorithm until the topology cost model replaces this rule.

The rule is a short list of named predicates, each one condition with its reason; thresholds that
come from measurements say where and when they were measured. Every choice is returned as a
:class:`Choice` that carries the rule that fired and a sentence a user can read
(``Communicator.last_choice``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .dispatch import Call

__all__ = ["Choice", "choose"]


@dataclass(frozen=True, slots=True)
class Choice:
    """The algorithm that ran a call and why."""

    algorithm: str
    rule: str
    reason: str


def _backend_is_vendor_tuned(backend: str) -> bool:
    # NCCL and HCCL pick among their own tuned kernels per size and topology; our point-to-point
    # schedules pay one launch and one synchronisation per step on top of the same links.
    return backend in ("nccl", "hccl")


def _is_single_rank(world: int) -> bool:
    return world == 1


# Measured 2026-11-30 on a 2-core VM, Gloo, 3 and 4 ranks, float32 (launch/bench_allreduce.py):
# recursive doubling took 0.12-0.5x native Gloo's time from 1 KB to 512 KB and tied at 1 MB.
SMALL_ALL_REDUCE_BYTES = 512 << 10


def _is_cpu_small_all_reduce(op: str, backend: str, nbytes: int) -> bool:
    # Gloo's and MPI's all-reduce pay several latencies per call on few cores; log2(p) exchanges win
    # until the message is large enough for bandwidth to dominate.
    return op == "all_reduce" and backend in ("gloo", "mpi") and nbytes <= SMALL_ALL_REDUCE_BYTES


_SINGLE = Choice("native", "single_rank", "one rank: the backend's collective is a local copy")


def choose(call: Call, backend: str) -> Choice:
    op, world = call.op, call.comm.size
    if _is_single_rank(world):
        return _SINGLE
    if _backend_is_vendor_tuned(backend):
        return Choice("native", "vendor_tuned", f"{backend} tunes its own algorithms per size and topology")
    nbytes = call.nbytes
    if _is_cpu_small_all_reduce(op, backend, nbytes):
        return Choice("recursive_doubling", "cpu_small_all_reduce",
                      f"{nbytes} B <= {SMALL_ALL_REDUCE_BYTES} B on {backend}: log2(p) exchanges beat {backend}'s all-reduce")
    return Choice("native", "default", f"no algorithm of ours measured faster than {backend}'s {op} here")
