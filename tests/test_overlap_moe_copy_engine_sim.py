"""The copy-engine MoE exchange's plan and bookkeeping, on CPU threads (``tests/_fake_peer.py``):
every rank's ``recv_x`` and combined output against their definitions, with uneven routing,
a rank without tokens, more pieces than rows, and a peer buffer so small that the piece count
grows and ring slots are reused.

The routing inputs of the plan (the sort by expert, the counts, the regrouping) are computed
here the way ``MoEDispatcher.route_chunks`` defines them; the expected rows come from the
definition of dispatch and combine (rank q's rows, grouped by q's local expert, then by source
rank, then by token), not from that code.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from overlap import _moe_copy_engine as M

from ._fake_peer import run_ranks, use_fake_streams


@pytest.fixture
def fake_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    use_fake_streams(monkeypatch)


def _routing(world: int, e_loc: int, k: int, tokens: list[int], seed: int) -> list[tuple[Any, ...]]:
    rng = np.random.default_rng(seed)
    E = world * e_loc
    out = []
    for s in range(world):
        idx = np.stack([rng.permutation(E)[:k] for _ in range(tokens[s])]) if tokens[s] else np.zeros((0, k), int)
        x = torch.from_numpy(rng.standard_normal((tokens[s], 8)))
        w = torch.from_numpy(rng.random((tokens[s], k)))
        out.append((idx, x, w))
    return out


def _inputs(routes: list[tuple[Any, ...]], world: int, e_loc: int, k: int, rank: int) -> dict[str, Any]:
    """What route_chunks hands the plan, for one rank."""
    E = world * e_loc
    counts = []
    for idx, _, _ in routes:
        counts.append(np.bincount(idx.reshape(-1), minlength=E).reshape(world, e_loc))
    idx = routes[rank][0]
    order = np.argsort(idx.reshape(-1), kind="stable")
    send = counts[rank].sum(1).tolist()
    matrix = np.stack([counts[s][rank] for s in range(world)])  # [source, local expert]
    recv = matrix.sum(1).tolist()
    regroup = np.argsort(np.repeat(np.tile(np.arange(e_loc), world), matrix.reshape(-1)), kind="stable")
    between = np.array([[counts[s][q].sum() for q in range(world)] for s in range(world)])
    return dict(order=order, send=send, recv=recv, regroup=regroup, between=between, per_expert=matrix.sum(0))


def _case(world: int, e_loc: int, k: int, tokens: list[int], pieces: int, slot_bytes: int,
          seed: int) -> tuple[int, int]:
    routes = _routing(world, e_loc, k, tokens, seed)
    hidden = 8
    row_bytes = hidden * 8

    def rank_fn(pm: Any, r: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        ins = _inputs(routes, world, e_loc, k, r)
        scalars, arrays = M.plan(r, world, pieces, ins["order"], k, ins["send"], ins["recv"], ins["regroup"],
                                 ins["between"], row_bytes, slot_bytes)
        plan = M.build(scalars, [torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in arrays])
        x, w = routes[r][1], routes[r][2]
        recv_x = M.dispatch(pm, plan, x, sum(ins["recv"]))
        # an "expert" that scales its rows by 1 + its local index, so misrouted rows show
        scale = torch.repeat_interleave(torch.arange(e_loc, dtype=torch.float64) + 1,
                                        torch.from_numpy(ins["per_expert"]))
        out = M.combine(pm, plan, recv_x * scale.unsqueeze(-1), w, x.shape[0])
        return recv_x, out, (plan.pieces, plan.ring)

    got = run_ranks(world, slot_bytes, rank_fn)
    for q in range(world):
        want = []
        for e in range(e_loc):
            for s in range(world):
                idx, x, _ = routes[s]
                for t in range(idx.shape[0]):
                    if q * e_loc + e in idx[t]:
                        want.append(x[t])
        want_x = torch.stack(want) if want else torch.zeros(0, hidden, dtype=torch.float64)
        assert torch.equal(got[q][0], want_x), (q, got[q][0].shape, want_x.shape)
        idx, x, w = routes[q]
        factor = torch.from_numpy((w.numpy() * (idx % e_loc + 1)).sum(1)) if idx.size else torch.zeros(0)
        assert torch.allclose(got[q][1], x * factor.unsqueeze(-1).to(x.dtype), atol=1e-12), q
    assert len({g[2] for g in got}) == 1, "every rank must agree on the piece count and the ring"
    return got[0][2]


@pytest.mark.parametrize("world,e_loc,k,tokens,pieces", [
    (2, 2, 2, [5, 8], 1),
    (2, 3, 2, [7, 4], 3),
    (3, 2, 3, [6, 0, 9], 2),      # a rank without tokens
    (3, 1, 2, [4, 5, 3], 16),     # more pieces than rows: empty pieces
    (4, 2, 2, [3, 6, 2, 5], 4),
])
def test_copy_engine_dispatch_and_combine(fake_streams: None, world: int, e_loc: int, k: int, tokens: list[int],
                                          pieces: int) -> None:
    _case(world, e_loc, k, tokens, pieces, 1 << 20, seed=world * 100 + pieces)


@pytest.mark.parametrize("world", [2, 3])
def test_small_buffer_grows_the_pieces_and_reuses_slots(fake_streams: None, world: int) -> None:
    # a peer buffer of a few 256-byte regions: rows of 64 B, so a handful of rows per piece
    pieces, ring = _case(world, 2, 2, [24 + 5 * r for r in range(world)], 1, 4 * 256 * world, seed=7 + world)
    assert pieces > ring >= 2, (pieces, ring)


def test_a_row_larger_than_the_buffer_is_refused() -> None:
    with pytest.raises(M.UnsupportedError, match="COMMOPS_PEER_BYTES"):
        M.plan(0, 2, 1, np.arange(2), 1, [1, 1], [1, 1], np.arange(2), np.ones((2, 2), int), 1 << 20, 1 << 16)


def _pipelined_case(world: int, e_loc: int, k: int, tokens: list[int], chunks: int, pieces: int, slot_bytes: int,
                    seed: int) -> None:
    routes = _routing(world, e_loc, k, tokens, seed)
    row_bytes = 64  # rows of 8 float64

    def rank_fn(pm: Any, r: int) -> torch.Tensor:
        _, x, w = routes[r]
        T = x.shape[0]
        bounds = [(T * i // chunks, T * (i + 1) // chunks) for i in range(chunks)]
        plans, totals, per_expert = [], [], []
        for c, (lo, hi) in enumerate(bounds):
            # chunk c of every rank: its own routing, as route_chunks plans it
            sub = []
            for s, (idx, xs, ws) in enumerate(routes):
                Ts = xs.shape[0]
                a, b = Ts * c // chunks, Ts * (c + 1) // chunks
                sub.append((idx[a:b], xs[a:b], ws[a:b]))
            ins = _inputs(sub, world, e_loc, k, r)
            scalars, arrays = M.plan(r, world, pieces, ins["order"], k, ins["send"], ins["recv"], ins["regroup"],
                                     ins["between"], row_bytes, slot_bytes)
            plans.append(M.build(scalars, [torch.from_numpy(np.asarray(a_, dtype=np.int64)) for a_ in arrays]))
            totals.append(sum(ins["recv"]))
            per_expert.append(ins["per_expert"].tolist())

        def experts(rows: torch.Tensor, tpe: list[int]) -> torch.Tensor:
            scale = torch.repeat_interleave(torch.arange(e_loc, dtype=torch.float64) + 1, torch.tensor(tpe))
            return rows * scale.unsqueeze(-1)

        return M.pipelined(pm, plans, x, w, k, bounds, totals, experts, per_expert)

    got = run_ranks(world, slot_bytes, rank_fn)
    for q in range(world):
        idx, x, w = routes[q]
        factor = torch.from_numpy((w.numpy() * (idx % e_loc + 1)).sum(1)) if idx.size else torch.zeros(0)
        assert torch.allclose(got[q], x * factor.unsqueeze(-1).to(x.dtype), atol=1e-12), q


@pytest.mark.parametrize("world,tokens,chunks,pieces,slot_bytes", [
    (2, [9, 12], 3, 1, 1 << 20),
    (3, [7, 0, 11], 2, 2, 1 << 20),          # a rank without tokens
    (2, [20, 17], 4, 1, 3 * 256 * 2),        # ring of few slots: reused across dispatches and combines
    (3, [15, 13, 16], 5, 3, 4 * 256 * 3),
    (2, [3, 2], 4, 1, 1 << 20),              # chunks without tokens
])
def test_pipelined_forward(fake_streams: None, world: int, tokens: list[int], chunks: int, pieces: int,
                           slot_bytes: int) -> None:
    _pipelined_case(world, 2, 2, tokens, chunks, pieces, slot_bytes, seed=31 * world + chunks)
