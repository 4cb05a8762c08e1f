"""The verbs under ``torch.compile(fullgraph=True)``, in place and functional, on Gloo (1-3 ranks).

Every rank regenerates every rank's input from (seed, rank), so each expected value is computed
locally in float64 from the whole world's data (sums, blocks, concatenations), and each expected
gradient from float64 autograd of the whole world's program simulated in one process (every
rank's loss summed). The compiled program must equal those and the eager program, with no graph
break (``torch._dynamo.explain``), every call traced to a ``torch.ops.commops`` op and recorded
by the flight recorder. World 2 compiles with Inductor (the default backend); world 3 with
``aot_eager`` (Dynamo, the fake implementations and AOT autograd, without Inductor's C++ build,
which costs several seconds a graph on two cores); ``-m slow`` runs world 3 with Inductor too.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import collectives as C
from collectives import functional as F
from collectives.recorder import RECORDER
from tests._compiled import compile_checked, opcheck_failures
from tests.mp import messages

ROWS, COLS = 2, 3  # rows per rank block


def _data(q: int, world: int, seed: int, requires_grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + q)
    return torch.randn(ROWS * world, COLS, generator=g, dtype=torch.float64, requires_grad=requires_grad)


def _splits(world: int, src: int) -> list[int]:
    """Uneven all-to-all rows: rank src sends 1 + (src + q) % 2 rows to rank q (none to itself at odd worlds > 1)."""
    return [0 if (world % 2 and world > 1 and q == src) else 1 + (src + q) % 2 for q in range(world)]


def _check_compiled(fn: Any, backend: str, *args: Any) -> tuple[Any, set[str]]:
    """``fn`` compiled with fullgraph and checked for breaks, its result on ``args``, and the ops traced."""
    compiled, traced = compile_checked(fn, backend, *args)
    return compiled(*args), traced


def _in_place_program(x: torch.Tensor, group: Any) -> tuple[torch.Tensor, ...]:
    world = dist.get_world_size(group)
    y = x * 2 + 1
    C.all_reduce(y, algorithm="ring")
    m = x.clone()
    work = C.all_reduce(m, op=C.ReduceOp.MAX, group=group, async_op=True)
    work.wait()
    b = x.clone()
    C.broadcast(b, world - 1)
    r = x.clone()
    C.reduce(r, None, "sum", group, group_dst=0)
    gathered = x.new_empty((world * x.shape[0], x.shape[1]))
    C.all_gather_single(gathered, x, group)
    scattered = x.new_empty((x.shape[0] // world, x.shape[1]))
    C.reduce_scatter_tensor(scattered, x, "sum", group)
    swapped = torch.empty_like(x)
    C.all_to_all_single(swapped, x, group=group)
    C.barrier(group)
    return y, m, b, r, gathered, scattered, swapped


def _in_place_expected(rank: int, world: int, seed: int) -> list[torch.Tensor | None]:
    xs = [_data(q, world, seed) for q in range(world)]
    total = sum(xs)
    blocks = [x.split(ROWS) for x in xs]
    return [sum(2 * x + 1 for x in xs), torch.stack(xs).amax(0), xs[-1],
            total if rank == 0 else None,  # reduce: only group rank 0's result is defined
            torch.cat(xs), total.split(ROWS)[rank], torch.cat([blocks[q][rank] for q in range(world)])]


def _uneven_program(x: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((out_rows, x.shape[1]))
    C.all_to_all_single(out, x, out_splits, in_splits, algorithm="pairwise")
    return out * 1


def _verbs_case(rank: int, world: int, backend: str, seed: int) -> float:
    group = dist.group.WORLD
    x = _data(rank, world, seed)
    RECORDER.clear()
    eager = _in_place_program(x.clone(), group)
    recorded_eager = len(RECORDER.entries())
    compiled, traced = _check_compiled(_in_place_program, backend, x.clone(), group)
    ops = {"commops.all_reduce_", "commops.broadcast_", "commops.reduce_", "commops.all_gather_",
           "commops.reduce_scatter_", "commops.all_to_all_single_", "commops.barrier"}
    assert ops <= traced, ops - traced
    RECORDER.clear()
    again = torch.compile(_in_place_program, fullgraph=True, backend=backend)(x.clone(), group)
    assert len(RECORDER.entries()) == recorded_eager, (len(RECORDER.entries()), recorded_eager)
    want = _in_place_expected(rank, world, seed)
    err = 0.0
    for got_eager, got, got_again, w in zip(eager, compiled, again, want, strict=True):
        if w is None:
            continue
        assert got.shape == w.shape == got_eager.shape
        err = max(err, (got - w).abs().max().item(), (got_eager - w).abs().max().item(), (got_again - w).abs().max().item())
    # uneven splits (and a rank sending itself nothing at odd world sizes)
    in_splits = _splits(world, rank)
    out_splits = [_splits(world, q)[rank] for q in range(world)]
    xu = _data(rank, world, seed + 1)[: sum(in_splits)]
    got, _ = _check_compiled(_uneven_program, backend, xu, sum(out_splits), out_splits, in_splits)
    parts = [_data(q, world, seed + 1)[: sum(_splits(world, q))].split(_splits(world, q))[rank] for q in range(world)]
    return max(err, (got - torch.cat(parts)).abs().max().item())


def _functional_program(x: torch.Tensor, w: torch.Tensor, group: Any) -> torch.Tensor:
    world = dist.get_world_size(group)
    y = F.all_reduce(torch.sin(x), "sum", group)
    z = F.all_gather_tensor(y * x, 1, group)  # [ROWS * world, COLS * world]
    s = F.reduce_scatter_tensor(z, "avg", 0, group)  # [ROWS, COLS * world]
    a = F.all_to_all_single(s.reshape(world, -1), None, None, group, algorithm="pairwise")
    b = F.broadcast(a * a, 0, group)
    return (b.reshape(-1) * w).sum()


def _functional_reference(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's loss of ``_functional_program``, summed, from plain tensor ops."""
    world = len(xs)
    ys = [sum(torch.sin(x) for x in xs) for _ in range(world)]  # rank q's copy of the all-reduce
    zs = [torch.cat([y * x for x in xs], 1) for y in ys]  # rank q's all-gather of every rank's y * x
    s = [(sum(zs) / world).split(ROWS)[r] for r in range(world)]
    flat = [t.reshape(world, -1) for t in s]
    a = [torch.cat([flat[q][r:r + 1] for q in range(world)]) for r in range(world)]
    b = a[0] * a[0]
    return sum((b.reshape(-1) * w).sum() for w in ws)


def _functional_case(rank: int, world: int, backend: str, seed: int) -> float:
    group = dist.group.WORLD
    n = ROWS * COLS * world
    ws = [torch.randn(n, generator=torch.Generator().manual_seed(seed * 31 + q), dtype=torch.float64)
          for q in range(world)]
    xs = [_data(q, world, seed, requires_grad=True) for q in range(world)]
    loss = _functional_reference(xs, ws)
    loss.backward()
    x = _data(rank, world, seed, requires_grad=True)
    eager = _functional_program(x, ws[rank], group)
    eager.backward()
    eager_grad, x.grad = x.grad, None
    compiled, traced = _check_compiled(_functional_program, backend, x, ws[rank], group)
    ops = {"commops.all_reduce", "commops.all_gather_tensor", "commops.all_to_all_single",
           "commops.reduce_scatter_tensor", "commops.broadcast"}
    assert ops <= traced, ops - traced
    compiled.backward()
    total = F.all_reduce(compiled.detach(), "sum", group)  # the losses of every rank, summed
    return max((total - loss.detach()).abs().item(), (x.grad - xs[rank].grad).abs().max().item(),
               (eager_grad - xs[rank].grad).abs().max().item())


def _errors_case(rank: int, world: int) -> list[str]:
    """Bad arguments under compile: the same typed errors, naming the argument, and the group still works."""
    out = []
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)  # alike on every rank

    def bad_algorithm(t: torch.Tensor) -> torch.Tensor:
        C.all_reduce(t, algorithm="no_such")
        return t

    def bad_dim(t: torch.Tensor) -> torch.Tensor:
        return F.reduce_scatter_tensor(t, "sum", 1)

    for fn in (bad_algorithm, bad_dim):
        torch._dynamo.reset()
        try:
            torch.compile(fn, fullgraph=True, backend="aot_eager")(x.clone())
        except Exception as exc:  # noqa: BLE001 - the test reads its type and text
            out.append(f"{type(exc).__name__}: {exc}")
        else:
            out.append("no error")
    try:  # an op told another group size than its group's (a graph traced for another world)
        torch.ops.commops.all_gather_tensor(x, 0, world + 1, "", "auto")
    except Exception as exc:  # noqa: BLE001 - the test reads its type and text
        out.append(f"{type(exc).__name__}: {exc}")
    y = x.clone()
    C.all_reduce(y)
    assert torch.allclose(y, x * world)
    return out


@pytest.mark.parametrize("world_size,backend", [(1, "inductor"), (2, "inductor"), (3, "aot_eager"),
                                                pytest.param(3, "inductor", marks=pytest.mark.slow)])
def test_compiled_verbs_equal_eager_and_float64(worlds, world_size: int, backend: str) -> None:  # noqa: ANN001
    w = worlds(world_size)
    errs = w.run(_verbs_case, backend, 11, timeout=600)
    assert max(errs) < 1e-12, errs


@pytest.mark.parametrize("world_size,backend", [(2, "inductor"), (3, "aot_eager"),
                                                pytest.param(3, "inductor", marks=pytest.mark.slow)])
def test_compiled_functional_verbs_and_their_gradients(worlds, world_size: int, backend: str) -> None:  # noqa: ANN001
    w = worlds(world_size)
    errs = w.run(_functional_case, backend, 12, timeout=600)
    assert max(errs) < 1e-10, errs


def test_compiled_calls_raise_the_eager_errors(worlds) -> None:  # noqa: ANN001
    w = worlds(2)
    for per_rank in w.run(_errors_case):
        bad_algorithm, bad_dim, bad_size = per_rank
        assert bad_size.startswith("InvalidArgumentError: group_size=3") and "(2 ranks)" in bad_size, bad_size
        assert "UnsupportedError" in bad_algorithm and "algorithm" in bad_algorithm and "no_such" in bad_algorithm, \
            bad_algorithm
        # found while tracing: torch wraps it (TorchRuntimeError), our type and text inside
        assert "InvalidArgumentError" in bad_dim and "scatter_dim=1" in bad_dim and "2 ranks do not divide" in bad_dim, \
            bad_dim


def _opcheck_case(rank: int, world: int) -> list[str]:
    x = torch.randn(2 * world, 3, dtype=torch.float64)
    name = C._ops.group_name(None)
    cases: list[tuple[str, tuple[Any, ...]]] = [
        ("all_reduce_", (x.clone(), "sum", name, "auto")),
        ("reduce_scatter_", (x.new_empty(2, 3), x.clone(), "sum", name, "auto")),
        ("all_gather_", (x.new_empty(2 * world * world, 3), x.clone(), name, "auto")),
        ("all_to_all_single_", (torch.empty_like(x), x.clone(), None, None, name, "auto")),
        ("broadcast_", (x.clone(), None, 0, name, "auto")),
        ("reduce_", (x.clone(), None, 0, "sum", name, "auto")),
        ("all_reduce", (x.clone().requires_grad_(), "sum", name, "auto")),
        ("reduce_scatter_tensor", (x.clone().requires_grad_(), "sum", 0, world, name, "auto")),
        ("all_gather_tensor", (x.clone().requires_grad_(), 1, world, name, "auto")),
        ("all_to_all_single", (x.clone().requires_grad_(), [2] * world, [2] * world, name, "auto")),
        ("broadcast", (x.clone().requires_grad_(), 0, name, "auto")),
        ("broadcast_backward", (x.clone(), 0, name)),
    ]
    return opcheck_failures(cases)


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_verb_op_passes_opcheck(worlds, world_size: int) -> None:  # noqa: ANN001
    failed = worlds(world_size).run(_opcheck_case, timeout=300)
    assert failed == [[]] * world_size, messages(failed)


def test_every_op_of_the_namespace_is_checked() -> None:
    """A new op needs a case above (the overlap and MoE ops': in test_compile_overlap.py, test_compile_moe.py)."""
    import overlap.moe._ops
    import overlap.ops

    checked = {"all_reduce_", "reduce_scatter_", "all_gather_", "all_to_all_single_", "broadcast_", "reduce_",
               "all_reduce", "reduce_scatter_tensor", "all_gather_tensor", "all_to_all_single", "broadcast",
               "broadcast_backward", "barrier"}
    assert set(C._ops.SCHEMAS) == checked
    assert set(overlap.ops.SCHEMAS) == {"gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm"}
    assert set(overlap.moe._ops.SCHEMAS) == {"moe_layer", "moe_layer_backward", "moe_dispatch_low_latency",
                                             "moe_combine_low_latency"}  # test_compile_overlap.py, test_compile_moe.py


def _communicator_program(x: torch.Tensor, comm: C.Communicator) -> torch.Tensor:
    y = x * 3
    comm.all_reduce(y, algorithm="ring")
    out = y.new_empty((comm.size * y.shape[0], y.shape[1]))
    comm.all_gather_single(out, y)
    comm.broadcast(out, group_src=0)
    comm.barrier()
    return out


def _communicator_case(rank: int, world: int) -> float:
    """The communicator's methods trace to the ops too."""
    comm = C.get_communicator()
    x = _data(rank, world, 21)
    got, traced = _check_compiled(_communicator_program, "aot_eager", x, comm)
    assert {"commops.all_reduce_", "commops.all_gather_", "commops.broadcast_", "commops.barrier"} <= traced, traced
    total = 3 * sum(_data(q, world, 21) for q in range(world))
    return (got - torch.cat([total] * world)).abs().max().item()


def test_compiled_communicator_methods(worlds) -> None:  # noqa: ANN001
    assert max(worlds(2).run(_communicator_case)) < 1e-12
