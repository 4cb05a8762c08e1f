"""``fused_all_reduce_rmsnorm`` against float64 and its plain program, on Gloo at 1-3 ranks.

Every rank regenerates every rank's ``x`` from (seed, rank), so the expected ``r`` (the ranks'
sum plus the residual) and ``y`` (its RMSNorm times the weight), and the gradients of a loss of
both, come from float64 autograd of the whole computation. Odd hidden sizes, odd row counts,
3-D inputs, one row, no rows. The fused kernel itself needs CUDA (``tests/gpu_norm_check.py``);
here it is refused with the reason, and ``auto`` says why it ran the sequence.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

import collectives as C
from overlap import last_choice
from overlap.norm import fused_all_reduce_rmsnorm, reference_all_reduce_rmsnorm
from tests._compiled import compile_checked, opcheck_failures
from tests.mp import messages

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _inputs(q: int, shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank q's x; the residual and the weight (the same on every rank)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed * 100 + q), dtype=torch.float64)
    g = torch.Generator().manual_seed(seed * 100 + 99)
    return x, torch.randn(*shape, generator=g, dtype=torch.float64), 0.5 + torch.rand(shape[-1], generator=g,
                                                                                      dtype=torch.float64)


def _want(world: int, shape: tuple[int, ...], seed: int, eps: float) -> tuple[Any, ...]:
    """float64: y, r and (as leaves) every rank's x, the residual and the weight."""
    xs = [_inputs(q, shape, seed)[0].requires_grad_() for q in range(world)]
    _, res, w = (t.requires_grad_() for t in _inputs(0, shape, seed))
    r = sum(xs) + res
    y = r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps) * w
    return y, r, xs, res, w


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest error relative to the largest expected magnitude (at least 1)."""
    if not got.numel():
        return 0.0
    return float((got.detach().double() - want.detach()).abs().max() / want.detach().abs().max().clamp(min=1))


def _case(rank: int, world: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int, eps: float,
          strategy: str, grad: bool) -> dict[str, float]:
    x, res, w = (t.to(dtype).requires_grad_(grad) for t in _inputs(rank, shape, seed))
    y, r = fused_all_reduce_rmsnorm(x, res, w, eps, strategy=strategy)
    assert y.shape == r.shape == x.shape and y.dtype == r.dtype == dtype and y.is_contiguous() and r.is_contiguous()
    assert last_choice().strategy == "sequential", last_choice()
    want_y, want_r, xs, res64, w64 = _want(world, shape, seed, eps)
    errs = {"y": _err(y, want_y), "r": _err(r, want_r)}
    ref_y, ref_r = reference_all_reduce_rmsnorm(x.detach(), res.detach(), w.detach(), eps)
    errs["ref_y"], errs["ref_r"] = _err(ref_y, want_y), _err(ref_r, want_r)
    if grad:
        gy, gr = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed + k), dtype=torch.float64)
                  for k in (1, 2))  # the same on every rank: replicated results, their loss counted once
        ((y * gy.to(dtype)).sum() + (r * gr.to(dtype)).sum()).backward()
        ((want_y * gy).sum() + (want_r * gr).sum()).backward()
        errs.update(gx=_err(x.grad, xs[rank].grad), gres=_err(res.grad, res64.grad), gw=_err(w.grad, w64.grad))
    return errs


CASES = [((5, 7), torch.float64, 1e-6), ((2, 3, 33), torch.float32, 1e-5), ((1, 4096), torch.float32, 1e-6),
         ((3, 129), torch.bfloat16, 1e-6), ((4, 64), torch.float16, 1e-5), ((0, 16), torch.float32, 1e-6)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_it_equals_float64_at_every_shape_and_dtype(worlds, world_size: int) -> None:  # noqa: ANN001
    w = worlds(world_size)
    for seed, (shape, dtype, eps) in enumerate(CASES):
        for strategy in ("auto", "sequential"):
            for errs in w.run(_case, shape, dtype, 50 + seed, eps, strategy, True):
                assert max(errs.values()) < TOL[dtype], (shape, dtype, strategy, errs)


def _refusals(rank: int, world: int) -> list[str]:
    x = torch.randn(3, 8)
    calls = [lambda: fused_all_reduce_rmsnorm(x, torch.randn(3, 9), torch.ones(8)),
             lambda: fused_all_reduce_rmsnorm(x, torch.randn(3, 8), torch.ones(9)),
             lambda: fused_all_reduce_rmsnorm(x, torch.randn(3, 8, dtype=torch.float64), torch.ones(8)),
             lambda: fused_all_reduce_rmsnorm(x, torch.randn(3, 8), torch.ones(8), eps=-1.0),
             lambda: fused_all_reduce_rmsnorm(x.long(), torch.randn(3, 8).long(), torch.ones(8).long()),
             lambda: fused_all_reduce_rmsnorm(x, [1.0], torch.ones(8))]
    out = messages(calls)
    for strategy in ("fused", "fastest"):
        try:
            fused_all_reduce_rmsnorm(x, x, torch.ones(8), strategy=strategy)
            out.append("no error")
        except C.UnsupportedError as exc:
            out.append(str(exc))
    y, r = fused_all_reduce_rmsnorm(torch.ones(2, 4), torch.zeros(2, 4), torch.ones(4))  # the group still works
    out.append(f"after: {r.tolist()}")
    out.append(last_choice().reason)
    return out


def test_bad_arguments_are_refused_by_name_and_the_group_still_works(worlds) -> None:  # noqa: ANN001
    for out in worlds(2).run(_refusals):
        for msg, name in zip(out, ("residual", "weight", "residual", "eps", "x", "residual")):
            assert msg != "no error" and name in msg, out
        assert "strategy" in out[6] and "CUDA kernel" in out[6] and "cpu" in out[6], out[6]
        assert "strategy" in out[7] and "'fastest'" in out[7], out[7]
        assert out[8] == "after: [[2.0, 2.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]]", out[8]
        assert "CUDA kernel" in out[9], out[9]


def _compiled_case(rank: int, world: int) -> float:
    x, res, w = (t.float() for t in _inputs(rank, (3, 10), 61))

    def step(x: torch.Tensor, res: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y, r = fused_all_reduce_rmsnorm(x * 2, res, w)
        return y + r

    compiled, traced = compile_checked(step, "aot_eager", x, res, w)
    assert "commops.all_reduce_rmsnorm" in traced, traced
    eager = step(x, res, w)
    got = compiled(x, res, w)
    # x * 2 in the step: the ranks' doubled sum, so the float64 reference is recomputed for it
    xs = [2 * _inputs(q, (3, 10), 61)[0] for q in range(world)]
    r64 = sum(xs) + _inputs(0, (3, 10), 61)[1]
    y64 = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-6) * _inputs(0, (3, 10), 61)[2]
    return max(_err(got, y64 + r64), _err(eager, y64 + r64))


def test_compiled_it_is_one_graph_with_the_op(worlds) -> None:  # noqa: ANN001
    assert max(worlds(2).run(_compiled_case, timeout=300)) < 1e-5


def _opcheck_case(rank: int, world: int) -> list[str]:
    from collectives._ops import group_name

    x, res, w = (t.requires_grad_() for t in _inputs(rank, (4, 6), 71))
    return opcheck_failures([("all_reduce_rmsnorm", (x, res, w, 1e-6, group_name(None), "sequential")),
                             ("all_reduce_rmsnorm", (x.detach(), res.detach(), w.detach(), 1e-5, group_name(None),
                                                     "auto"))])


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_op_passes_opcheck(worlds, world_size: int) -> None:  # noqa: ANN001
    failed = worlds(world_size).run(_opcheck_case, timeout=300)
    assert failed == [[]] * world_size, failed


def test_the_benchmark_runs_on_cpus_and_says_what_ran(tmp_path) -> None:  # noqa: ANN001
    out = tmp_path / "norm.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "launch/bench_norm.py", "-n", "2", "-r", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    assert [(r["rows"], r["hidden"], r["world"]) for r in records] == [(1, 64, 2), (5, 64, 2)]
    for r in records:
        assert r["wrong"] == 0 and r["fused_ran"] == "sequential" and "CUDA kernel" in r["fused_reason"], r
        assert all(r[k] > 0 for k in ("fused_us", "three_us", "nccl_three_us", "sequential_us", "ratio")), r


def _row_case(rank: int, world: int, sequence_parallel: bool) -> float:
    from overlap.layers import RowParallelLinear

    torch.manual_seed(5)  # the same full layer, input, residual and gradients on every rank
    K, N, T = 6 * world, 10, 4 * world
    full = torch.nn.Linear(K, N, dtype=torch.float64)
    x = torch.randn(T, K, dtype=torch.float64)
    residual = torch.randn(T, N, dtype=torch.float64)
    w = (0.5 + torch.rand(N, dtype=torch.float64)).requires_grad_()
    gy, gr = torch.randn(T, N, dtype=torch.float64), torch.randn(T, N, dtype=torch.float64)
    row = RowParallelLinear.from_linear(full, sequence_parallel=sequence_parallel)
    xs = x.chunk(world, 1)[rank].clone().requires_grad_()  # this rank's input features
    # sequence parallel: this rank's positions of the output and the residual stream
    rows = slice(rank * T // world, (rank + 1) * T // world) if sequence_parallel else slice(None)
    res = residual[rows].clone().requires_grad_()
    wl = w.detach().clone().requires_grad_()
    y, r = row.forward_rmsnorm(xs, res, wl)
    ((y * gy[rows]).sum() + (r * gr[rows]).sum()).backward()
    # float64 autograd of the unsharded block; the loss of every position (the ranks' losses summed)
    xf, resf = x.clone().requires_grad_(), residual.clone().requires_grad_()
    rf = full(xf) + resf
    yf = rf * torch.rsqrt(rf.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    ((yf * gy).sum() + (rf * gr).sum()).backward()
    pairs = [(y, yf[rows]), (r, rf[rows]), (xs.grad, xf.grad.chunk(world, 1)[rank]), (res.grad, resf.grad[rows]),
             (row.weight.grad, full.weight.grad.chunk(world, 1)[rank]), (row.bias.grad, full.bias.grad)]
    if not sequence_parallel:  # (split, each rank's norm weight gradient is its positions' part)
        pairs.append((wl.grad, w.grad))
    return max(_err(g, h) for g, h in pairs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_row_parallel_layer_forward_rmsnorm_equals_the_unsharded_block(worlds, world_size: int) -> None:  # noqa: ANN001
    for sp in (False, True):
        assert max(worlds(world_size).run(_row_case, sp)) < 1e-12, sp
