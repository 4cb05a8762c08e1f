"""The patrol (``collectives/_watch.py``) and communication recorded outside the verbs
(``collectives.dispatch.recorded``: the peer MoE transport, the copy-engine overlap paths), whose
host waits on the GPU or sleeps, not inside Gloo, on 2 Gloo ranks.

A MoE dispatch carries each rank's own token count: ranks whose rows differ are not a mismatch,
and a call that waits long (a cold machine compiling its kernels) must leave the group as it was:
a raw Gloo call after it works. (It once did not: the patrol compared the row counts, called it a
mismatch and closed the group's Gloo connections, which nothing noticed until peer memory's next
all-gather failed with "Application timeout caused pair closure".) A real mismatch, a row width
that differs, is raised by the call itself when it ends, and the group is aborted after it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import collectives as C
from collectives.dispatch import recorded
from collectives.errors import CollectiveMismatch, GroupAborted
from collectives.peer.memory import _all_gather_ints

WAIT_S = 3.5  # longer than COMMOPS_CHECK_AFTER_S (2 s) plus the patrol's period (0.5 s)


def _long_call(rank: int, world: int, hidden: int) -> Any:
    g = dist.new_group(list(range(world)), backend="gloo")
    comm = C.get_communicator(g)
    try:
        C.all_reduce(torch.ones(1), group=g)  # the first call's settings check puts the group under the patrol
        x = torch.zeros(5 + 3 * rank, hidden)  # this rank's tokens
        out = torch.empty(7 + rank, hidden, device="meta")
        raised = None
        try:
            with recorded(comm, "moe_dispatch", "peer", out, x):
                time.sleep(WAIT_S)  # the host waits outside Gloo (on the GPU, or compiling)
        except CollectiveMismatch as exc:
            raised = str(exc)
        try:  # raw Gloo on the group: what peer memory's construction and close exchange through
            raw = _all_gather_ints(comm, [rank])
        except Exception as exc:  # noqa: BLE001 - what the test reports
            raw = f"{type(exc).__name__}: {exc}"[:300]
        try:
            C.all_reduce(torch.ones(1), group=g)
            verb = "ok"
        except GroupAborted:
            verb = "aborted"
        return raised, raw, verb
    finally:
        C.destroy(g)


def test_a_long_dispatch_with_each_ranks_own_row_count_leaves_the_group_usable(worlds) -> None:  # noqa: ANN001
    for raised, raw, verb in worlds(2).run(_long_call, 8, timeout=120):
        assert raised is None and raw == [[0], [1]] and verb == "ok", (raised, raw, verb)


def test_a_row_width_that_differs_is_raised_by_the_call_and_aborts_the_group(worlds) -> None:  # noqa: ANN001
    for rank, (raised, raw, verb) in enumerate(worlds(2).run(_long_call_mismatch, timeout=120)):
        assert raised is not None and "in_shape" in raised, (rank, raised)
        assert raw.startswith("GroupAborted") and verb == "aborted", (rank, raw, verb)


def _long_call_mismatch(rank: int, world: int) -> Any:
    return _long_call(rank, world, 8 + rank)


def _long_forward(rank: int, world: int) -> Any:
    """The pipelined forward (``moe_forward``) with each rank's own tokens, as the dispatch above."""
    g = dist.new_group(list(range(world)), backend="gloo")
    comm = C.get_communicator(g)
    try:
        C.all_reduce(torch.ones(1), group=g)
        x = torch.zeros(4 + 5 * rank, 8)
        with recorded(comm, "moe_forward", "peer", torch.empty(x.shape, device="meta"), x):
            time.sleep(WAIT_S)
        return _all_gather_ints(comm, [rank])
    finally:
        C.destroy(g)


def test_a_long_pipelined_forward_with_each_ranks_own_tokens_leaves_the_group_usable(worlds) -> None:  # noqa: ANN001
    assert worlds(2).run(_long_forward, timeout=120) == [[[0], [1]]] * 2
