"""What the peer-memory algorithms share: the contract, the planned all-reduce and the prepared runners.

Design note. Each peer algorithm is one module (``one_shot.py``, ``two_shot.py``,
``copy_engine.py``) whose ``PeerAlgorithm`` runs its calls on a ``collectives.peer.PeerMemory``
through that object's public launch API (``kernel``, ``stream``, ``blocks``, ``validate``,
``copy_engines``). This package imports ``collectives.peer``, never the other way round.

* **Plans.** An all-reduce's pieces and kernels for each (algorithm, dtype, size) are worked out
  once (``PeerAlgorithm.plan``) and kept in the memory's ``PeerState`` (``pm.state``), which the
  memory clears when its grid changes or it closes: this is on the path of every small
  all-reduce, whose budget is a few microseconds of host time. The copy engines work their
  chunks out per call (``PER_CALL``).
* **Prepared runners** (``PeerAlgorithm.runner``). For repeats of one call signature, a call that
  is one kernel launch keeps that launch's parameter block per tensor address
  (``_launch.Kernel.prepare``): a repeat on the same tensors is then a single driver call. The
  compiled runner (``collectives/_fastpath.c``, through ``collectives/_native.py``) reads these
  tables (``_Ready``: address(es) -> ``(function, blocks, Prepared, name)``, then ``(graph
  handle, OneKernelGraph)`` where one was made) and launches such entries itself; their shape
  is its contract. This is the one place outside ``collectives/peer`` that uses ``_launch``
  directly (the bare launch and the one-kernel graphs), as ``collectives/_native.py`` does.
"""

from __future__ import annotations

import enum
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final, NamedTuple

import torch

from .. import _env, _native
from .._wait import gpu_done, limit
from ..errors import UnsupportedError
from ..peer import _launch
from ..peer.memory import DTYPES, PACK_BYTES, PeerMemory, peer_memory, peer_unavailable
from ._base import Algorithm

if TYPE_CHECKING:
    from ..communicator import Communicator
    from ..dispatch import Call

__all__ = ["PeerAlgorithm", "PeerState", "Plan", "Unplanned", "PER_CALL", "Launch", "READY_MAX"]

_REDUCE_OPS = ("sum", "avg")
_GRACE_S = 5.0
READY_MAX = 64  # prepared launches per runner; a full table starts again


@dataclass(frozen=True, slots=True)
class Plan:
    """An all-reduce's launches for one (algorithm, dtype, size): one kernel for 16-byte aligned
    tensors and one for the others, each with its pieces ``(blocks, byte offset, a, b)``, launched
    as ``kernel(blocks, stream, base + offset, base + offset, a, b)``."""

    aligned: _launch.Kernel
    unaligned: _launch.Kernel
    aligned_pieces: tuple[tuple[int, int, int, int], ...]
    unaligned_pieces: tuple[tuple[int, int, int, int], ...]


class Unplanned(enum.Enum):
    """What a plan can say instead of launches."""

    PER_CALL = "the algorithm works its launches out on every call"


PER_CALL: Final = Unplanned.PER_CALL  # a plan that says: nothing to keep (the copy engines' chunks)


class Launch(NamedTuple):
    """One kernel launch of a call: ``kernel(blocks, stream, *args)``."""

    kernel: _launch.Kernel
    blocks: int
    args: tuple[int, ...]


class _Ready(dict):  # type: ignore[type-arg]
    """One runner's prepared launches: tensor address(es) -> (function, blocks, Prepared, name),
    followed, for the compiled runner, by (graph handle, OneKernelGraph) where one could be made.
    Compared and hashed by identity (so that a WeakSet can hold it)."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__  # type: ignore[assignment]
    graphs = False  # make a one-kernel graph of each launch (the compiled runner launches those)


_GRAPHS_FAILED: list[str] = []  # why a one-kernel graph could not be made (then none is tried again)


class PeerState:
    """What the peer algorithms keep per ``PeerMemory`` (``pm.state(PeerState)``): the plans by
    (algorithm, dtype, elements) and the live runners' prepared launches. ``clear()`` (the
    memory calls it when its grid changes or it closes) drops both."""

    def __init__(self) -> None:
        self.plans: dict[tuple[str, torch.dtype, int], Plan | Unplanned] = {}
        self.ready: weakref.WeakSet[_Ready] = weakref.WeakSet()  # held by their runners alone

    def clear(self) -> None:
        self.plans.clear()
        for ready in self.ready:
            ready.clear()


class PeerAlgorithm(Algorithm):
    """An algorithm run on ``collectives.peer.PeerMemory`` (NCCL groups on one node); a subclass
    names itself, its ops and its summary, plans its all-reduce (``plan``) and runs the other ops
    it has. The calls below take the memory first; each is collective over its group and runs
    on torch's current stream."""

    dtypes = DTYPES
    backends = frozenset({"nccl"})
    topology_aware = True
    prepares: ClassVar[bool] = True  # a repeated call that is one launch may be kept (runner)

    # -- the contract ----------------------------------------------------------------------------
    def plan(self, pm: PeerMemory, tensor: torch.Tensor) -> Plan | Unplanned:
        """The all-reduce's launches for ``tensor``'s dtype and size (``tensor`` validated), or
        ``PER_CALL`` when ``all_reduce_per_call`` works them out on every call."""
        raise NotImplementedError

    def all_reduce_per_call(self, pm: PeerMemory, tensor: torch.Tensor, vec: bool) -> None:
        """The all-reduce of an algorithm whose plan is ``PER_CALL`` (``vec``: 16-byte aligned)."""
        raise NotImplementedError

    def reduce_scatter(self, pm: PeerMemory, output: torch.Tensor, input: torch.Tensor, average: bool = False) -> None:
        """``output`` ([m]) = this rank's shard of the sum (or average) of every rank's ``input`` ([world * m])."""
        raise UnsupportedError("algorithm", self.name, "is not a peer-memory reduce-scatter or all-gather",
                               "use 'one_shot' or 'copy_engine'")

    def all_gather(self, pm: PeerMemory, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` ([world * m]) = every rank's ``input`` ([m]) in rank order."""
        raise UnsupportedError("algorithm", self.name, "is not a peer-memory reduce-scatter or all-gather",
                               "use 'one_shot' or 'copy_engine'")

    def one_launch(self, pm: PeerMemory, state: PeerState, op: str, output: torch.Tensor,
                   input: torch.Tensor) -> Launch | None:
        """The launch of a call that was one launch (just made by the general method), or None."""
        if op != "all_reduce":
            return None
        plan = state.plans.get((self.name, output.dtype, output.numel()))
        if plan is None or plan is PER_CALL:
            return None
        base = output.data_ptr()
        aligned = base % PACK_BYTES == 0
        pieces = plan.aligned_pieces if aligned else plan.unaligned_pieces
        if len(pieces) != 1:
            return None
        blocks, off, a, b = pieces[0]
        return Launch(plan.aligned if aligned else plan.unaligned, blocks, (base + off, base + off, a, b))

    # -- calls -----------------------------------------------------------------------------------
    def all_reduce(self, pm: PeerMemory, tensor: torch.Tensor, average: bool = False) -> None:
        """In-place sum (or average) of ``tensor`` over the group. The pieces and kernels of each
        (algorithm, dtype, size) are worked out once and kept (``plan``)."""
        self._all_reduce(pm, pm.state(PeerState), tensor, average)

    def _all_reduce(self, pm: PeerMemory, state: PeerState, tensor: torch.Tensor, average: bool) -> None:
        key = (self.name, tensor.dtype, tensor.numel())
        plan = state.plans.get(key)
        if plan is None:
            pm.validate(tensor)
            plan = state.plans[key] = self.plan(pm, tensor)
        if pm.error_record[0]:
            pm.check()
        if tensor.get_device() != pm.device_index:
            pm.validate(tensor)
        base = tensor.data_ptr()
        if plan is PER_CALL:
            self.all_reduce_per_call(pm, tensor, base % PACK_BYTES == 0)
        else:
            aligned = base % PACK_BYTES == 0
            k = plan.aligned if aligned else plan.unaligned
            stream = pm.stream()
            for blocks, off, a, b in (plan.aligned_pieces if aligned else plan.unaligned_pieces):
                k(blocks, stream, base + off, base + off, a, b)
        if average:
            tensor.detach().div_(pm.world)  # as the verbs do: in place, unseen by autograd

    # -- repeated calls --------------------------------------------------------------------------
    def runner(self, pm: PeerMemory, op: str, average: bool = False, prepared: bool = True
               ) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """``run(output, input)``: ``op`` on ``pm`` ('all_reduce', in place on ``output``, which is
        ``input``; 'reduce_scatter'; 'all_gather'), for repeats of one call signature: the same
        dtype and element counts on every call (the dispatcher's fast path keys its runners so).

        With ``prepared``, a call that is one kernel launch keeps that launch's parameter block per
        tensor address (``_launch.Kernel.prepare``): a repeat on the same tensors is then a single
        driver call, with nothing planned or written. A new address, a call of several pieces, the
        copy engines and averages take the general method; so does every call once a kernel has
        reported a timeout (which then raises), and the blocks are dropped when the grid changes
        or the buffers close.
        """
        state = pm.state(PeerState)
        if op == "all_reduce":
            def general(out: torch.Tensor, inp: torch.Tensor) -> None:
                self._all_reduce(pm, state, out, average)
        elif op == "reduce_scatter":
            def general(out: torch.Tensor, inp: torch.Tensor) -> None:
                self.reduce_scatter(pm, out, inp, average)
        elif op == "all_gather":
            def general(out: torch.Tensor, inp: torch.Tensor) -> None:
                self.all_gather(pm, out, inp)
        else:
            raise AssertionError(op)
        if not prepared or average or not self.prepares:
            return general
        ready = _Ready()  # held by run() alone: a runner the dispatcher lets go takes its blocks with it
        state.ready.add(ready)
        err, index, launch = pm.error_record, pm.device_index, _launch.launch
        in_place = op == "all_reduce"  # one tensor: its address is the key

        def run(out: torch.Tensor, inp: torch.Tensor) -> None:
            key = out.data_ptr() if in_place else (out.data_ptr(), inp.data_ptr())
            hit = ready.get(key)
            if hit is None or err[0]:
                general(out, inp)
                self._remember(pm, state, ready, key, op, out, inp)
                return
            launch(hit[0], hit[1], _launch.current_stream(index), hit[2].params, hit[3], index)
        run.ready = ready  # type: ignore[attr-defined]  # (launch/tune_peer.py times the bare launch)
        native = _native.configure_cuda()
        if native is not None:  # the same runner, compiled (collectives/_native.py): ``run`` serves its misses
            ready.graphs = _env.GRAPH_LAUNCH.get()
            return native.Runner(ready, pm.error_address, index, run, in_place)  # type: ignore[no-any-return]
        return run

    def _remember(self, pm: PeerMemory, state: PeerState, ready: _Ready, key: Any, op: str, out: torch.Tensor,
                  inp: torch.Tensor) -> None:
        """Keep the launch of a call that was one launch (just made by the general method)."""
        launch = self.one_launch(pm, state, op, out, inp)
        if launch is None:
            return
        k, blocks, args = launch
        if len(ready) >= READY_MAX:
            ready.clear()
        prepared = k.prepare(*args)
        entry: tuple[Any, ...] = (k.fn, blocks, prepared, k.name)
        if ready.graphs and not _GRAPHS_FAILED and not torch.cuda.is_current_stream_capturing():
            try:
                graph = _launch.OneKernelGraph(k.fn, blocks, prepared.params)
                entry += (graph.handle, graph)
            except (OSError, AttributeError, RuntimeError) as exc:  # an older driver: kernel launches, as before
                _GRAPHS_FAILED.append(repr(exc))
                warnings.warn(f"commops: repeated GPU calls are launched as kernels, not one-kernel CUDA graphs "
                              f"(each then costs the host more): {exc!r}. COMMOPS_GRAPH_LAUNCH=0 asks for kernel "
                              "launches and silences this.", RuntimeWarning, stacklevel=2)
        ready[key] = entry

    # -- the dispatcher's side -------------------------------------------------------------------
    def unavailable(self, comm: Communicator, op: str) -> str:
        return peer_unavailable(comm)

    def check(self, call: Call) -> None:
        """Raise before anything is sent if peer memory cannot run ``call`` (collective on a group's first call)."""
        if call.reduce_op is not None and call.reduce_op not in _REDUCE_OPS:
            raise UnsupportedError("op", call.reduce_op, f"{self.name} reduces with {' or '.join(_REDUCE_OPS)} only",
                                   "use algorithm='native' or 'auto' for max, min and prod")
        reason = self.unavailable(call.comm, call.op)
        if reason:
            raise UnsupportedError("algorithm", self.name, f"cannot run here: {reason}", "use 'native' or 'auto'")

    def run(self, call: Call) -> None:
        self.runner(peer_memory(call.comm), call.op, call.reduce_op == "avg", prepared=False)(call.output, call.input)
        bound = limit()
        if bound is not None and not call.async_op:
            # Inside call_timeout: wait on the host for the kernels, which give up on their own
            # after the PeerMemory's timeout (recording the peer that never arrived: check()
            # raises CollectiveTimeout naming it); the grace covers work queued before them.
            s = bound.total_seconds()
            gpu_done(s + _GRACE_S, s)
            peer_memory(call.comm).check()

    def fast_path(self, call: Call) -> Callable[[torch.Tensor, torch.Tensor], Any]:
        """Straight to PeerMemory: what ``dispatch_tensors`` keeps for repeats of ``call``'s signature
        (``runner``: a repeat on the same tensors is one prepared kernel launch)."""
        return self.runner(peer_memory(call.comm), call.op, call.reduce_op == "avg")
