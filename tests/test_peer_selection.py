"""The peer-memory algorithms' contract on machines without GPUs: registration, ``auto``'s rule
and its reasons, and the errors raised before anything is sent.

The GPU behaviour (values, graphs, races, timeouts) is checked by ``tests/test_gpu_peer.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import collectives as C
from collectives import selection
from collectives.algos import REGISTRY, for_op
from collectives.dispatch import Call
from collectives.peer import PeerMemory, peer_unavailable

PEER = ("one_shot", "two_shot", "copy_engine")


def test_registered_for_nccl_only_and_float_dtypes() -> None:
    for name in PEER:
        algo = REGISTRY[name]
        assert algo.backends == frozenset({"nccl"})
        assert name in for_op("all_reduce", torch.bfloat16, "nccl")
        assert name not in for_op("all_reduce", torch.float32, "gloo")
        assert not algo.supports("all_reduce", torch.float64, "nccl")
        assert not algo.supports("all_reduce", torch.int32, "nccl")
    assert REGISTRY["one_shot"].supports("reduce_scatter", torch.float16, "nccl")
    assert REGISTRY["one_shot"].supports("all_gather", torch.float16, "nccl")
    assert not REGISTRY["two_shot"].supports("reduce_scatter", torch.float16, "nccl")


class _Comm:
    """What the rule reads from a communicator: its size and why peer memory cannot run."""

    def __init__(self, reason: str) -> None:
        self.size = 2
        self._peer_reason = reason


class _Tensor:
    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._numel = numel

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def _call(op: str, nbytes: int, dtype: torch.dtype = torch.bfloat16, reduce_op: str | None = "sum",
          reason: str = "") -> Call:
    t = _Tensor(nbytes // torch.empty((), dtype=dtype).element_size(), dtype)
    return Call(op, _Comm(reason), t, t, reduce_op=reduce_op)  # type: ignore[arg-type]


@pytest.mark.parametrize("op, limits", [
    ("all_reduce", [(selection.ONE_SHOT_MAX_BYTES, "one_shot"), (selection.PEER_ALL_REDUCE_MAX_BYTES, "two_shot")]),
    ("reduce_scatter", [(selection.PEER_REDUCE_SCATTER_ONE_SHOT_MAX_BYTES, "one_shot"),
                        (selection.PEER_REDUCE_SCATTER_CE_MAX_BYTES, "copy_engine")]),
    ("all_gather", [(selection.PEER_ALL_GATHER_MAX_BYTES, "one_shot")]),
])
def test_rule_picks_by_size_and_says_why(op: str, limits: list[tuple[int, str]]) -> None:
    low = 2
    for limit, name in limits:
        for nbytes in (low, limit):
            choice, why_not = selection._peer_memory(_call(op, nbytes), "nccl", nbytes)
            assert choice is not None and choice.algorithm == name and choice.rule == "peer_memory", (nbytes, choice)
            assert str(nbytes) in choice.reason and not why_not
        low = limit + 2
    over = limits[-1][0] + 2
    choice, why_not = selection._peer_memory(_call(op, over), "nccl", over)
    assert choice is None and "NCCL measured faster" in why_not


@pytest.mark.parametrize("world", [2, 4])
def test_large_all_reduce_takes_two_shot_only_in_one_piece(world: int) -> None:
    def call(nbytes: int, slot_bytes: int) -> Call:
        c = _call("all_reduce", nbytes)
        c.comm._peer_memory = SimpleNamespace(slot_bytes=slot_bytes, closed=False)  # type: ignore[attr-defined]
        c.comm.size = world  # type: ignore[attr-defined]
        return c

    # 1 GiB of slots: a two-shot piece holds 256 MiB, up to the measured limit
    for nbytes in (64 << 20, selection.PEER_ALL_REDUCE_ONE_PIECE_MAX_BYTES):
        choice, why_not = selection._peer_memory(call(nbytes, 1 << 30), "nccl", nbytes)
        assert choice is not None and choice.algorithm == "two_shot" and "one piece" in choice.reason, nbytes
    over, beyond = selection.PEER_ALL_REDUCE_ONE_PIECE_MAX_BYTES + 16, selection.PEER_ALL_REDUCE_BIG_MAX_BYTES + 16
    if world == 2:  # larger, with 1 GiB buffers or more: the copy engines' one shot, to any size
        for nbytes, slot in ((over, 1 << 30), (beyond, 4 << 30)):
            choice, why_not = selection._peer_memory(call(nbytes, slot), "nccl", nbytes)
            assert choice is not None and choice.algorithm == "copy_engine" and "one-shot" in choice.reason, nbytes
    else:  # larger, in pieces of 1 GiB buffers: two_shot up to its measured limit, then NCCL
        choice, why_not = selection._peer_memory(call(over, 1 << 30), "nccl", over)
        assert choice is not None and choice.algorithm == "two_shot" and "in pieces" in choice.reason
        choice, why_not = selection._peer_memory(call(beyond, 4 << 30), "nccl", beyond)
        assert choice is None and "NCCL measured faster" in why_not
    # 64 MiB of slots (the default) cut 64 MB into pieces: NCCL
    choice, why_not = selection._peer_memory(call(64 << 20, 64 << 20), "nccl", 64 << 20)
    assert choice is None and "COMMOPS_PEER_BYTES" in why_not


def test_large_reduce_scatter_and_all_gather_take_the_copy_engines_with_large_buffers() -> None:
    def pick(op: str, nbytes: int, slot_bytes: int) -> tuple[str | None, str]:
        c = _call(op, nbytes)
        c.comm._peer_memory = SimpleNamespace(slot_bytes=slot_bytes, closed=False)  # type: ignore[attr-defined]
        choice, why_not = selection._peer_memory(c, "nccl", nbytes)
        return (choice.algorithm if choice else None), (choice.reason if choice else why_not)

    big, small = selection.PEER_BIG_BUFFER_BYTES, 64 << 20
    rs_one = selection.PEER_REDUCE_SCATTER_ONE_SHOT_MAX_BYTES
    ag_one = selection.PEER_ALL_GATHER_ONE_SHOT_BIG_MAX_BYTES
    assert pick("reduce_scatter", rs_one, big)[0] == "one_shot"
    assert pick("reduce_scatter", rs_one + 16, big)[0] == "copy_engine"
    assert pick("reduce_scatter", 8 << 30, big)[0] == "copy_engine"  # no upper limit with a deep ring
    assert pick("all_gather", ag_one, big)[0] == "one_shot"
    algo, why = pick("all_gather", ag_one + 16, big)
    assert algo == "copy_engine" and str(big) in why
    # the default buffers: the all-gather never takes the copy engines, the reduce-scatter up to its limit
    assert pick("all_gather", ag_one + 16, small)[0] == "one_shot"
    algo, why = pick("all_gather", selection.PEER_ALL_GATHER_MAX_BYTES + 16, small)
    assert algo is None and "COMMOPS_PEER_BYTES" in why
    algo, why = pick("reduce_scatter", selection.PEER_REDUCE_SCATTER_CE_MAX_BYTES + 16, small)
    assert algo is None and "NCCL measured faster" in why


def test_rule_steps_aside_with_the_reason_peer_memory_cannot_run() -> None:
    choice, why_not = selection._peer_memory(_call("all_reduce", 1024, reason="the ranks span 2 nodes"), "nccl", 1024)
    assert choice is None and "the ranks span 2 nodes" in why_not


@pytest.mark.parametrize("case", ["gloo", "max", "float64", "all_to_all"])
def test_rule_does_not_apply(case: str) -> None:
    backend = "gloo" if case == "gloo" else "nccl"
    call = _call("all_to_all" if case == "all_to_all" else "all_reduce", 1024,
                 dtype=torch.float64 if case == "float64" else torch.bfloat16,
                 reduce_op="max" if case == "max" else "sum")
    assert selection._peer_memory(call, backend, 1024) == (None, "")


def _cpu_group_errors(rank: int, world: int) -> list[str]:
    comm = C.get_communicator()
    out = [peer_unavailable(comm)]
    try:
        PeerMemory(comm)
    except C.UnsupportedError as exc:
        out.append(str(exc))
    try:
        C.all_reduce(torch.ones(4), algorithm="one_shot")
    except C.UnsupportedError as exc:
        out.append(str(exc))
    return out


def test_cpu_group_is_refused_with_the_reason(worlds) -> None:  # noqa: ANN001
    for reasons in worlds(2).run(_cpu_group_errors):
        assert "no NCCL backend" in reasons[0]
        assert "cannot use peer memory" in reasons[1] and "Fix:" in reasons[1]
        assert "one_shot" in reasons[2] and "Fix:" in reasons[2]
