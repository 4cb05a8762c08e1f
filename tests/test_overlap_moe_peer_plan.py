"""The peer MoE transport's plan (``overlap.moe.peer_plan.plan``), run by a stand-in of its three
kernels on CPU tensors, one rank after another between the barriers.

The stand-in does what overlap/moe/rows.cu's ``rows_gather``, ``rows_partial`` and ``rows_sum``
are documented to do with the plan's index arrays; the expected ``recv_x`` and combined output come
from the definitions of dispatch and combine (rank q's rows grouped by q's local expert, then
source rank, then token; each expert keeps its first pairs in token order up to the capacity),
computed here with plain loops, not from the plan.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from overlap.moe import peer_plan as P
from overlap.moe import sorted_pairs

HIDDEN = 6


def _routing(world: int, e_loc: int, k: int, tokens: list[int], seed: int, skew: bool) -> list[tuple[Any, ...]]:
    rng = np.random.default_rng(seed)
    E = world * e_loc
    out = []
    for s in range(world):
        if skew:  # most tokens want the same few experts: uneven counts, capacity drops
            pick = [np.concatenate([[0, 1][:k], rng.permutation(np.arange(2, E))[:max(0, k - 2)]]) for _ in range(tokens[s])]
        else:
            pick = [rng.permutation(E)[:k] for _ in range(tokens[s])]
        idx = np.stack(pick) if tokens[s] else np.zeros((0, k), np.int64)
        x = torch.from_numpy(rng.standard_normal((tokens[s], HIDDEN)))
        w = torch.from_numpy(rng.random((tokens[s], k)))
        out.append((idx, x, w))
    return out


def _kept(idx: np.ndarray, E: int, cf: float | None) -> set[tuple[int, int]]:
    """(token, expert) pairs kept: each expert's first pairs in token order, up to the capacity."""
    cap = math.inf if cf is None else math.ceil(cf * idx.size / E)
    taken = [0] * E
    kept = set()
    for t in range(idx.shape[0]):
        for e in idx[t]:
            if taken[e] < cap:
                taken[e] += 1
                kept.add((t, int(e)))
    return kept


def _run(world: int, e_loc: int, k: int, tokens: list[int], cf: float | None, seed: int, skew: bool = False) -> None:
    E = world * e_loc
    max_tokens = max(tokens + [1]) + 3
    routes = _routing(world, e_loc, k, tokens, seed, skew)
    sources = [sorted_pairs(idx, E, cf) for idx, _, _ in routes]
    plans = []
    for r in range(world):
        scalars, arrays = P.plan(r, world, e_loc, k, max_tokens,
                                 [(idx, o, t) for (idx, _, _), (o, _, _, _, t) in zip(routes, sources)])
        plans.append(P.build(scalars, [torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in arrays]))
    # dispatch: every rank's tokens in its buffer (X), then each pulls its items
    X = [x for _, x, _ in routes]
    recv = []
    for r, p in enumerate(plans):
        total = int(p.ptr[-1])
        out = torch.full((total, HIDDEN), float("nan"), dtype=torch.float64)
        for i in range(p.n_items):
            s, row = int(p.items[2 * i]), int(p.items[2 * i + 1])
            for d in p.dst[p.ptr[i]:p.ptr[i + 1]].tolist():
                out[d] = X[s][row]
        recv.append(out)
    kept = [_kept(idx, E, cf) for idx, _, _ in routes]
    for q in range(world):
        want = [routes[s][1][t] for e in range(q * e_loc, (q + 1) * e_loc) for s in range(world)
                for t in range(tokens[s]) if (t, e) in kept[s]]
        want_x = torch.stack(want) if want else torch.zeros(0, HIDDEN, dtype=torch.float64)
        assert torch.equal(recv[q], want_x), q
        assert sum(sources[s][2][q * e_loc:(q + 1) * e_loc].sum() for s in range(world)) == recv[q].shape[0]
    # combine: an "expert" that scales row r by 1 + its global expert id, so misrouted rows show
    expert_out = []
    for q in range(world):
        ids = [e for e in range(q * e_loc, (q + 1) * e_loc) for s in range(world) for t in range(tokens[s])
               if (t, e) in kept[s]]
        expert_out.append(recv[q] * (torch.tensor(ids, dtype=torch.float64) + 1).unsqueeze(-1))
    W = [w.reshape(-1) for _, _, w in routes]
    part = [torch.full((world * max_tokens, HIDDEN), float("nan"), dtype=torch.float64) for _ in range(world)]
    for q, p in enumerate(plans):
        for i in range(p.n_items):
            s, prow = int(p.part[2 * i]), int(p.part[2 * i + 1])
            acc = torch.zeros(HIDDEN, dtype=torch.float64)
            for e in range(int(p.ptr[i]), int(p.ptr[i + 1])):
                acc += W[s][int(p.part_ent[2 * e + 1])] * expert_out[q][int(p.part_ent[2 * e])]
            part[q][prow] = acc
    for s, p in enumerate(plans):
        assert p.n_tokens == tokens[s]
        out = torch.full((tokens[s], HIDDEN), float("nan"), dtype=torch.float64)
        for t in range(tokens[s]):
            acc = torch.zeros(HIDDEN, dtype=torch.float64)
            for e in range(int(p.sum_ptr[t]), int(p.sum_ptr[t + 1])):
                acc += part[int(p.sum_ent[2 * e])][int(p.sum_ent[2 * e + 1])]
            out[t] = acc
        idx, x, w = routes[s]
        want = torch.zeros(tokens[s], HIDDEN, dtype=torch.float64)
        for t in range(tokens[s]):
            for j in range(k):
                if (t, int(idx[t, j])) in kept[s]:
                    want[t] += w[t, j] * (idx[t, j] + 1) * x[t]
        assert torch.allclose(out, want, rtol=1e-12, atol=1e-12), s


@pytest.mark.parametrize("world,e_loc,k,tokens", [
    (2, 2, 2, [5, 8]),
    (2, 4, 3, [9, 1]),
    (3, 2, 3, [6, 0, 9]),      # a rank without tokens
    (3, 1, 2, [4, 5, 3]),      # one expert per rank: no token goes twice to a rank
    (4, 3, 5, [3, 6, 2, 5]),   # several of a token's experts on one rank: pulled once, summed once
    (5, 2, 4, [7, 1, 4, 0, 3]),
])
def test_peer_plan_dispatch_and_combine(world: int, e_loc: int, k: int, tokens: list[int]) -> None:
    _run(world, e_loc, k, tokens, None, seed=world * 10 + k)


@pytest.mark.parametrize("cf", [0.5, 1.0])
def test_peer_plan_with_capacity_drops(cf: float) -> None:
    _run(3, 2, 2, [12, 9, 7], cf, seed=5, skew=True)


def test_peer_plan_all_tokens_to_one_expert() -> None:
    _run(2, 3, 1, [6, 4], None, seed=1, skew=True)


def test_each_token_crosses_to_a_rank_once() -> None:
    # a token bound for three experts of one rank is one item there (one pull, one partial row)
    E, k = 4, 3
    idx = np.array([[0, 1, 2], [1, 2, 3]])
    empty = np.zeros((0, k), np.int64)
    src = [(idx, sorted_pairs(idx, E, None)[0], 2), (empty, sorted_pairs(empty, E, None)[0], 0)]
    (n_items, _), arrays = P.plan(0, 2, 2, k, 8, src)
    items, ptr = arrays[0].reshape(-1, 2), arrays[1]
    assert items.tolist() == [[0, 0], [0, 1]] and np.diff(ptr).tolist() == [2, 1]
    (n_items1, _), arrays1 = P.plan(1, 2, 2, k, 8, src)
    assert arrays1[0].reshape(-1, 2).tolist() == [[0, 0], [0, 1]] and np.diff(arrays1[1]).tolist() == [1, 2]
    # the tokens' side: token 0 adds rank 0's row 0 and rank 1's row 0; token 1 both ranks' row 1
    assert arrays[6].reshape(-1, 2).tolist() == [[0, 0], [1, 0], [0, 1], [1, 1]]


def test_layout_bytes() -> None:
    # W: 4096 x 8 fp32 weights; I: a 16-int header and 4096 x 8 int32 ids, page-rounded; then
    # 2 ranks x 4096 rows of 14336 B
    wb, ib, half = P.layout_bytes(2, 4096, 8, 14336)
    assert wb == 131072 and ib == wb + 135168 and half == ib + 2 * 4096 * 14336
