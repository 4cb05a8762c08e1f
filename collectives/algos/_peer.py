"""What the peer-memory algorithms share: the contract, the pre-send check and the call into ``PeerMemory``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .._wait import gpu_done, limit
from ..errors import UnsupportedError
from ..peer.memory import DTYPES, peer_memory, peer_unavailable
from ._base import Algorithm

if TYPE_CHECKING:
    from ..communicator import Communicator
    from ..dispatch import Call

__all__ = ["PeerAlgorithm"]

_REDUCE_OPS = ("sum", "avg")
_GRACE_S = 5.0


class PeerAlgorithm(Algorithm):
    """An algorithm run by ``collectives.peer.PeerMemory`` (NCCL groups on one node); a subclass
    names itself, its ops and its summary."""

    dtypes = DTYPES
    backends = frozenset({"nccl"})
    topology_aware = True

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
        peer_memory(call.comm).runner(call.op, self.name, call.reduce_op == "avg", prepared=False)(call.output, call.input)
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
        (``PeerMemory.runner``: a repeat on the same tensors is one prepared kernel launch)."""
        return peer_memory(call.comm).runner(call.op, self.name, call.reduce_op == "avg")
