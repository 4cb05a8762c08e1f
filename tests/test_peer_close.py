"""``PeerMemory.close`` when not every rank can be waited for, on CPU with the CUDA runtime faked.

The close is a handshake: every rank stops pushing, unmaps the peers' buffers, meets the others
again, then frees its own. On a group that a failure aborted (``GroupAborted`` from the
all-gather) or where the all-gather fails (a peer gone), the close must still complete: the
peers' mappings released, this rank's own allocations left alone (a peer may still write into
them), the object closed, so that ``collectives.destroy`` goes on to destroy the group. The fake
runtime records each call; the all-gather is replaced by one that succeeds, raises
``GroupAborted``, or raises the RuntimeError torch.distributed gives on a timeout.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any

import pytest
import torch

from collectives.errors import GroupAborted
from collectives.peer import memory as M


class _Runtime:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def ipcCloseMemHandle(self, p: int) -> None:  # noqa: N802 - CuPy's name
        self.calls.append(("unmap", p))

    def free(self, p: int) -> None:
        self.calls.append(("free", p))


def _memory(monkeypatch: pytest.MonkeyPatch, gathers: list[Any]) -> tuple[M.PeerMemory, _Runtime]:
    """A PeerMemory holding two peer mappings (1, 2) and its own two allocations (3, 4); the
    all-gathers answer from ``gathers`` in turn (None: every rank met; an exception: raised)."""
    rt = _Runtime()
    cuda = types.SimpleNamespace(runtime=rt, Device=lambda index: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    answers = iter(gathers)

    def all_gather_ints(comm: Any, values: list[int]) -> list[list[int]]:
        got = next(answers)
        if got is not None:
            raise got
        return [[0], [0]]

    monkeypatch.setattr(M, "_all_gather_ints", all_gather_ints)
    pm = M.PeerMemory.__new__(M.PeerMemory)
    stopped: list[bool] = []
    pm.__dict__.update(closed=False, device=torch.device("cpu"), _opened=[1, 2], _own=[3, 4], _slot_tensor=None,
                       _views={}, _states={}, comm=types.SimpleNamespace(_group_name="g0"),
                       copy_engines=types.SimpleNamespace(stop=lambda: stopped.append(True)))
    pm.__dict__["_stopped"] = stopped
    return pm, rt


def test_a_close_every_rank_reaches_unmaps_then_frees(monkeypatch: pytest.MonkeyPatch) -> None:
    pm, rt = _memory(monkeypatch, [None, None])
    pm.close()
    assert rt.calls == [("unmap", 1), ("unmap", 2), ("free", 3), ("free", 4)]
    assert pm.closed and pm.__dict__["_stopped"] == [True]
    pm.close()  # a second close does nothing
    assert len(rt.calls) == 4


@pytest.mark.parametrize("at", [0, 1])
def test_a_close_on_an_aborted_group_unmaps_keeps_its_own_and_does_not_raise(monkeypatch: pytest.MonkeyPatch,
                                                                            at: int) -> None:
    gathers: list[Any] = [None, None]
    gathers[at] = GroupAborted("peer memory", "g0", "rank 1 did not arrive")
    pm, rt = _memory(monkeypatch, gathers)
    pm.close()
    assert rt.calls == [("unmap", 1), ("unmap", 2)]  # nothing of its own freed
    assert pm.closed and pm._own == [] and pm._opened == []


def test_a_close_whose_peer_does_not_answer_warns_and_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    pm, rt = _memory(monkeypatch, [RuntimeError("Timed out waiting 30000ms for recv operation to complete")])
    with pytest.warns(RuntimeWarning, match=r"group g0: not every rank reached its close \(Timed out"):
        pm.close()
    assert rt.calls == [("unmap", 1), ("unmap", 2)] and pm.closed
