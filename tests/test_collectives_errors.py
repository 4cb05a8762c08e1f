"""Bad input raises a typed error naming argument, value and fix, on every rank, before any send.

"Before any send" is checked twice: the dispatch point's trace hook never saw the call start, and
no torch.distributed send or collective was entered (they are wrapped to count entries).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import collectives as C

_COUNTED = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single",
            "broadcast", "reduce", "isend", "irecv", "batch_isend_irecv", "send", "recv")
for _extra in ("reduce_scatter_single", "all_gather_single"):
    if hasattr(dist, _extra):
        _COUNTED += (_extra,)


def _cases(rank: int, world: int) -> dict[str, tuple]:
    f = torch.randn
    noncontig = f(4, 6)[:, ::2]
    return {
        # name: (call, exception type, words the message must contain)
        "tensor not a tensor": (lambda: C.all_reduce([1.0, 2.0]), C.InvalidTypeError, ["tensor=", "torch.Tensor"]),
        "non-contiguous": (lambda: C.all_reduce(noncontig), C.InvalidArgumentError, ["tensor=", "contiguous"]),
        "wrong device": (lambda: C.all_reduce(f(3, device="meta")), C.InvalidArgumentError, ["tensor=", "meta", "cpu"]),
        "bool cannot reduce": (lambda: C.all_reduce(torch.ones(3, dtype=torch.bool)), C.InvalidArgumentError, ["torch.bool", "reduce"]),
        "int avg": (lambda: C.all_reduce(torch.ones(3, dtype=torch.int32), "avg"), C.InvalidArgumentError, ["avg", "sum"]),
        "unknown reduce op": (lambda: C.all_reduce(f(3), "median"), C.InvalidArgumentError, ["op=", "median", "sum"]),
        "rs output size": (lambda: C.reduce_scatter_single(f(3), f(3 * world + 1)), C.InvalidArgumentError, ["input=", f"{world}"]),
        "rs dtype mismatch": (lambda: C.reduce_scatter_single(f(2, dtype=torch.float64), f(2 * world)), C.InvalidArgumentError, ["dtype", "float64"]),
        "ag output size": (lambda: C.all_gather_single(f(3 * world + 2), f(3)), C.InvalidArgumentError, ["output_tensor=", f"{world}"]),
        "a2a splits sum": (lambda: C.all_to_all_single(f(world, 2), f(world, 2), [1] * world, [2] * world), C.InvalidArgumentError,
                           ["input_split_sizes=", "sums to", f"{world}"]),
        "a2a splits length": (lambda: C.all_to_all_single(f(world), f(world), None, [1] * (world + 1)), C.InvalidArgumentError,
                              ["input_split_sizes=", "entries"]),
        "a2a split negative": (lambda: C.all_to_all_single(f(world), f(world), None, [world + 1, -1] + [0] * (world - 2) if world > 1 else [-1]),
                               C.InvalidArgumentError, ["negative"]),
        "a2a not divisible": (lambda: C.all_to_all_single(f(world + 1), f(world + 1)), C.InvalidArgumentError, ["divisible"])
        if world > 1 else (lambda: C.all_to_all_single(f(2), f(2), None, [3]), C.InvalidArgumentError, ["sums to"]),
        "a2a rows differ": (lambda: C.all_to_all_single(f(world, 2), f(world, 3)), C.InvalidArgumentError, ["output=", "rows"]),
        "bcast src out of range": (lambda: C.broadcast(f(3), world + 3), C.InvalidArgumentError, ["src=", "member"]),
        "bcast group_src out of range": (lambda: C.broadcast(f(3), group_src=-1), C.InvalidArgumentError, ["group_src=", "0.."]),
        "reduce dst missing": (lambda: C.reduce(f(3)), C.InvalidArgumentError, ["dst=", "required"]),
        "reduce dst out of range": (lambda: C.reduce(f(3), world), C.InvalidArgumentError, ["dst=", f"{world}"]),
        "unknown algorithm": (lambda: C.all_reduce(f(3), algorithm="fastest"), C.UnsupportedError,
                              ["algorithm=", "fastest", "ring", "native"]),
        "misspelt algorithm": (lambda: C.all_reduce(f(3), algorithm="rign"), C.UnsupportedError,
                               ["algorithm=", "rign", "did you mean 'ring'?"]),
        "algorithm lacks op": (lambda: C.all_gather_single(f(3 * world), f(3), algorithm="halving_doubling"), C.UnsupportedError,
                               ["halving_doubling", "all_gather", "ring"]),
        "bruck uneven": (lambda: C.all_to_all_single(f(world + 1), f(world + 1), [1] * (world - 1) + [2], [1] * (world - 1) + [2],
                                                      algorithm="bruck"), C.UnsupportedError, ["bruck", "pairwise"])
        if world > 1 else (lambda: C.all_to_all_single(f(1), f(1), algorithm="bruck", input_split_sizes=[2]),
                           C.InvalidArgumentError, ["sums to"]),
        "a2a in place": (lambda: (lambda t: C.all_to_all_single(t, t))(f(world)), C.InvalidArgumentError, ["shares memory"]),
    }


def body_errors(rank: int, world: int) -> dict[str, str]:
    """Return, per case, '' when it raised as required with nothing sent, else what went wrong."""
    started = []
    hook = lambda event, call, detail: started.append((event, call.op))  # noqa: E731
    C.add_trace_hook(hook)
    entered = []
    saved = {n: getattr(dist, n) for n in _COUNTED}

    def counting(name, fn):  # noqa: ANN001, ANN202
        def wrapper(*a, **k):  # noqa: ANN002, ANN003, ANN202
            entered.append(name)
            return fn(*a, **k)
        return wrapper

    for n, fn in saved.items():
        setattr(dist, n, counting(n, fn))
    import collectives.algos.native as native
    saved_native = (native._reduce_scatter, native._all_gather)
    native._reduce_scatter, native._all_gather = counting("rs", native._reduce_scatter), counting("ag", native._all_gather)
    report = {}
    try:
        for name, (call, exc_type, words) in _cases(rank, world).items():
            started.clear()
            entered.clear()
            try:
                call()
                report[name] = "did not raise"
                continue
            except exc_type as exc:
                msg = str(exc)
                missing = [w for w in words if w not in msg]
                report[name] = f"message lacks {missing}: {msg}" if missing else ""
            except Exception as exc:  # noqa: BLE001
                report[name] = f"raised {type(exc).__name__} instead of {exc_type.__name__}: {exc}"
                continue
            if started or entered:
                report[name] += f" but communication began: hooks={started} torch={entered}"
    finally:
        C.remove_trace_hook(hook)
        for n, fn in saved.items():
            setattr(dist, n, fn)
        native._reduce_scatter, native._all_gather = saved_native
    # The group still works afterwards.
    x = torch.ones(2)
    C.all_reduce(x)
    report["group usable afterwards"] = "" if x.eq(world).all() else f"all_reduce gave {x.tolist()}"
    return report


@pytest.mark.parametrize("size", [1, 2, 3])
def test_bad_input_raises_everywhere_before_sending(worlds, size: int) -> None:  # noqa: ANN001
    reports = worlds(size).run(body_errors)
    problems = [f"rank {r} [{case}]: {why}" for r, rep in enumerate(reports) for case, why in rep.items() if why]
    assert not problems, "\n".join(problems)
    assert len(reports[0]) == len(_cases(0, size)) + 1


def test_calling_before_init_says_how_to_start() -> None:
    assert not dist.is_initialized()
    with pytest.raises(C.NotInitializedError, match="collectives.init"):
        C.all_reduce(torch.ones(2))
    with pytest.raises(C.NotInitializedError, match="init_process_group"):
        C.Communicator()


@pytest.mark.parametrize("name", ["broadcast", "reduce"])
def test_root_verbs_take_torch_positional_arguments(name: str) -> None:
    """``broadcast``/``reduce`` take torch.distributed's parameters in its order (``group_src`` /
    ``group_dst`` positional too), ``algorithm=`` keyword-only after them."""
    import inspect

    ours = list(inspect.signature(getattr(C, name)).parameters.values())
    theirs = list(inspect.signature(getattr(dist, name)).parameters.values())
    assert [p.name for p in ours[:len(theirs)]] == [p.name for p in theirs]
    assert all(p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY) for p in ours[:len(theirs)])
    assert [p.name for p in ours[len(theirs):]] == ["algorithm"] and ours[-1].kind == ours[-1].KEYWORD_ONLY


def _positional_roots(rank: int, world: int) -> list[float]:
    x = torch.full((5,), float(rank + 1), dtype=torch.float64)
    C.broadcast(x, None, None, False, world - 1)  # group_src as torch's fifth positional argument
    y = torch.full((5,), float(rank + 1), dtype=torch.float64)
    C.reduce(y, None, "sum", None, False, 0)  # group_dst likewise
    return [x[0].item(), y[0].item() if rank == 0 else 0.0]


def test_positional_group_src_and_group_dst(worlds) -> None:  # noqa: ANN001
    world = 3
    for rank, (b, r) in enumerate(worlds(world).run(_positional_roots)):
        assert b == world and (r == world * (world + 1) / 2 if rank == 0 else r == 0.0), (rank, b, r)


def _barriers(rank: int, world: int) -> dict[str, object]:
    import datetime
    import time

    out: dict[str, object] = {}
    C.barrier(None, False, None, datetime.timedelta(seconds=30))  # torch's positions: group, async_op, device_ids, timeout
    work = C.barrier(async_op=True, timeout=datetime.timedelta(seconds=30))
    assert work is not None and work.wait()
    out["refused"] = []
    for bad in ({"device_ids": 0}, {"device_ids": [0.5]}, {"timeout": 5}):
        try:
            C.barrier(**bad)  # type: ignore[arg-type]
        except C.InvalidTypeError as exc:  # before anything is sent: the others do not wait for it
            out["refused"].append(str(exc))  # type: ignore[attr-defined]
    g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=60))
    C.all_reduce(torch.ones(2), group=g)  # progress published for this group
    t0 = time.monotonic()
    if rank != world - 1:  # the last rank skips the barrier: the others' timeout names it
        try:
            C.barrier(g, timeout=datetime.timedelta(seconds=2))
        except C.CollectiveTimeout as exc:
            out["timeout"] = (exc.missing, time.monotonic() - t0)
    dist.barrier()  # the world group still works
    C.destroy(g)
    return out


def test_barrier_takes_device_ids_and_timeout(worlds) -> None:  # noqa: ANN001
    world = 3
    for rank, res in enumerate(worlds(world).run(_barriers, timeout=120)):
        refused = res["refused"]
        assert len(refused) == 3, res  # type: ignore[arg-type]
        assert refused[0].startswith("device_ids=0: is not a list of ints"), refused  # type: ignore[index]
        assert refused[1].startswith("device_ids=[0.5]: is not a list of ints"), refused  # type: ignore[index]
        assert refused[2].startswith("timeout=5: is a int, not a datetime.timedelta"), refused  # type: ignore[index]
        if rank != world - 1:
            missing, seconds = res["timeout"]  # type: ignore[misc]
            assert missing == [world - 1] and 1.5 < seconds < 10, res


def _work_surface(rank: int, world: int) -> list[str]:
    """Every method of torch.distributed.Work on our handles (a worker-thread call, ring; the
    backend's own, native), against torch's own handle of the same call."""
    problems = []
    want = torch.full((6,), float(sum(range(1, world + 1))), dtype=torch.float64)
    for algorithm in ("ring", "native", "torch"):
        x = torch.full((6,), float(rank + 1), dtype=torch.float64)
        work = dist.all_reduce(x, async_op=True) if algorithm == "torch" else \
            C.all_reduce(x, algorithm=algorithm, async_op=True)
        assert work is not None
        fut = work.get_future()
        got = fut.wait()
        checks = {
            "future value is the output": len(got) == 1 and got[0].data_ptr() == x.data_ptr() and torch.equal(got[0], want),
            "wait": work.wait() is True,
            "is_completed": work.is_completed(),
            "is_success": work.is_success(),
            # (torch 2.11's own handle cannot return its exception to Python: TypeError)
            "exception": algorithm == "torch" and torch.__version__.startswith("2.11") or work.exception() is None,
            "result": [t.data_ptr() for t in work.result()] == [x.data_ptr()],
        }
        work.synchronize()
        try:
            work.source_rank()
            checks["source_rank raises"] = False
        except RuntimeError:
            checks["source_rank raises"] = True
        problems += [f"{algorithm}: {name}" for name, ok in checks.items() if not ok]
    return problems


def test_work_has_torch_works_surface(worlds) -> None:  # noqa: ANN001
    assert worlds(3).run(_work_surface) == [[], [], []]
