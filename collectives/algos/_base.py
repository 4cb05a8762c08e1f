"""The contract every algorithm fills, and the base class of the point-to-point ones.

An algorithm declares, as class attributes, which ops it runs (``ops``), which dtypes
(``dtypes``; ``None`` means any dtype the op accepts), which backends (``backends``; ``None``
means any backend with point-to-point support) and, through :meth:`Algorithm.schedule`, the steps
it takes. :meth:`Algorithm.cost` describes its communication as the cost model prices it (a
:class:`topology.cost.CostPlan`), so that ``auto`` weighs every registered algorithm that has one,
a new one included, without an edit to the model. :meth:`Algorithm.run` does the work of one
validated call.

Bus bandwidth follows nccl-tests (``PERFORMANCE.md``): the factor that turns algorithm bandwidth
(bytes / time) into the per-link bandwidth a ring would need, so that numbers compare across
world sizes. It depends on the op only, not on the algorithm.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from topology.cost import CostPlan, Machine

from .._types import FLOAT_DTYPES, backend_moves
from ._executor import execute
from ._schedule import Layout, Schedule

if TYPE_CHECKING:
    from ..communicator import Communicator
    from ..dispatch import Call

__all__ = ["Algorithm", "ScheduledAlgorithm", "busbw_factor"]


def busbw_factor(op: str, world: int) -> float:
    """nccl-tests' bus-bandwidth factor for ``op`` on ``world`` ranks."""
    if world <= 1:
        return 0.0 if op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all") else 1.0
    if op == "all_reduce":
        return 2 * (world - 1) / world
    if op in ("reduce_scatter", "all_gather", "all_to_all"):
        return (world - 1) / world
    return 1.0  # broadcast, reduce


class Algorithm:
    """One way of running one or more collectives. Subclasses are registered by name."""

    name: ClassVar[str]
    ops: ClassVar[frozenset[str]]
    dtypes: ClassVar[frozenset[torch.dtype] | None] = None
    backends: ClassVar[frozenset[str] | None] = None
    # Only equal all-to-all splits (Bruck); checked by the dispatcher with a clear error.
    equal_splits_only: ClassVar[bool] = False
    summary: ClassVar[str] = ""
    # run() returns the backend's own Work for async calls (only the backend's collectives can).
    returns_work: ClassVar[bool] = False
    # check(call) must run before anything is sent (it reads the group's topology).
    topology_aware: ClassVar[bool] = False

    def supports(self, op: str, dtype: torch.dtype | None = None, backend: str | None = None) -> bool:
        if op not in self.ops:
            return False
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return False
        if backend is not None and self.backends is not None and backend not in self.backends:
            return False
        if dtype is not None and not self.moves(dtype, backend):
            return False
        return True

    def moves(self, dtype: torch.dtype, backend: str | None) -> bool:
        """Whether the backend ops this algorithm runs on move ``dtype`` (its collectives, here)."""
        return backend_moves(backend, dtype)

    def busbw_factor(self, op: str, world: int) -> float:
        return busbw_factor(op, world)

    def unavailable(self, comm: Communicator, op: str) -> str:
        """Why this algorithm cannot run ``op`` on ``comm``'s group whatever the call, or ``""``.
        Collective where it reads the group (the topology, peer memory): every rank asks."""
        return ""

    def check(self, call: Call) -> None:
        """Raise a typed error if this algorithm cannot run ``call`` (only if ``topology_aware``)."""

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """What ``op`` on ``nodes`` communicates, as the cost model prices it (``topology.price``).

        Args:
            op: one of :attr:`ops`.
            nodes: the group's ranks per node (``Topology.nodes()``).
            machine: the calibration; a plan may read which patterns the backend runs
                (``machine.native``), never link costs (the model applies those).

        Returns:
            The plan, or None where the model has no price for it: ``auto`` then never picks this
            algorithm by the model. Pure: nothing is sent.
        """
        return None

    def schedule(self, layout: Layout) -> Schedule:
        """The steps rank ``layout.rank`` takes; backends' own collectives have none to show."""
        raise NotImplementedError(f"{self.name} runs the backend's collective and has no schedule")

    def run(self, call: Call) -> Any:
        """Run one validated call; the backend's ``Work`` when ``call.async_op`` (native), else None."""
        raise NotImplementedError

    def fast_path(self, call: Call) -> Any:
        """A runner ``(output, input) -> None`` for later synchronous calls with the same signature
        (``dispatch.dispatch_tensors``), or None. Called after ``call`` ran."""
        return None


class ScheduledAlgorithm(Algorithm):
    """An algorithm built from point-to-point steps: build (cached) the schedule, then execute it."""

    # Point-to-point algorithms run wherever the backend has isend/irecv.
    backends = frozenset({"gloo", "nccl", "mpi", "hccl"})

    def __init__(self) -> None:
        self._cached = functools.lru_cache(maxsize=1024)(self.build)

    def moves(self, dtype: torch.dtype, backend: str | None) -> bool:
        return backend_moves(backend, dtype, p2p=True)  # sends and receives only

    def schedule(self, layout: Layout) -> Schedule:
        return self._cached(layout)

    def build(self, layout: Layout) -> Schedule:
        raise NotImplementedError

    def run(self, call: Call) -> None:
        sched = self.schedule(call.layout())
        execute(sched, call.buffers(), call.comm, call.reduce_op or "sum", call.tag)
        if call.reduce_op == "avg" and call.output is not None:
            _divide(call, call.comm.size)


def _divide(call: Call, world: int) -> None:
    # After an "avg" the reducing ranks hold a sum; reduce only defines the root's result.
    if call.op == "reduce" and call.comm.rank != call.root:
        return
    out = call.output
    assert out is not None
    if out.dtype in FLOAT_DTYPES:
        out.div_(world)
    else:  # the dispatcher rejects integer averages before anything is sent
        raise AssertionError("integer avg reached an algorithm")
