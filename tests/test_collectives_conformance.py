"""Every algorithm of every op against a float64 reference and against torch.distributed (Gloo).

For each registered algorithm that runs an op on Gloo, at world sizes 1-5 (5 under ``-m slow``), every rank draws fresh
random inputs from ``(seed, rank)`` (so each rank can compute the expected output of all of them
in float64), poisons its output, calls the collective, and checks: no element farther from the
reference than the rounding bound, the same result as ``torch.distributed``'s own collective on
the same inputs, and (all-reduce) bitwise the same result on every rank.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.distributed as dist

import collectives as C
from bench.reference import count_wrong, expected, rank_data, split_matrix, tolerance
from collectives.algos import REGISTRY, for_op

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
REDUCE_OPS = ["sum", "avg", "max", "min", "prod"]
BIG = 786_433  # elements: 3 MB of float32; prime, so never divisible by the world size
PAIRS = [(op, name) for op in C.DATA_OPS for name in for_op(op, backend="gloo")]

_torch_rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_torch_ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _poison(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan") if t.dtype.is_floating_point else -(1 << 20))


def _sizes(world: int) -> list[int]:
    return [0, 1, 13, 7 * world + 1]


def _reduce_ops(dtype: torch.dtype) -> list[str]:
    return [r for r in REDUCE_OPS if not (r == "avg" and not dtype.is_floating_point)]


def _same_everywhere(t: torch.Tensor) -> bool:
    raw = t.contiguous().view(torch.uint8).numpy().tobytes()
    mine = torch.tensor([zlib.crc32(raw)], dtype=torch.int64)
    every = torch.empty(dist.get_world_size(), dtype=torch.int64)
    _torch_ag(every, mine)
    return bool((every == every[0]).all())


def _torch_result(fn, *args) -> str | None:  # noqa: ANN001
    try:
        fn(*args)
        return None
    except RuntimeError as exc:  # a dtype/op Gloo itself lacks: ours is still checked against float64
        return str(exc).splitlines()[0]


def _check(fails: list[str], what: str, out: torch.Tensor, ref: torch.Tensor, tol) -> None:  # noqa: ANN001
    wrong = count_wrong(out, ref, tol)
    if wrong:
        fails.append(f"{what}: #wrong={wrong} of {out.numel()}")


# Nodes emulated through the topology override, for the topology-aware algorithms: equal nodes,
# nodes whose rails are not in rank order, and nodes of unequal size.
LAYOUTS: dict[int, list[list[list[int]]]] = {
    1: [[[0]]], 2: [[[0], [1]]], 3: [[[0, 1], [2]]],
    4: [[[0, 1], [2, 3]], [[0, 3], [1, 2]], [[0, 1, 2], [3]]], 5: [[[0, 2, 4], [1, 3]]],
}
UNSUPPORTED = "unsupported"


def _needs_grid(op: str, algo: str) -> bool:
    # Documented limits: the two-level all-to-all and the 2D grid need nodes of equal size.
    return (algo == "hierarchical" and op == "all_to_all") or algo == "grid2d"


def _unequal(nodes: list[list[int]]) -> bool:
    return 1 < len(nodes) < sum(map(len, nodes)) and len({len(n) for n in nodes}) > 1


def body_conformance(rank: int, world: int, op: str, algo: str, seed: int,
                     nodes: list[list[int]] | None = None) -> list[str]:
    if nodes is None:
        return _conformance(rank, world, op, algo, seed)
    from topology import Topology

    comm = C.get_communicator()
    comm.set_topology(Topology.from_nodes(nodes))
    try:
        if _needs_grid(op, algo) and _unequal(nodes):
            # Must refuse on every rank before sending anything, with the typed error.
            x = torch.ones(world * 4)
            try:
                if op == "all_reduce":
                    C.all_reduce(x, algorithm=algo)
                else:
                    C.all_to_all_single(torch.empty_like(x), x, algorithm=algo)
            except C.UnsupportedError:
                return [UNSUPPORTED]
            return [f"{algo} ran {op} on nodes {nodes} instead of refusing"]
        return _conformance(rank, world, op, algo, seed)
    finally:
        comm.set_topology(None)


def _conformance(rank: int, world: int, op: str, algo: str, seed: int) -> list[str]:
    fails: list[str] = []
    torch_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
                "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}
    for dtype in DTYPES:
        if not REGISTRY[algo].supports(op, dtype, "gloo"):
            continue
        reduce_ops = _reduce_ops(dtype) if op in ("all_reduce", "reduce_scatter", "reduce") else ["sum"]
        for red in reduce_ops:
            # The few-MB case once per dtype class: it costs seconds on Gloo with 5 ranks on 2 cores.
            sizes = _sizes(world) + ([BIG] if red == "sum" and dtype in (torch.float32, torch.bfloat16) else [])
            for n in sizes:
                seed += 1
                tag = f"{op}/{algo} dtype={dtype} op={red} n={n}"
                if op == "all_reduce":
                    xs = [rank_data(q, n, dtype, seed, reduce_op=red) for q in range(world)]
                    x, y = xs[rank].clone(), xs[rank].clone()
                    C.all_reduce(x, red, algorithm=algo)
                    ref, tol = expected(op, xs, rank, red), tolerance(op, xs, rank, dtype, red)
                    _check(fails, tag, x, ref, tol)
                    if not _same_everywhere(x):
                        fails.append(f"{tag}: ranks hold different bits")
                    if _torch_result(dist.all_reduce, y, torch_op[red]) is None:
                        _check(fails, tag + " vs torch.distributed", x, y, 2 * tol)
                elif op == "reduce_scatter":
                    n = n if n < BIG else (BIG // world) | 1  # about BIG elements of input in all (odd)
                    xs = [rank_data(q, n * world, dtype, seed, reduce_op=red) for q in range(world)]
                    ref, tol = expected(op, xs, rank, red), tolerance(op, xs, rank, dtype, red)
                    out = _poison(torch.empty(n, dtype=dtype))
                    inp = xs[rank].clone()
                    C.reduce_scatter_single(out, inp, red, algorithm=algo)
                    _check(fails, tag, out, ref, tol)
                    if not torch.equal(inp, xs[rank]):
                        fails.append(f"{tag}: input modified")
                    inplace = xs[rank].clone()  # output aliases this rank's slice of the input
                    C.reduce_scatter_single(inplace[rank * n:(rank + 1) * n], inplace, red, algorithm=algo)
                    _check(fails, tag + " in-place", inplace[rank * n:(rank + 1) * n], ref, tol)
                    theirs = _poison(torch.empty(n, dtype=dtype))
                    if _torch_result(_torch_rs, theirs, xs[rank].clone(), torch_op[red]) is None:
                        _check(fails, tag + " vs torch.distributed", out, theirs, 2 * tol)
                elif op == "all_gather":
                    xs = [rank_data(q, n, dtype, seed) for q in range(world)]
                    ref = expected(op, xs, rank)
                    out = _poison(torch.empty(n * world, dtype=dtype))
                    C.all_gather_single(out, xs[rank].clone(), algorithm=algo)
                    _check(fails, tag, out, ref, 0.0)
                    inplace = _poison(torch.empty(n * world, dtype=dtype))
                    inplace[rank * n:(rank + 1) * n] = xs[rank]
                    C.all_gather_single(inplace, inplace[rank * n:(rank + 1) * n], algorithm=algo)
                    _check(fails, tag + " in-place", inplace, ref, 0.0)
                    theirs = _poison(torch.empty(n * world, dtype=dtype))
                    if _torch_result(_torch_ag, theirs, xs[rank].clone()) is None and not torch.equal(out, theirs):
                        fails.append(f"{tag}: differs from torch.distributed")
                elif op == "all_to_all":
                    patterns = ["even"] if REGISTRY[algo].equal_splits_only else ["even", "uneven", "one_hot"]
                    row = 3
                    rows = n if n < BIG else BIG // (row * world)  # about BIG elements in all
                    for pattern in patterns:
                        m = split_matrix(world, seed, pattern, rows)
                        xs = [rank_data(q, sum(m[q]) * row, dtype, seed) for q in range(world)]
                        ref = expected(op, xs, rank, splits=m, row=row)
                        inp = xs[rank].view(-1, row).clone()
                        out_rows = [m[q][rank] for q in range(world)]
                        out = _poison(torch.empty(sum(out_rows), row, dtype=dtype))
                        splits = (None, None) if pattern == "even" and algo == "bruck" else (out_rows, m[rank])
                        C.all_to_all_single(out, inp, *splits, algorithm=algo)
                        _check(fails, f"{tag} splits={pattern}", out, ref, 0.0)
                        theirs = _poison(torch.empty_like(out))
                        if _torch_result(dist.all_to_all_single, theirs, inp.clone(), out_rows, m[rank]) is None \
                                and not torch.equal(out, theirs):
                            fails.append(f"{tag} splits={pattern}: differs from torch.distributed")
                else:  # broadcast, reduce
                    for root in sorted({0, world - 1}):
                        xs = [rank_data(q, n, dtype, seed + root, reduce_op=red) for q in range(world)]
                        if op == "broadcast":
                            t = xs[rank].clone() if rank == root else _poison(torch.empty(n, dtype=dtype))
                            C.broadcast(t, root, algorithm=algo)
                            _check(fails, f"{tag} root={root}", t, xs[root], 0.0)
                        else:
                            t = xs[rank].clone()
                            C.reduce(t, root, red, algorithm=algo)
                            if rank == root:
                                ref, tol = expected(op, xs, rank, red, root), tolerance(op, xs, rank, dtype, red, root)
                                _check(fails, f"{tag} root={root}", t, ref, tol)
                                theirs = xs[rank].clone()
                            else:
                                theirs = xs[rank].clone()
                                if algo != "native" and not torch.equal(t, xs[rank]):
                                    fails.append(f"{tag} root={root}: non-root tensor changed")
                            if _torch_result(dist.reduce, theirs, root, torch_op[red]) is None and rank == root:
                                _check(fails, f"{tag} root={root} vs torch.distributed", t, theirs,
                                       2 * tolerance(op, xs, rank, dtype, red, root))
    return fails


@pytest.mark.parametrize("op,algo", PAIRS, ids=[f"{o}-{a}" for o, a in PAIRS])
def test_conformance(world, op: str, algo: str) -> None:  # noqa: ANN001
    layouts = LAYOUTS[world.size] if REGISTRY[algo].topology_aware else [None]
    for nodes in layouts:
        results = world.run(body_conformance, op, algo, 1000 * world.size, nodes, timeout=600)
        if nodes is not None and _needs_grid(op, algo) and _unequal(nodes):
            assert results == [[UNSUPPORTED]] * world.size, f"nodes {nodes}: {results}"
            continue
        fails = [f"rank {r} nodes {nodes}: {f}" for r, fs in enumerate(results) for f in fs]
        assert not fails, "\n".join(fails[:30])


def body_six(rank: int, world: int, nodes: list[list[int]]) -> list[str]:
    """The branches world 1-5 cannot reach: three ranks per node, and three nodes (rail all-reduce)."""
    from topology import Topology

    comm = C.get_communicator()
    comm.set_topology(Topology.from_nodes(nodes))
    fails: list[str] = []
    try:
        for n in (1, 7 * world + 1, 40_001):
            seed = 6000 + n
            xs = [rank_data(q, n, torch.float32, seed) for q in range(world)]
            for algo in ("hierarchical", "grid2d"):
                x = xs[rank].clone()
                C.all_reduce(x, algorithm=algo)
                _check(fails, f"all_reduce/{algo} n={n}", x, expected("all_reduce", xs, rank),
                       tolerance("all_reduce", xs, rank, torch.float32))
                if not _same_everywhere(x):
                    fails.append(f"all_reduce/{algo} n={n}: ranks hold different bits")
            big = [rank_data(q, n * world, torch.float32, seed) for q in range(world)]
            out = _poison(torch.empty(n))
            C.reduce_scatter_single(out, big[rank].clone(), algorithm="hierarchical")
            _check(fails, f"reduce_scatter n={n}", out, expected("reduce_scatter", big, rank),
                   tolerance("reduce_scatter", big, rank, torch.float32))
            out = _poison(torch.empty(n * world))
            C.all_gather_single(out, xs[rank].clone(), algorithm="hierarchical")
            _check(fails, f"all_gather n={n}", out, expected("all_gather", xs, rank), 0.0)
            m = split_matrix(world, seed, "uneven", max(1, n // world))
            ins = [rank_data(q, sum(m[q]), torch.float32, seed) for q in range(world)]
            out_rows = [m[q][rank] for q in range(world)]
            out = _poison(torch.empty(sum(out_rows)))
            C.all_to_all_single(out, ins[rank].clone(), out_rows, m[rank], algorithm="hierarchical")
            _check(fails, f"all_to_all n={n}", out, expected("all_to_all", ins, rank, splits=m), 0.0)
    finally:
        comm.set_topology(None)
    return fails


@pytest.mark.parametrize("nodes", [[[0, 1, 2], [3, 4, 5]], [[0, 1], [2, 3], [4, 5]]], ids=["2x3", "3x2"])
def test_topology_aware_algorithms_on_six_ranks(worlds, nodes: list[list[int]]) -> None:  # noqa: ANN001
    fails = [f"rank {r}: {f}" for r, fs in enumerate(worlds(6).run(body_six, nodes, timeout=600)) for f in fs]
    assert not fails, "\n".join(fails[:30])
