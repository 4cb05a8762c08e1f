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


_SINGLE = Choice("native", "single_rank", "one rank: the backend's collective is a local copy")


def choose(call: Call, backend: str) -> Choice:
    op, world = call.op, call.comm.size
    if _is_single_rank(world):
        return _SINGLE
    if _backend_is_vendor_tuned(backend):
        return Choice("native", "vendor_tuned", f"{backend} tunes its own algorithms per size and topology")
    return Choice("native", "default", f"no algorithm of ours measured faster than {backend}'s {op} here")
