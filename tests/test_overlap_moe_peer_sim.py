"""The peer MoE transport's device-side path (``PeerRows.dispatch_dense``, ``combine_dense``,
``combine_backward_dense``, and ``PeerTransport`` under the dispatcher's autograd Functions) on
CPU threads, with its kernels done by ``tests/_fake_rows.py``.

Every rank regenerates every rank's inputs; the expected ``recv_x``, output and gradients come
from the definitions (rank q's rows grouped by q's local expert, then source rank, then token; an
"expert" that scales a row by 1 + its global expert id, so a misrouted row shows), in float64,
not from the code under test. Several calls in a row with changing token counts exercise the
alternating halves of the buffer.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from collectives.errors import InvalidArgumentError
from collectives.peer import _launch
from overlap.moe import peer as PT
from overlap.moe import peer_kernels as PK
from overlap.moe import peer_plan as PP
from overlap.moe import peer_rows as P
from overlap.moe import pipeline as PL
from overlap.moe.dispatcher import _Combine, _Dispatch
from overlap.moe.peer import PeerDenseState, PeerOptions, PeerPaddedState, PeerTransport
from overlap.moe.transport import TransportSetup

from ._fake_rows import run_ranks

HIDDEN = 8


@pytest.fixture(autouse=True)
def _no_cuda_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_launch, "current_stream", lambda device: 0)
    # the threads share no communicator for the flight recorder to count calls on
    monkeypatch.setattr(PT, "recorded", lambda *args: contextlib.nullcontext())


def _transport(world: int, r: int, E: int, max_tokens: int, k: int, dtype: torch.dtype, mem: Any,
               capacity_factor: float | None = None, group: Any = None, transfers: str = "auto") -> PeerTransport:
    """Rank r's peer transport over the stand-in memory ``mem``."""
    setup = TransportSetup(SimpleNamespace(size=world, rank=r), group, E, HIDDEN, dtype, None, capacity_factor)
    return PeerTransport(setup, PeerOptions(max_tokens, k, transfers), memory=mem)


def _inputs(world: int, E: int, k: int, tokens: list[int], seed: int, dtype: torch.dtype) -> list[tuple[Any, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(world):
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens[s])]) if tokens[s] \
            else torch.zeros((0, k), dtype=torch.int64)
        x = torch.randn(tokens[s], HIDDEN, generator=g, dtype=torch.float64)
        w = torch.rand(tokens[s], k, generator=g, dtype=torch.float64)
        gout = torch.randn(tokens[s], HIDDEN, generator=g, dtype=torch.float64)
        out.append((idx, x.to(dtype), w.to(dtype), gout.to(dtype)))
    return out


def _expected_recv(ins: list[tuple[Any, ...]], q: int, e_loc: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, experts = [], []
    for e in range(q * e_loc, (q + 1) * e_loc):
        for idx, x, _, _ in ins:
            for t in range(idx.shape[0]):
                if e in idx[t].tolist():
                    rows.append(x[t].double())
                    experts.append(e)
    return (torch.stack(rows) if rows else torch.zeros(0, HIDDEN, dtype=torch.float64),
            torch.tensor(experts, dtype=torch.float64))


def _case(world: int, e_loc: int, k: int, rounds: list[list[int]], dtype: torch.dtype, seed: int) -> None:
    E = world * e_loc
    max_tokens = max(max(r) for r in rounds) + 2
    row_bytes = HIDDEN * torch.empty((), dtype=dtype).element_size()
    tol = 1e-5 if dtype == torch.float32 else 3e-2

    def rank_fn(mem: Any, r: int) -> None:
        transport = _transport(world, r, E, max_tokens, k, dtype, mem)
        rows = transport.rows()
        assert mem.slot_bytes >= rows.slot_bytes_needed and rows.row_bytes == row_bytes
        for c, tokens in enumerate(rounds):
            ins = _inputs(world, E, k, tokens, seed + c, dtype)
            idx, x, w, gout = ins[r]
            want_recv, experts = _expected_recv(ins, r, e_loc)
            # forward without autograd
            recv, layout = rows.dispatch_dense(x.contiguous(), idx)
            assert torch.equal(recv.double(), want_recv), (r, c)
            # where each local expert's rows end (GroupedSwiGLU(..., ends=)), from the same reference
            want_ends = torch.bincount(experts.long() - r * e_loc, minlength=e_loc).cumsum(0)
            assert layout.ends is not None and layout.ends.dtype == torch.int32, (r, c)
            assert torch.equal(layout.ends.long(), want_ends), (r, c, layout.ends, want_ends)
            y = (recv.double() * (experts + 1).unsqueeze(-1)).to(dtype)
            out = rows.combine_dense(layout, y.contiguous(), w.float())
            factor = (w.double() * (idx.double() + 1)).sum(1) if idx.numel() else torch.zeros(0, dtype=torch.float64)
            want_out = x.double() * factor.unsqueeze(-1)
            assert torch.allclose(out.double(), want_out, rtol=tol, atol=tol), (r, c)
            # with autograd, through the transport: the gradients of x and of the weights
            assert transport.routes_on_device(idx) and not transport.routes_ahead(idx)
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            box: list[Any] = []
            recv2 = _Dispatch.apply(xg, idx, None, transport, box)
            handle = box[0]
            assert isinstance(handle.state, PeerDenseState) and torch.equal(recv2.double(), want_recv), (r, c)
            assert handle.tokens_per_expert == torch.bincount(experts.long() - r * e_loc, minlength=e_loc).tolist()
            scale = (experts + 1).to(dtype).unsqueeze(-1)
            out2 = _Combine.apply(recv2 * scale, wg, handle, transport)
            assert torch.allclose(out2.double(), want_out, rtol=tol, atol=tol), (r, c)
            (out2 * gout).sum().backward()
            want_gx = gout.double() * factor.unsqueeze(-1)
            want_gw = (idx.double() + 1) * (x.double() * gout.double()).sum(-1, keepdim=True)
            assert torch.allclose(xg.grad.double(), want_gx, rtol=tol, atol=tol), (r, c)
            assert torch.allclose(wg.grad.double(), want_gw, rtol=tol, atol=tol), (r, c)

    run_ranks(world, PP.buffer_bytes(world, max_tokens, k, row_bytes), rank_fn)


@pytest.mark.parametrize("world,e_loc,k,rounds", [
    (2, 2, 2, [[5, 8], [3, 1], [6, 6]]),
    (3, 2, 3, [[6, 0, 9], [0, 0, 2]]),        # ranks without tokens
    (2, 4, 4, [[7, 5]]),                      # several of a token's experts on one rank
    (4, 1, 2, [[3, 6, 2, 5], [1, 1, 1, 1]]),
    (8, 1, 3, [[3, 0, 6, 2, 5, 1, 0, 4]]),    # the most ranks of one node (MAX_RANKS)
])
def test_dense_dispatch_combine_and_gradients(world: int, e_loc: int, k: int, rounds: list[list[int]]) -> None:
    _case(world, e_loc, k, rounds, torch.float32, seed=world * 10 + k)


@pytest.mark.parametrize("tile", [1, 3])
def test_dense_layout_over_several_tiles(monkeypatch: pytest.MonkeyPatch, tile: int) -> None:
    """rows_ids / rows_layout take a source's tokens a tile at a time, each tile's ranks starting
    from the counts of the tiles before it: with tiles of 1 and 3 tokens, a few tokens span many
    (a rank without tokens, and one whose last tile is partial, included)."""
    monkeypatch.setattr(PK, "LAYOUT_TILE", tile)
    _case(3, 2, 2, [[7, 0, 10], [4, 5, 3]], torch.float32, seed=70 + tile)
    _padded_case(2, 2, 3, [[8, 5]], tile)


def test_dense_path_in_bf16() -> None:
    _case(2, 3, 2, [[9, 4], [2, 7]], torch.bfloat16, seed=3)


@pytest.mark.parametrize("bad,text", [(0, "same expert twice"), (99, "outside")])
def test_a_bad_routing_on_one_rank_raises_on_every_rank(bad: int, text: str) -> None:
    world, E, k = 2, 4, 2

    def rank_fn(mem: Any, r: int) -> str:
        rows = P.PeerRows(SimpleNamespace(size=world, rank=r), 8, k, HIDDEN * 4, E, memory=mem)
        idx = torch.tensor([[0, 1], [2, 3]])
        if r == 1:
            idx[:, 1] = bad if bad else idx[:, 0]
        try:
            rows.dispatch_dense(torch.randn(2, HIDDEN), idx)
        except InvalidArgumentError as exc:
            msg = str(exc)
        else:
            return "nothing raised"
        # the next dispatch, with a good routing, still works on every rank
        recv, _ = rows.dispatch_dense(torch.ones(2, HIDDEN), torch.tensor([[0, 1], [2, 3]]))
        assert bool((recv == 1).all())
        return msg

    msgs = run_ranks(world, PP.buffer_bytes(world, 8, k, HIDDEN * 4), rank_fn)
    assert all(text in m and "Fix:" in m for m in msgs), msgs
    assert "rank 1" in msgs[0], msgs


@pytest.mark.parametrize("world,e_loc,k,rounds", [
    (2, 2, 2, [[5, 8], [3, 1], [6, 6]]),
    (3, 2, 3, [[6, 0, 9], [0, 0, 2]]),
])
def test_padded_dispatch_and_combine(world: int, e_loc: int, k: int, rounds: list[list[int]]) -> None:
    """The low-latency layout: expert e's rows first in its block of ``cap``, counts on the device."""
    _padded_case(world, e_loc, k, rounds, 0)


def _padded_case(world: int, e_loc: int, k: int, rounds: list[list[int]], seed: int) -> None:
    E = world * e_loc
    max_tokens = max(max(r) for r in rounds) + 2
    row_bytes = HIDDEN * 4

    def rank_fn(mem: Any, r: int) -> None:
        transport = _transport(world, r, E, max_tokens, k, torch.float32, mem)
        rows = transport.rows()
        cap = world * max_tokens
        for c, tokens in enumerate(rounds):
            ins = _inputs(world, E, k, tokens, 50 + seed + c, torch.float32)
            idx, x, w, _ = ins[r]
            want_recv, experts = _expected_recv(ins, r, e_loc)
            through = c % 2  # every other round through the transport's low-latency pair
            if through:
                recv, handle = transport.dispatch_low_latency(x, idx)
                assert isinstance(handle.state, PeerPaddedState) and handle.capacity == cap
                counts, layout = handle.tokens_per_expert, handle.state.layout
            else:
                recv, counts, layout = rows.dispatch_padded(x.contiguous(), idx)
            assert recv.shape == (e_loc, cap, HIDDEN) and layout.cap == cap
            per_expert = [int((experts == r * e_loc + e).sum()) for e in range(e_loc)]
            assert counts.tolist() == per_expert, (r, c)
            got = torch.cat([recv[e, :per_expert[e]] for e in range(e_loc)]).double()
            assert torch.equal(got, want_recv), (r, c)
            # every row of every block through the "expert" of its block: rows past the counts are
            # never read back
            scale = (torch.arange(e_loc, dtype=torch.float32) + r * e_loc + 1).view(e_loc, 1, 1)
            if through:
                out = transport.combine_low_latency(recv * scale, handle, w.float())
                transport.check_routing(handle, idx)
            else:
                out = rows.combine_padded(layout, recv * scale, w.float())
            factor = (w.double() * (idx.double() + 1)).sum(1) if idx.numel() else torch.zeros(0, dtype=torch.float64)
            assert torch.allclose(out.double(), x.double() * factor.unsqueeze(-1), rtol=1e-5, atol=1e-5), (r, c)

    run_ranks(world, PP.buffer_bytes(world, max_tokens, k, row_bytes), rank_fn)


def test_padded_dispatch_checks_the_routing_only_when_asked() -> None:
    world, E, k = 2, 4, 2

    def rank_fn(mem: Any, r: int) -> str:
        rows = P.PeerRows(SimpleNamespace(size=world, rank=r), 8, k, HIDDEN * 4, E, memory=mem)
        idx = torch.tensor([[0, 1], [2, 3]])
        if r == 1:
            idx[:, 1] = idx[:, 0]  # rank 1 repeats an expert
        _, _, layout = rows.dispatch_padded(torch.randn(2, HIDDEN), idx)
        try:
            rows.check_padded(layout, idx)
        except InvalidArgumentError as exc:
            return str(exc)
        return "nothing raised"

    msgs = run_ranks(world, PP.buffer_bytes(world, 8, k, HIDDEN * 4), rank_fn)
    assert all("same expert twice" in m for m in msgs) and "rank 1" in msgs[0], msgs


class _SameStream:
    """``pipeline._Streams`` on one CPU thread: everything runs in order already."""

    def __init__(self, rows: Any, device: Any) -> None:
        pass

    def on_side(self) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def side_mark(self) -> None:
        return None

    def main_mark(self) -> None:
        return None

    def main_waits(self, ev: Any, *used: Any) -> None:
        pass

    def side_waits(self, ev: Any, *used: Any) -> None:
        pass

    def copy_stream(self, i: int) -> int:
        return 0

    def join(self, *used: Any) -> None:
        pass

    def to_host_beside(self, t: Any, pinned: Any, after: Any = None) -> Any:
        pinned.copy_(t)
        return lambda: None


@pytest.mark.parametrize("transfers", ["copy_engine", "sm"])
@pytest.mark.parametrize("world,e_loc,k,tokens,chunks", [
    (2, 2, 2, [9, 6], 2),
    (2, 3, 3, [10, 2], 3),    # a rank with fewer tokens than chunks: empty chunks
    (3, 1, 2, [4, 0, 7], 4),
    (8, 1, 2, [5, 0, 3, 6, 1, 2, 7, 4], 2),
])
def test_pipelined_forward_over_the_device_layout(monkeypatch: pytest.MonkeyPatch, world: int, e_loc: int, k: int,
                                                  tokens: list[int], chunks: int, transfers: str) -> None:
    monkeypatch.setattr(PL, "_Streams", _SameStream)
    E = world * e_loc
    max_tokens = max(tokens) + 1
    row_bytes = HIDDEN * 4

    def rank_fn(mem: Any, r: int) -> None:
        transport = _transport(world, r, E, max_tokens, k, torch.float32, mem, transfers=transfers)
        rows = transport.rows()
        ins = _inputs(world, E, k, tokens, 70 + chunks, torch.float32)
        idx, x, w, _ = ins[r]

        def experts(recv: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
            scale = torch.repeat_interleave(torch.arange(e_loc, dtype=torch.float32) + r * e_loc + 1,
                                            torch.tensor(per_expert))
            return recv * scale.unsqueeze(-1)

        T = x.shape[0]
        bounds = [(T * i // chunks, T * (i + 1) // chunks) for i in range(chunks)]
        for i in range(2):  # twice: the section's regions reused after its closing barrier
            if i:  # the second time through the transport's pipeline, which the dispatcher calls
                out = transport.pipeline(x, idx, w.float(), experts, bounds)
                assert transport.last_pipeline == rows.last_pipeline
            else:
                out = rows.pipelined_dense(x.contiguous(), idx, w.float(), experts, bounds)
            factor = (w.double() * (idx.double() + 1)).sum(1) if idx.numel() else torch.zeros(0, dtype=torch.float64)
            assert torch.allclose(out.double(), x.double() * factor.unsqueeze(-1), rtol=1e-5, atol=1e-5), r
            assert rows.last_pipeline is not None and rows.last_pipeline[0] == transfers
        # and a plain dispatch after the section
        recv, _ = rows.dispatch_dense(x.contiguous(), idx)
        assert torch.equal(recv.double(), _expected_recv(ins, r, e_loc)[0])

    run_ranks(world, PP.buffer_bytes(world, max_tokens, k, row_bytes, copy_engine=transfers == "copy_engine"), rank_fn)


def test_pipeline_transfers_auto_runs_sm_kernels_and_copy_engine_needs_a_buffer_sized_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PL, "_Streams", _SameStream)
    world, e_loc, k, T, chunks = 2, 2, 2, 400, 2
    row_bytes = HIDDEN * 4
    # what the SM pipeline needs (buffer_bytes without its 1 MiB floor), short of the copy-engine section
    plain = max(2 * PP.layout_bytes(world, T, k, row_bytes)[2], 2 * chunks * PP.layout_bytes(world, T // chunks, k, row_bytes)[2])
    assert plain < PP.ce_section_bytes(world, T, k, row_bytes, chunks) <= PP.buffer_bytes(world, T, k, row_bytes, copy_engine=True)

    def rank_fn(mem: Any, r: int) -> tuple[Any, str]:
        rows = P.PeerRows(SimpleNamespace(size=world, rank=r), T, k, row_bytes, world * e_loc, memory=mem)
        idx, x, w, _ = _inputs(world, world * e_loc, k, [T, T], 5, torch.float32)[r]
        bounds = [(0, T // 2), (T // 2, T)]
        out = rows.pipelined_dense(x.contiguous(), idx, w, lambda recv, per: recv, bounds)
        assert torch.allclose(out, x * w.sum(1, keepdim=True), rtol=1e-5, atol=1e-6)
        last = rows.last_pipeline
        rows.pipeline_transfers = "copy_engine"
        try:
            rows.pipelined_dense(x.contiguous(), idx, w, lambda recv, per: recv, bounds)
        except InvalidArgumentError as exc:
            return last, str(exc)
        return last, "nothing raised"

    for last, msg in run_ranks(world, plain, rank_fn):
        assert last[0] == "sm" and "measured no gain" in last[1], last
        assert "pipeline_transfers" in msg and "copy_engine" in msg and "needs" in msg, msg


def test_a_bad_routing_in_the_copy_engine_pipeline_raises_everywhere_and_leaves_it_usable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PL, "_Streams", _SameStream)
    world, e_loc, k, T = 3, 2, 2, 6
    E, row_bytes = world * e_loc, HIDDEN * 4

    def rank_fn(mem: Any, r: int) -> str:
        rows = P.PeerRows(SimpleNamespace(size=world, rank=r), T, k, row_bytes, E, memory=mem,
                          pipeline_transfers="copy_engine")
        idx, x, w, _ = _inputs(world, E, k, [T] * world, 9, torch.float32)[r]
        bounds = [(0, 3), (3, T)]
        bad = idx.clone()
        if r == 2:
            bad[4, 1] = E  # out of range, in the second chunk
        try:
            rows.pipelined_dense(x.contiguous(), bad, w, lambda recv, per: recv, bounds)
            msg = "nothing raised"
        except InvalidArgumentError as exc:
            msg = str(exc)
        out = rows.pipelined_dense(x.contiguous(), idx, w, lambda recv, per: recv, bounds)
        assert rows.last_pipeline[0] == "copy_engine"
        assert torch.allclose(out, x * w.sum(1, keepdim=True), rtol=1e-5, atol=1e-6), r
        return msg

    msgs = run_ranks(world, PP.buffer_bytes(world, T, k, row_bytes, copy_engine=True), rank_fn)
    assert all("rank 2" in m for m in msgs[:2]) and "topk_idx" in msgs[2] and "nothing" not in msgs[2], msgs


def _gathering(world: int) -> Any:
    """``collectives.all_gather_single`` between the threads of ``run_ranks`` (the group is the rank)."""
    import threading

    parts: list[Any] = [None] * world
    met = threading.Barrier(world, timeout=30)

    def all_gather_single(out: torch.Tensor, inp: torch.Tensor, group: int) -> None:
        parts[group] = inp.clone()
        met.wait()
        out.copy_(torch.cat(parts))
        met.wait()

    return SimpleNamespace(all_gather_single=all_gather_single)


def kept_pairs(idx: torch.Tensor, E: int, cf: float | None) -> set[tuple[int, int]]:
    """The (token, expert) pairs a capacity factor ``cf`` keeps: each expert's first pairs in
    token order, up to ``ceil(cf * pairs / E)`` (all of them without one)."""
    import math

    cap = math.inf if cf is None else math.ceil(cf * idx.numel() / E)
    taken, out = [0] * E, set()
    for t in range(idx.shape[0]):
        for e in idx[t].tolist():
            if taken[e] < cap:
                taken[e] += 1
                out.add((t, e))
    return out


@pytest.mark.parametrize("via", ["rows", "transport"])
@pytest.mark.parametrize("cf", [None, 0.5])
def test_host_planned_dispatch_and_combine(monkeypatch: pytest.MonkeyPatch, cf: float | None, via: str) -> None:
    """The path a capacity factor takes: the plan worked out on the host (``plan``), the rows moved
    by ``rows_gather``, ``rows_partial`` and ``rows_sum``; the expected rows keep each expert's
    first pairs in token order up to the capacity. ``via="transport"``: the same through
    ``PeerTransport.route`` (every rank's ids all-gathered), ``dispatch_rows`` and ``combine``."""
    import numpy as np

    from overlap.moe import sorted_pairs

    world, e_loc, k, tokens = 3, 2, 2, ([9, 4, 7] if via == "rows" else [9, 0, 7])
    E, max_tokens, row_bytes = world * e_loc, 10, HIDDEN * 4
    monkeypatch.setattr(PT, "C", _gathering(world))

    def kept(idx: torch.Tensor) -> set[tuple[int, int]]:
        return kept_pairs(idx, E, cf)

    def rank_fn(mem: Any, r: int) -> None:
        transport = _transport(world, r, E, max_tokens, k, torch.float32, mem, cf, group=r)
        rows = transport.rows()
        for c in range(2):  # twice: the halves alternate
            ins = _inputs(world, E, k, tokens, 90 + c, torch.float32)
            sources = [(idx.numpy(), sorted_pairs(idx.numpy(), E, cf)[0], idx.shape[0]) for idx, _, _, _ in ins]
            scalars, arrays = PP.plan(r, world, e_loc, k, max_tokens, sources)
            plan = PP.build(scalars, [torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in arrays])
            keep = [kept(idx) for idx, _, _, _ in ins]
            want, experts = [], []
            for e in range(r * e_loc, (r + 1) * e_loc):
                for s_, (idx, x, _, _) in enumerate(ins):
                    for t in range(idx.shape[0]):
                        if (t, e) in keep[s_]:
                            want.append(x[t].double())
                            experts.append(e)
            idx, x, w, _ = ins[r]
            if via == "rows":
                recv = rows.dispatch(plan, x.contiguous(), len(want))
            else:
                assert transport.routes_on_device(idx) == (cf is None)  # route() plans on the host anyway
                (handle,) = transport.route(idx, [(0, idx.shape[0])])
                assert isinstance(handle.state, PT.PeerPlanState) and handle.state.rows is rows
                assert handle.dropped == idx.numel() - len(keep[r]) and sum(handle.tokens_per_expert) == len(want)
                recv = transport.dispatch_rows(x, handle)
            assert torch.equal(recv.double(), torch.stack(want)), (r, c)
            y = recv * (torch.tensor(experts, dtype=torch.float32) + 1).unsqueeze(-1)
            if via == "rows":
                out = rows.combine(plan, y.contiguous(), w.float())
            else:
                out, saved = transport.combine(y, w.float(), handle, weights_grad=False)
                assert saved[0] is None and saved[1] is not None and saved[1].shape[0] == len(keep[r])
            expect = torch.zeros(idx.shape[0], HIDDEN, dtype=torch.float64)
            for t in range(idx.shape[0]):
                for j, e in enumerate(idx[t].tolist()):
                    if (t, e) in keep[r]:
                        expect[t] += float(w[t, j]) * (e + 1) * x[t].double()
            assert torch.allclose(out.double(), expect, rtol=1e-5, atol=1e-5), (r, c)

    run_ranks(world, PP.buffer_bytes(world, max_tokens, k, row_bytes), rank_fn)


def _segments_mm(x: torch.Tensor, w: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, out: torch.Tensor,
                 *, index: torch.Tensor | None = None, w3: torch.Tensor | None = None) -> torch.Tensor:
    """The contract of ``_grouped_gemm.grouped_mm_segments`` (and, with ``w3``, of the SwiGLU
    form) in plain torch: the Triton kernels themselves are checked on a GPU."""
    for e, (lo, n) in enumerate(zip(starts.tolist(), counts.tolist())):
        a = x[index[lo:lo + n].long()] if index is not None else x[lo:lo + n]
        h = a @ w[e]
        out[lo:lo + n] = torch.nn.functional.silu(h) * (a @ w3[e]) if w3 is not None else h
    return out


def _expert_weights(g: int, ffn: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1000 + g)
    return tuple(torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.5
                 for shape in ((HIDDEN, ffn), (HIDDEN, ffn), (ffn, HIDDEN)))


@pytest.mark.parametrize("world,e_loc,k,tokens", [
    (2, 2, 2, [9, 6]),
    (2, 3, 3, [10, 0]),                  # a rank without tokens
    (3, 1, 2, [4, 0, 7]),
    (4, 2, 3, [5, 3, 0, 6]),
    (2, 4, 1, [7, 7]),                   # top-1: experts that get nothing
    (8, 2, 3, [5, 0, 3, 6, 1, 2, 7, 4]),  # the most ranks of one node (MAX_RANKS)
])
def test_pipeline_by_source_rank_matches_the_float64_moe(monkeypatch: pytest.MonkeyPatch, world: int, e_loc: int,
                                                         k: int, tokens: list[int]) -> None:
    from overlap.moe import _grouped_gemm as G

    monkeypatch.setattr(PL, "_Streams", _SameStream)
    monkeypatch.setattr(G, "grouped_mm_segments", lambda x, w, st, ct, out, *, index=None, sms=None:
                        _segments_mm(x, w, st, ct, out, index=index))
    monkeypatch.setattr(G, "grouped_swiglu_segments", lambda x, w1, w3, st, ct, out, *, index=None, sms=None:
                        _segments_mm(x, w1, st, ct, out, index=index, w3=w3))
    monkeypatch.setattr(G, "grouped_mm", lambda x, w, ends, *, sms=None: _segments_mm(
        x, w, torch.cat([ends.new_zeros(1), ends[:-1]]), ends - torch.cat([ends.new_zeros(1), ends[:-1]]),
        x.new_empty((x.shape[0], w.shape[2]))))
    E, ffn = world * e_loc, 4
    max_tokens = max(tokens) + 1
    row_bytes = HIDDEN * 4
    weights = [_expert_weights(g, ffn) for g in range(E)]

    def ref(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float64)
        for t in range(x.shape[0]):
            for j, g in enumerate(idx[t].tolist()):
                w1, w3, w2 = weights[g]
                a = x[t].double()
                out[t] += w[t, j].double() * ((torch.nn.functional.silu(a @ w1) * (a @ w3)) @ w2)
        return out

    def rank_fn(mem: Any, r: int) -> None:
        transport = _transport(world, r, E, max_tokens, k, torch.float32, mem, transfers="copy_engine")
        rows = transport.rows()
        mine = weights[r * e_loc:(r + 1) * e_loc]
        experts = SimpleNamespace(**{name: torch.stack([m[i] for m in mine]).float()
                                     for i, name in enumerate(("w1", "w3", "w2"))})
        for c in range(2):  # twice, with fresh inputs: the section's block reused after its closing barrier
            idx, x, w, _ = _inputs(world, E, k, tokens, 90 + c, torch.float32)[r]
            if c:  # the second time through the transport, which the dispatcher calls
                out = transport.pipeline_by_source(x, idx, w, experts)
                assert transport.last_pipeline == rows.last_pipeline
            else:
                out = rows.pipelined_sources(x.contiguous(), idx, w, experts)
            assert out.shape == x.shape
            assert torch.allclose(out.double(), ref(x, idx, w), rtol=1e-4, atol=1e-4), (r, c)
            assert rows.last_pipeline is not None and "by source" in rows.last_pipeline[1]
        recv, _ = rows.dispatch_dense(x.contiguous(), idx)  # and a plain dispatch after the section
        assert torch.equal(recv.double(), _expected_recv(_inputs(world, E, k, tokens, 91, torch.float32), r, e_loc)[0])

    run_ranks(world, PP.buffer_bytes(world, max_tokens, k, row_bytes, copy_engine=True), rank_fn)


def test_pipeline_by_source_rank_needs_a_buffer_sized_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PL, "_Streams", _SameStream)
    world, e_loc, k, T, row_bytes = 2, 2, 2, 20000, HIDDEN * 4
    plain = PP.buffer_bytes(world, T, k, row_bytes)
    assert PP.ce_section_bytes(world, T, k, row_bytes, 1) > plain

    def rank_fn(mem: Any, r: int) -> str:
        rows = P.PeerRows(SimpleNamespace(size=world, rank=r), T, k, row_bytes, world * e_loc, memory=mem)
        idx, x, w, _ = _inputs(world, world * e_loc, k, [5, 5], 3, torch.float32)[r]
        with pytest.raises(InvalidArgumentError) as info:
            rows.pipelined_sources(x.contiguous(), idx, w, SimpleNamespace())
        return str(info.value)

    for msg in run_ranks(world, plain, rank_fn):
        assert "pipeline_transfers" in msg and "copy_engine" in msg, msg


def _dispatcher_over(transport: PeerTransport, E: int, dtype: torch.dtype) -> Any:
    """A ``MoEDispatcher`` over ``transport`` without a process group (its checks and halves only)."""
    from overlap.moe.dispatcher import MoEDispatcher

    d = object.__new__(MoEDispatcher)
    d.num_experts, d.hidden, d.dtype, d.device = E, HIDDEN, dtype, None
    d.transport_impl, d.exchange_streams = transport, {}
    return d


@pytest.mark.parametrize("world,e_loc,k,rounds,n", [
    (2, 2, 2, [[9, 6], [0, 7]], 2),          # then a rank without tokens
    (3, 1, 2, [[5, 1, 8]], 3),               # a rank with fewer tokens than micro-batches
    (2, 3, 3, [[6, 6], [4, 9]], 2),          # several of a token's experts on one rank
])
def test_micro_batches_over_the_device_layout_with_gradients(monkeypatch: pytest.MonkeyPatch, world: int, e_loc: int,
                                                             k: int, rounds: list[list[int]], n: int) -> None:
    """``forward_micro_batches`` over the peer transport's dense path (the one the GPU check
    takes), forward and backward, against the definitions: an expert scales its rows by 1 + its
    id, a shared expert doubles every token."""
    E = world * e_loc
    max_tokens = max(max(r) for r in rounds) + 1
    # the GPU check of the transport (CUDA tensors on one node) does not apply to the threads
    monkeypatch.setattr(PeerTransport, "check_tokens", lambda self, x: None)

    def rank_fn(mem: Any, r: int) -> None:
        disp = _dispatcher_over(_transport(world, r, E, max_tokens, k, torch.float32, mem), E, torch.float32)

        def experts(recv: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
            scale = torch.repeat_interleave(torch.arange(e_loc, dtype=torch.float32) + r * e_loc + 1,
                                            torch.tensor(per_expert))
            return recv * scale.unsqueeze(-1)

        for c, tokens in enumerate(rounds):
            idx, x, w, gout = _inputs(world, E, k, tokens, 510 + 7 * c, torch.float32)[r]
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = disp.forward_micro_batches(xg, idx, wg, experts, n, lambda t: 2 * t)
            (out * gout).sum().backward()
            factor = (w.double() * (idx.double() + 1)).sum(1) if idx.numel() else torch.zeros(0, dtype=torch.float64)
            want_out = x.double() * (factor.unsqueeze(-1) + 2)
            want_gx = gout.double() * (factor.unsqueeze(-1) + 2)
            want_gw = (idx.double() + 1) * (x.double() * gout.double()).sum(-1, keepdim=True)
            for got, want in ((out, want_out), (xg.grad, want_gx), (wg.grad, want_gw)):
                assert got is not None and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), (r, c)

    run_ranks(world, PP.buffer_bytes(world, max_tokens, k, HIDDEN * 4), rank_fn)
