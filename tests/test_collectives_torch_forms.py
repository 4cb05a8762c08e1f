"""torch.distributed code runs unchanged through ``collectives``: the list forms, complex and sparse
tensors, and torch's exception types.

Each rank draws fresh data from ``(seed, rank)`` for every check, so it can compute what every
other rank sent; outputs start poisoned (NaN). Every form is checked twice: against that reference
(float64 where it reduces) and against torch.distributed's own call on the same inputs, on the same
Gloo group. Bad input must raise an exception that ``except <torch's type>`` catches, on every rank,
and leave the group usable.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import collectives as C



def _data(seed: int, who: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + who)
    if dtype.is_complex:
        return torch.randn(shape, dtype=torch.complex128, generator=g).to(dtype)
    return torch.randn(shape, dtype=torch.float64, generator=g).to(dtype)


def _nan(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _lists(kind: str, world: int, shape: tuple[int, int]) -> list[torch.Tensor]:
    """Poisoned output lists: separate tensors, chunks of one buffer (no copy), or strided views."""
    if kind == "separate":
        return [_nan(*shape) for _ in range(world)]
    if kind == "chunks":
        return list(_nan(world * shape[0], shape[1]).chunk(world))
    return [_nan(shape[1], shape[0]).t() for _ in range(world)]  # not contiguous


def _all_gather(rank: int, world: int, seeds: Iterator[int], problems: list[str]) -> None:
    for kind, async_op, algorithm in [("separate", False, "auto"), ("chunks", False, "auto"), ("strided", False, "ring"),
                                      ("separate", True, "auto"), ("chunks", True, "ring")]:
        seed = next(seeds)
        x = _data(seed, rank, (2, 3))
        out = _lists(kind, world, (2, 3))
        work = C.all_gather(out, x, async_op=async_op, algorithm=algorithm)
        if async_op:
            assert work is not None
            fut = work.get_future().wait()
            if [t.data_ptr() for t in fut] != [t.data_ptr() for t in out] and kind == "separate":
                problems.append(f"all_gather {kind} async: the future's value is not the caller's list")
        theirs = [torch.empty(2, 3) for _ in range(world)]
        dist.all_gather(theirs, x)
        for r in range(world):
            if not torch.equal(out[r], _data(seed, r, (2, 3))) or not torch.equal(out[r], theirs[r]):
                problems.append(f"all_gather {kind} async={async_op} {algorithm}: tensor_list[{r}] wrong")


def _reduce_scatter(rank: int, world: int, seeds: Iterator[int], problems: list[str]) -> None:
    for kind, op, async_op in [("separate", "sum", False), ("chunks", "sum", True), ("separate", "max", False)]:
        seed = next(seeds)
        ins = [_data(seed, rank * world + q, (5,), torch.float64) for q in range(world)]
        if kind == "chunks":
            ins = list(torch.cat(ins).chunk(world))
        out = _nan(5, dtype=torch.float64)
        rop = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        work = C.reduce_scatter(out, ins, rop, async_op=async_op)
        if work is not None:
            work.wait()
        parts = torch.stack([_data(seed, r * world + rank, (5,), torch.float64) for r in range(world)])
        want = parts.sum(0) if op == "sum" else parts.amax(0)
        theirs = torch.empty(5, dtype=torch.float64)
        dist.reduce_scatter(theirs, [t.clone() for t in ins], rop)
        if not torch.allclose(out, want, rtol=0, atol=1e-12) or not torch.allclose(out, theirs, rtol=0, atol=1e-12):
            problems.append(f"reduce_scatter {kind} {op}: {out.tolist()} vs {want.tolist()}")


def _all_to_all(rank: int, world: int, seeds: Iterator[int], problems: list[str]) -> None:
    for even, async_op in [(False, False), (True, False), (False, True)]:
        seed = next(seeds)

        def size(src: int, dst: int) -> int:
            return 3 if even else src + 2 * dst + 1
        ins = [_data(seed, rank * world + q, (size(rank, q),)) for q in range(world)]
        out = [_nan(size(q, rank)) for q in range(world)]
        work = C.all_to_all(out, ins, async_op=async_op)
        if work is not None:
            assert work.wait() is True
            if not work.is_success() or [t.data_ptr() for t in work.result()] != [t.data_ptr() for t in out]:
                problems.append("all_to_all async: is_success/result do not answer as torch's")
        for q in range(world):
            if not torch.equal(out[q], _data(seed, q * world + rank, (size(q, rank),))):
                problems.append(f"all_to_all even={even} async={async_op}: output_tensor_list[{q}] wrong")
        if even:  # Gloo's own all_to_all takes equal sizes only (torch 2.13; 2.11's has none)
            theirs = [torch.empty(3) for _ in range(world)]
            try:
                dist.all_to_all(theirs, ins)
            except RuntimeError as exc:
                if "does not support alltoall" not in str(exc):
                    raise
                theirs = out  # nothing of torch's to compare with: the reference above decides
            if any(not torch.equal(a, b) for a, b in zip(out, theirs)):
                problems.append("all_to_all even: differs from torch.distributed's")


def _rooted(rank: int, world: int, group: dist.ProcessGroup | None, seeds: Iterator[int], problems: list[str]) -> None:
    """gather and scatter, their roots given as dst/src, as group_dst/group_src, and by default."""
    granks = list(range(world)) if group is None else dist.get_process_group_ranks(group)
    if rank not in granks:
        return
    me, n = granks.index(rank), len(granks)
    last = n - 1
    hows = [("global", False), ("group", True)] + ([("default", False)] if group is None else [])  # default: global 0
    for how, async_op in hows:
        root = 0 if how == "default" else last
        kw = {} if how == "default" else {"dst": granks[root]} if how == "global" else {"group_dst": root}
        seed = next(seeds)
        x = _data(seed, me, (4,))
        gl = [_nan(4) for _ in range(n)] if me == root else None
        work = C.gather(x, gl, group=group, async_op=async_op, **kw)
        if work is not None:
            work.wait()
        theirs = [torch.empty(4) for _ in range(n)] if me == root else None
        dist.gather(x, theirs, group=group, **kw)
        if me == root:
            for r in range(n):
                if not torch.equal(gl[r], _data(seed, r, (4,))) or not torch.equal(gl[r], theirs[r]):
                    problems.append(f"gather root by {how} (group {granks}): gather_list[{r}] wrong")
        seed = next(seeds)
        skw = {} if how == "default" else {"src": granks[root]} if how == "global" else {"group_src": root}
        sl = [_data(seed, q, (2, 2)) for q in range(n)] if me == root else None
        got = _nan(2, 2)
        work = C.scatter(got, sl, group=group, async_op=async_op, **skw)
        if work is not None:
            work.wait()
        theirs_t = torch.empty(2, 2)
        dist.scatter(theirs_t, sl, group=group, **skw)
        if not torch.equal(got, _data(seed, me, (2, 2))) or not torch.equal(got, theirs_t):
            problems.append(f"scatter root by {how} (group {granks}): tensor wrong")
    # the root's own tensor inside its list: the call reads and writes the same memory
    seed = next(seeds)
    x = _data(seed, me, (3,))
    gl = [torch.empty(3) for _ in range(n)]
    if me == 0:
        gl[0] = x
    C.gather(x, gl if me == 0 else None, group=group, group_dst=0)
    if me == 0 and any(not torch.equal(gl[r], _data(seed, r, (3,))) for r in range(n)):
        problems.append("gather with the root's tensor in gather_list: wrong")


def body_list_forms(rank: int, world: int) -> list[str]:
    problems: list[str] = []
    seeds = itertools.count(1)  # the same on every rank: each rank knows what the others drew
    _all_gather(rank, world, seeds, problems)
    _reduce_scatter(rank, world, seeds, problems)
    _all_to_all(rank, world, seeds, problems)
    _rooted(rank, world, None, seeds, problems)
    if world >= 3:  # a group whose group ranks are not the global ones
        sub = dist.new_group(list(range(1, world)))
        _rooted(rank, world, sub, seeds, problems)
        C.destroy(sub) if rank >= 1 else None
    return problems


@pytest.mark.parametrize("size", [2, 3, 4])
def test_list_forms_match_torch_and_reference(worlds, size: int) -> None:  # noqa: ANN001
    _no_problems(worlds(size).run(body_list_forms))


def _no_problems(reports: list[list[str]]) -> None:
    problems = [f"rank {r}: {p}" for r, rep in enumerate(reports) for p in rep]
    assert not problems, "\n".join(problems)


def _raised(fn) -> BaseException | None:  # noqa: ANN001
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return exc
    return None


def _same_kind(problems: list[str], what: str, ours_fn, theirs_fn, words: tuple[str, ...] = ()) -> None:  # noqa: ANN001
    """Ours must raise something ``except type(torch's)`` catches, with ``words`` in its message."""
    theirs = _raised(theirs_fn)
    ours = _raised(ours_fn)
    if theirs is None:
        problems.append(f"{what}: torch.distributed did not raise (the case is wrong)")
    elif ours is None:
        problems.append(f"{what}: ours did not raise; torch raised {type(theirs).__name__}: {theirs}")
    elif not isinstance(ours, type(theirs)):
        problems.append(f"{what}: ours raised {type(ours).__mro__}, which `except {type(theirs).__name__}` misses")
    elif any(w not in str(ours) for w in words):
        problems.append(f"{what}: message lacks {words}: {ours}")


def body_complex_sparse_errors(rank: int, world: int) -> list[str]:
    problems: list[str] = []
    seed = 101
    # complex: reduced as a real view, as torch does
    for op in ("sum", "avg"):
        x = _data(seed, rank, (3,), torch.complex64)
        theirs = x.clone()
        rop = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG
        C.all_reduce(x, rop)
        dist.all_reduce(theirs, rop)
        want = sum(_data(seed, r, (3,), torch.complex128) for r in range(world))
        want = want / world if op == "avg" else want
        if x.dtype != torch.complex64 or not torch.allclose(x.to(torch.complex128), want, atol=1e-5) \
                or not torch.allclose(x, theirs, atol=1e-6):
            problems.append(f"complex all_reduce {op}: {x.tolist()} vs {want.tolist()}")
    x = _data(seed, rank + world, (2 * world,), torch.complex128)
    out = _nan(2, dtype=torch.complex128)
    C.reduce_scatter_single(out, x)
    want = sum(_data(seed, r + world, (2 * world,), torch.complex128) for r in range(world))[2 * rank:2 * rank + 2]
    if not torch.allclose(out, want, atol=1e-12):
        problems.append(f"complex reduce_scatter: {out.tolist()} vs {want.tolist()}")
    x = _data(seed, rank + 2 * world, (4,), torch.complex64)
    C.reduce(x, group_dst=0)
    want = sum(_data(seed, r + 2 * world, (4,), torch.complex128) for r in range(world))
    if rank == 0 and not torch.allclose(x.to(torch.complex128), want, atol=1e-5):
        problems.append("complex reduce: wrong")
    c = _data(seed, rank, (3,), torch.complex64)
    for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND, dist.ReduceOp.BOR,
               dist.ReduceOp.BXOR):  # torch's words for complex tensors first, before 'not a supported op'
        _same_kind(problems, f"complex all_reduce {op}", lambda: C.all_reduce(c.clone(), op),
                   lambda: dist.all_reduce(c.clone(), op), ("all_reduce does not support", "on complex tensors"))
    _same_kind(problems, "complex reduce max", lambda: C.reduce(c.clone(), 0, dist.ReduceOp.MAX),
               lambda: dist.reduce(c.clone(), 0, dist.ReduceOp.MAX), ("on complex tensors",))
    # sparse: Gloo's all_reduce sums them; the rest is refused as torch refuses it
    idx = torch.tensor([[rank % 5, (rank * 3 + 1) % 5]])
    vals = _data(seed, rank, (2,), torch.float64)
    s = torch.sparse_coo_tensor(idx, vals, (5,))
    theirs = s.clone()
    C.all_reduce(s)
    dist.all_reduce(theirs)
    want = torch.zeros(5, dtype=torch.float64)
    for r in range(world):
        want.index_add_(0, torch.tensor([r % 5, (r * 3 + 1) % 5]), _data(seed, r, (2,), torch.float64))
    if not s.is_sparse or not torch.allclose(s.to_dense(), want, atol=1e-12) \
            or not torch.allclose(s.to_dense(), theirs.to_dense(), atol=1e-12):
        problems.append(f"sparse all_reduce: {s.to_dense().tolist()} vs {want.tolist()}")
    if C.last_choice() is None or C.last_choice().algorithm != "native":
        problems.append(f"sparse all_reduce: ran {C.last_choice()}, not the backend's own")
    _same_kind(problems, "sparse all_reduce max", lambda: C.all_reduce(s.clone(), "max"),
               lambda: dist.all_reduce(s.clone(), dist.ReduceOp.MAX), ("sparse",))
    _same_kind(problems, "sparse broadcast", lambda: C.broadcast(s.clone(), 0), lambda: dist.broadcast(s.clone(), 0),
               ("sparse layout", "to_dense"))
    _same_kind(problems, "sparse all_gather", lambda: C.all_gather_into_tensor(torch.empty(5 * world), s.clone()),
               lambda: dist.all_gather_into_tensor(torch.empty(5 * world), s.clone()), ("sparse layout",))
    # bad list arguments, the same on every rank: torch's checks raise before sending, and so do ours
    t = torch.randn(3)
    cases = {
        "all_gather short list": (lambda: C.all_gather([torch.empty(3)] * (world + 1), t),
                                  lambda: dist.all_gather([torch.empty(3)] * (world + 1), t), ("tensor_list=",)),
        "all_gather wrong size": (lambda: C.all_gather([torch.empty(4)] * world, t),
                                  lambda: dist.all_gather([torch.empty(4)] * world, t), ("tensor_list[0]",)),
        "all_gather dtype": (lambda: C.all_gather([torch.empty(3, dtype=torch.float64)] * world, t),
                             lambda: dist.all_gather([torch.empty(3, dtype=torch.float64)] * world, t), ("dtype",)),
        "all_gather tuple": (lambda: C.all_gather(tuple(torch.empty(3) for _ in range(world)), t),
                             lambda: dist.all_gather(tuple(torch.empty(3) for _ in range(world)), t), ("list",)),
        "reduce_scatter short list": (lambda: C.reduce_scatter(torch.empty(3), [torch.ones(3)] * (world + 1)),
                                      lambda: dist.reduce_scatter(torch.empty(3), [torch.ones(3)] * (world + 1)),
                                      ("input_list=",)),
        "all_to_all short list": (lambda: C.all_to_all([torch.empty(3)] * (world + 1), [torch.ones(3)] * (world + 1)),
                                  lambda: dist.all_to_all([torch.empty(3)] * (world + 1), [torch.ones(3)] * (world + 1)),
                                  ("input_tensor_list=",)),
        "gather list on every rank": (lambda: C.gather(t, [torch.empty(3)] * (world + 1), dst=0),
                                      lambda: dist.gather(t, [torch.empty(3)] * (world + 1), dst=0), ("gather_list",)),
        "bad root": (lambda: C.scatter(t, None, src=world + 2), lambda: dist.scatter(t, None, src=world + 2), ("src=",)),
    }
    if world == 1:  # a list one longer is wrong at any size; on one rank it is also torch's "non-destination" check
        del cases["gather list on every rank"]
    for what, (ours, theirs, words) in cases.items():
        _same_kind(problems, what, ours, theirs, words)
    x = torch.ones(2)
    C.all_reduce(x)
    if not x.eq(world).all():
        problems.append(f"group not usable afterwards: {x.tolist()}")
    # every refused call was settled (every rank failed it): none is left for the watch to take for
    # the failure of a later call that waits long (it once aborted the group many calls later)
    from collectives import _watch

    comm = C.get_communicator()
    store = _watch._store()
    left = [] if store is None or comm._epoch is None else _watch._others(comm, store, comm.seq)
    if left:
        problems.append(f"unsettled failure notices: {[(n['rank'], n['seq'], n['op']) for n in left]}")
    return problems


@pytest.mark.parametrize("size", [1, 2, 3])
def test_complex_sparse_and_exception_types_as_torch(worlds, size: int) -> None:  # noqa: ANN001
    _no_problems(worlds(size).run(body_complex_sparse_errors))
