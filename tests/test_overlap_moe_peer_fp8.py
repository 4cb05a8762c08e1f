"""The FP8 dispatch over the peer transport (``PeerTransport.dispatch_packed``), on CPU threads
with the row kernels done by ``tests/_fake_rows.py``.

The packed rows are raw bytes moved as 4-byte words, so what arrives must be the sender's bytes
exactly: the expected rows are each source's ``fp8.quantize_rows`` of its own tokens, in the
layout's order (grouped by local expert, then source rank, then token), built from every rank's
regenerated inputs, not by the code under test. Dropless (the device layout) with autograd:
the gradient goes straight through the rounding, each token's sum of its rows' gradients (float64
reference). With a capacity factor: the host plan, the kept pairs only.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from collectives.errors import InvalidArgumentError
from collectives.peer import _launch
from overlap.moe import fp8
from overlap.moe import peer as PT
from overlap.moe import peer_plan as PP
from overlap.moe.peer import PeerDenseState, PeerOptions, PeerPlanState, PeerTransport
from overlap.moe.transport import TransportSetup

from ._fake_rows import run_ranks
from .test_overlap_moe_peer_sim import _gathering, kept_pairs

HIDDEN = 256  # two blocks of 128: a packed row is 256 + 8 bytes


@pytest.fixture(autouse=True)
def _no_cuda_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "current_stream", lambda device: 0)
    monkeypatch.setattr(PT, "recorded", lambda *args: contextlib.nullcontext())


def _inputs(world: int, E: int, k: int, tokens: list[int], seed: int, dtype: torch.dtype) -> list[tuple[Any, ...]]:
    """Every rank's (ids, tokens): tokens over six decades, so blocks get scales of their own."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(world):
        T = tokens[s]
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T \
            else torch.zeros((0, k), dtype=torch.int64)
        x = torch.randn(T, HIDDEN, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, HIDDEN, dtype=torch.float64)
        out.append((idx, x.to(dtype)))
    return out


def _pairs(ins: list[tuple[Any, ...]], q: int, e_loc: int, keep: list[set[tuple[int, int]]] | None = None
           ) -> list[tuple[int, int]]:
    """(source, token) of each row rank q receives, in the layout's order (``keep``: the pairs kept)."""
    out = []
    for e in range(q * e_loc, (q + 1) * e_loc):
        for s, (idx, _) in enumerate(ins):
            for t in range(idx.shape[0]):
                if e in idx[t].tolist() and (keep is None or (t, e) in keep[s]):
                    out.append((s, t))
    return out


def _transport(world: int, r: int, E: int, max_tokens: int, k: int, dtype: torch.dtype, mem: Any,
               cf: float | None = None) -> PeerTransport:
    setup = TransportSetup(SimpleNamespace(size=world, rank=r), r, E, HIDDEN, dtype, None, cf)
    return PeerTransport(setup, PeerOptions(max_tokens, k, "auto"), memory=mem)


@pytest.mark.parametrize("world,e_loc,k,rounds,dtype", [
    (2, 2, 2, [[5, 8], [3, 1]], torch.bfloat16),
    (3, 1, 2, [[6, 0, 4]], torch.float16),     # a rank without tokens
    (4, 2, 3, [[3, 5, 2, 6]], torch.float32),
])
def test_fp8_rows_arrive_as_sent_over_the_device_layout_with_gradients(world: int, e_loc: int, k: int,
                                                                       rounds: list[list[int]],
                                                                       dtype: torch.dtype) -> None:
    E, max_tokens = world * e_loc, max(max(r) for r in rounds) + 1
    row_bytes = HIDDEN * torch.empty((), dtype=dtype).element_size()

    def rank_fn(mem: Any, r: int) -> None:
        transport = _transport(world, r, E, max_tokens, k, dtype, mem)
        for c, tokens in enumerate(rounds):
            ins = _inputs(world, E, k, tokens, 70 + 10 * world + c, dtype)
            idx, x = ins[r]
            packed = [fp8.quantize_rows(xs) for _, xs in ins]  # each source's own packing (the definition)
            mine = _pairs(ins, r, e_loc)
            want = torch.stack([packed[s][t] for s, t in mine]) if mine else torch.zeros(0, fp8.packed_width(HIDDEN),
                                                                                        dtype=torch.uint8)
            assert transport.routes_on_device(idx)
            got, handle = transport.dispatch_packed(packed[r], idx)
            assert isinstance(handle.state, PeerDenseState) and got.dtype == torch.uint8
            assert torch.equal(got, want), (r, c)
            # through the FP8 dispatch with autograd: unpacked rows, then straight through
            xg = x.clone().requires_grad_()
            recv, handle = fp8.dispatch_fp8(transport, xg, idx)
            assert torch.equal(recv, fp8.dequantize_rows(want, HIDDEN, dtype)), (r, c)
            grads = [torch.randn(len(_pairs(ins, q, e_loc)), HIDDEN, dtype=torch.float64,
                                 generator=torch.Generator().manual_seed(900 + 31 * c + q)) for q in range(world)]
            recv.backward(grads[r].to(dtype))
            want_gx = torch.zeros(idx.shape[0], HIDDEN, dtype=torch.float64)
            for q in range(world):
                for i, (s, t) in enumerate(_pairs(ins, q, e_loc)):
                    if s == r:
                        want_gx[t] += grads[q][i].to(dtype).double()
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            assert torch.allclose(xg.grad.double(), want_gx, rtol=tol, atol=tol), (r, c)

    run_ranks(world, PP.buffer_bytes(world, max_tokens, k, row_bytes), rank_fn)


def test_fp8_rows_over_the_host_plan_keep_the_kept_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    world, e_loc, k, tokens, cf = 3, 2, 2, [9, 0, 7], 0.5
    E, max_tokens, dtype = world * e_loc, 10, torch.bfloat16
    monkeypatch.setattr(PT, "C", _gathering(world))

    def kept(idx: torch.Tensor) -> set[tuple[int, int]]:
        return kept_pairs(idx, E, cf)

    def rank_fn(mem: Any, r: int) -> None:
        transport = _transport(world, r, E, max_tokens, k, dtype, mem, cf)
        for c in range(2):  # twice: the buffer's halves alternate
            ins = _inputs(world, E, k, tokens, 300 + c, dtype)
            idx, _ = ins[r]
            packed = [fp8.quantize_rows(xs) for _, xs in ins]
            mine = _pairs(ins, r, e_loc, [kept(i) for i, _ in ins])
            assert not transport.routes_on_device(idx)
            got, handle = transport.dispatch_packed(packed[r], idx)
            assert isinstance(handle.state, PeerPlanState) and handle.dropped == idx.numel() - len(kept(idx))
            assert torch.equal(got, torch.stack([packed[s][t] for s, t in mine])), (r, c)

    run_ranks(world, PP.buffer_bytes(world, max_tokens, k, HIDDEN * 2), rank_fn)


def test_rows_wider_than_the_tokens_or_not_whole_words_are_refused_before_anything_is_sent() -> None:
    world, E, k = 2, 4, 2

    def rank_fn(mem: Any, r: int) -> list[str]:
        transport = _transport(world, r, E, 4, k, torch.bfloat16, mem)
        idx = torch.tensor([[0, 3], [1, 2]])
        msgs = []
        for bad in (torch.zeros(2, 2 * HIDDEN + 4, dtype=torch.uint8), torch.zeros(2, 262, dtype=torch.uint8),
                    torch.zeros(2, 66)):
            with pytest.raises(InvalidArgumentError) as e:
                transport.dispatch_packed(bad, idx)
            msgs.append(str(e.value))
        # over the host plan (a capacity factor) too, before the ids' all-gather (none is set up here)
        planned = _transport(world, r, E, 4, k, torch.bfloat16, mem, cf=0.5)
        with pytest.raises(InvalidArgumentError, match="wider than the tokens"):
            planned.dispatch_packed(torch.zeros(2, 2 * HIDDEN + 4, dtype=torch.uint8), idx)
        # nothing was sent: the next dispatch on every rank still meets its peers
        x = torch.randn(2, HIDDEN).to(torch.bfloat16)
        got, _ = transport.dispatch_packed(fp8.quantize_rows(x), idx)
        msgs.append(f"ok {got.shape[1]}")
        return msgs

    for msgs in run_ranks(world, PP.buffer_bytes(world, 4, k, HIDDEN * 2), rank_fn):
        assert "wider than the tokens' 512 B" in msgs[0] and "packed" in msgs[0], msgs
        assert "multiple of 4" in msgs[1] and "uint8" in msgs[2], msgs
        assert msgs[3] == f"ok {fp8.packed_width(HIDDEN)}", msgs
