"""What the peer-memory algorithms share: the pre-send check and the call into ``PeerMemory``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedError
from ..peer.memory import peer_memory, peer_unavailable

if TYPE_CHECKING:
    from ..dispatch import Call

__all__ = ["check_peer_call", "peer_run", "peer_fast_path"]

_REDUCE_OPS = ("sum", "avg")


def check_peer_call(name: str, call: Call) -> None:
    """Raise before anything is sent if peer memory cannot run ``call`` (collective on a group's first call)."""
    if call.reduce_op is not None and call.reduce_op not in _REDUCE_OPS:
        raise UnsupportedError("op", call.reduce_op, f"{name} reduces with {' or '.join(_REDUCE_OPS)} only",
                               "use algorithm='native' or 'auto' for max, min and prod")
    reason = peer_unavailable(call.comm)
    if reason:
        raise UnsupportedError("algorithm", name, f"cannot run here: {reason}", "use 'native' or 'auto'")


def peer_run(name: str, call: Call) -> None:
    pm = peer_memory(call.comm)
    avg = call.reduce_op == "avg"
    if call.op == "all_reduce":
        pm.all_reduce(call.output, name, avg)
    elif call.op == "reduce_scatter":
        pm.reduce_scatter(call.output, call.input, avg)
    elif call.op == "all_gather":
        pm.all_gather(call.output, call.input)
    else:
        raise AssertionError(call.op)


def peer_fast_path(name: str, call: Call) -> Any:
    """The runner ``dispatch_tensors`` keeps for repeats of ``call``'s signature: straight to PeerMemory."""
    pm = peer_memory(call.comm)
    avg = call.reduce_op == "avg"
    if call.op == "all_reduce":
        return lambda out, inp: pm.all_reduce(out, name, avg)
    if call.op == "reduce_scatter":
        return lambda out, inp: pm.reduce_scatter(out, inp, avg)
    if call.op == "all_gather":
        return lambda out, inp: pm.all_gather(out, inp)
    return None
