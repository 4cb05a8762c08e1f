"""The MoE low-latency pair under ``torch.compile(fullgraph=True)``, on Gloo (2 and 3 ranks).

A transport defined here (``_PaddedAllToAll``: the plain all-to-all transport of
``test_overlap_moe_transport.py`` with a low-latency pair that pads each local expert's rows
into a ``[capacity, hidden]`` block) carries ``MoEDispatcher.dispatch_low_latency`` and
``combine_low_latency`` through their ops, ``torch.ops.commops.moe_dispatch_low_latency`` and
``moe_combine_low_latency``, with the experts computed on the padded blocks in between. The
compiled function must equal the eager one and the single-process definition (``reference_moe``,
float64), with token counts that differ between ranks, zero included, in one graph without a
break. The peer transport's own pair (the one that offers it in the library) runs on GPUs of one
node: the 2xH200 issue measures it compiled.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import pytest
import torch

from overlap.moe import MoEDispatcher, reference_moe
from overlap.moe.handles import DispatchHandle, LowLatencyHandle, TransportState
from tests._compiled import compile_checked, opcheck_failures
from tests.test_overlap_moe_transport import H, _data, _expert, _params, _PlainAllToAll, registered

NAME = "padded_all_to_all"
MAX_TOKENS = 12


class _Routed(TransportState):
    def __init__(self, handle: DispatchHandle) -> None:
        self.handle = handle


class _PaddedAllToAll(_PlainAllToAll):
    """The plain transport, and a low-latency pair on its dispatch: rows padded per local expert."""

    offers_low_latency: ClassVar[bool] = True

    def low_latency_capacity(self) -> int:
        return self.comm.size * MAX_TOKENS

    def dispatch_low_latency(self, x: torch.Tensor, topk_idx: torch.Tensor) -> tuple[torch.Tensor, LowLatencyHandle]:
        recv, h = self.dispatch(x, topk_idx)
        cap, e_loc = self.low_latency_capacity(), len(h.tokens_per_expert)
        blocks = torch.full((e_loc, cap, x.shape[1]), float("nan"), dtype=x.dtype)  # poisoned padding
        for e, rows in enumerate(recv.split(h.tokens_per_expert)):
            blocks[e, :rows.shape[0]] = rows
        counts = torch.tensor(h.tokens_per_expert, dtype=torch.int64)
        return blocks, LowLatencyHandle(counts, cap, x.shape[0], topk_idx.shape[1], _Routed(h))

    def combine_low_latency(self, expert_out: torch.Tensor, handle: LowLatencyHandle,
                            weights: torch.Tensor) -> torch.Tensor:
        state = handle.state
        assert isinstance(state, _Routed)
        h = state.handle
        rows = torch.cat([expert_out[e, :n] for e, n in enumerate(h.tokens_per_expert)])
        return self.combine(rows, weights, h, False)[0]

    def check_routing(self, handle: LowLatencyHandle, topk_idx: torch.Tensor) -> None:
        """The dispatch's routing was checked on the host (``route_on_host``) before any row moved."""


def _registered() -> contextlib.AbstractContextManager[None]:
    return registered(NAME, _PaddedAllToAll)


def _padded_experts(params: list[tuple[torch.Tensor, torch.Tensor]], blocks: torch.Tensor) -> torch.Tensor:
    """This rank's experts (``params``: each one's weight and bias) on every row of their blocks
    (padding included: it is never read)."""
    return torch.stack([torch.tanh(blocks[e] @ w + b) for e, (w, b) in enumerate(params)])


def _low_latency_case(rank: int, world: int, backend: str, seed: int) -> float:
    with _registered():
        E, k = 2 * world, 2
        disp = MoEDispatcher(E, H, dtype=torch.float64, transport=NAME)
        tokens = [0 if q == world - 1 else 5 + 3 * q for q in range(world)]  # the last rank sends nothing
        params = [_params(disp.first_expert + e) for e in range(disp.local_experts)]
        err = 0.0
        for step in range(3):  # fresh data every call: the compiled function runs again without recompiling
            x, idx, w = _data(rank, tokens[rank], E, k, seed + step)

            def step_fn(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
                blocks, handle = disp.dispatch_low_latency(x, idx)
                return disp.combine_low_latency(_padded_experts(params, blocks), handle, w)

            with torch.no_grad():
                eager = step_fn(x, idx, w)
                if step == 0:
                    compiled, traced = compile_checked(step_fn, backend, x, idx, w)
                    assert {"commops.moe_dispatch_low_latency", "commops.moe_combine_low_latency"} <= traced, traced
                got = compiled(x, idx, w)
            want = reference_moe(x, idx, w, _expert)
            assert got.shape == want.shape == eager.shape
            err = max(err, (got - want).abs().max().item() if got.numel() else 0.0,
                      (eager - want).abs().max().item() if got.numel() else 0.0)
        return err


@pytest.mark.parametrize("world_size,backend", [(2, "inductor"), (3, "aot_eager")])
def test_compiled_low_latency_pair_equals_the_single_process_definition(worlds, world_size: int,
                                                                       backend: str) -> None:  # noqa: ANN001
    errs = worlds(world_size).run(_low_latency_case, backend, 50, timeout=600)
    assert max(errs) < 1e-12, errs


def _opcheck_case(rank: int, world: int) -> list[str]:
    with _registered():
        E, k = 2 * world, 2
        disp = MoEDispatcher(E, H, dtype=torch.float64, transport=NAME)
        x, idx, w = _data(rank, 4 + rank, E, k, 70)
        # the dispatch keeps a handle per call that its combine takes: opcheck calls it several
        # times, with fake tensors too, and compares the outputs, which hold a fresh ticket each
        # time; its schema and fake implementation are checked here, the pair itself above
        blocks = (disp.local_experts, disp.transport_impl.low_latency_capacity())
        return opcheck_failures([("moe_dispatch_low_latency", (x, idx, *blocks, disp.op_name))],
                                {"moe_dispatch_low_latency": ("test_schema", "test_faketensor")})


def test_the_low_latency_ops_pass_opcheck(worlds) -> None:  # noqa: ANN001
    assert worlds(2).run(_opcheck_case, timeout=300) == [[], []]


