"""The fused all-reduce + residual + RMSNorm kernels on GPUs against float64: ``torchrun
--nproc-per-node N tests/gpu_norm_check.py`` (run by ``tests/test_gpu_norm.py``).

Ranks may share GPUs (``local_rank % device_count``), as in ``gpu_moe_overlap_check.py``: peer
memory maps a GPU's own memory from another process as it maps a peer's, and nothing here uses
NCCL. At one rank the one-rank kernel (the add and the norm) runs instead.

Families:

- ``fused/<dtype>``: ``strategy="auto"`` and ``"fused"`` at shapes that take each kernel: rows
  of low-latency words (1-16 rows of 4096 or 8192), the slots (64 and 256 rows), odd hidden
  sizes (the element-wise members), 3-D inputs, no rows; ``auto`` must have chosen ``fused``.
  ``y`` and ``r`` against float64 (every rank's ``x`` regenerated from its seed), and the same
  bits on every rank. Outputs land in memory poisoned with NaN beforehand.
- ``graph/<dtype>``: two calls (words and slots) captured in one CUDA graph after an eager
  warm-up, replayed 200 times with new data copied in before each replay; every replay checked.
- ``replan``: a shape's kept launch (its plan) with new data, with inputs that are misaligned
  views of larger buffers, and after the group's peer memory was closed and built again (the
  kept plan must not launch against the closed memory).
- ``soak/eager``, ``soak/graph``: 1,000 back-to-back calls (bf16, 1-64 rows of 4096, the row
  count changing every call) with nothing in between, eagerly and from graph replays; all
  outputs checked afterwards against float64. A moving error is a race.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from overlap import last_choice  # noqa: E402
from collectives.peer import close_peer_memory  # noqa: E402
from overlap.norm import fused_all_reduce_rmsnorm  # noqa: E402
from tests._checks import (Checks, check_arguments, dtype_name, report, same_bits_on_every_rank,  # noqa: E402
                           shared_gpu_ranks)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}  # of the largest expected magnitude
SHAPES = ((1, 4096), (3, 4096), (16, 8192), (64, 4096), (256, 8192), (5, 4097), (7, 130), (2, 3, 1000), (0, 4096))
SOAK_CALLS = 1000
EPS = 1e-6


def families() -> tuple[str, ...]:
    return tuple(f"{kind}/{dtype_name(d)}" for kind in ("fused", "graph") for d in DTYPES) + \
        ("replan", "soak/eager", "soak/graph")


def _inputs(q: int, shape: tuple[int, ...], seed: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """Rank q's x; the residual and the weight (the same on every rank); float64, on ``dev``."""
    g = torch.Generator(device=dev).manual_seed(seed * 131 + q)
    x = torch.randn(*shape, generator=g, device=dev, dtype=torch.float64)
    g.manual_seed(seed * 131 + 127)
    return x, torch.randn(*shape, generator=g, device=dev, dtype=torch.float64), \
        0.5 + torch.rand(shape[-1], generator=g, device=dev, dtype=torch.float64)


def _want(world: int, shape: tuple[int, ...], seed: int, dtype: torch.dtype, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """float64 y and r of the rounded inputs."""
    xs = [_inputs(q, shape, seed, dev)[0].to(dtype).double() for q in range(world)]
    _, res, w = (t.to(dtype).double() for t in _inputs(0, shape, seed, dev))
    r = torch.stack(xs).sum(0) + res
    return r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + EPS) * w, r


def _close(ck: Checks, what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    ck.count()
    if not got.numel():
        return
    err = float((got.double() - want).abs().max() / want.abs().max().clamp(min=1))
    if not err <= TOL[dtype]:  # NaN fails too
        ck.fail(f"{what}: error {err:.3g} > {TOL[dtype]:g}")


def _poison(dev: torch.device) -> None:
    """Fill freed memory of the caching allocator with NaN, where the next outputs will land."""
    junk = torch.full((64 << 20,), float("nan"), dtype=torch.float16, device=dev)
    del junk


def check_fused(ck: Checks, world: int, dtype: torch.dtype, dev: torch.device) -> None:
    for i, shape in enumerate(SHAPES):
        for strategy in ("auto", "fused"):
            seed = 10 * i + (strategy == "fused")
            x, res, w = (t.to(dtype) for t in _inputs(dist.get_rank(), shape, seed, dev))
            _poison(dev)
            y, r = fused_all_reduce_rmsnorm(x, res, w, EPS, strategy=strategy)
            torch.cuda.synchronize()
            where = f"{strategy} {tuple(shape)} {dtype_name(dtype)}"
            ck.count()
            choice = last_choice()
            if choice is None or choice.strategy != "fused":
                ck.fail(f"{where}: ran {choice}")
            want_y, want_r = _want(world, shape, seed, dtype, dev)
            _close(ck, f"{where} r", r, want_r, dtype)
            _close(ck, f"{where} y", y, want_y, dtype)
            same_bits_on_every_rank(ck, f"{where} y", y)
            same_bits_on_every_rank(ck, f"{where} r", r)


def check_graph(ck: Checks, world: int, dtype: torch.dtype, dev: torch.device, replays: int = 200) -> None:
    shapes = ((4, 4096), (128, 4096))  # words, then slots
    static = [[t.to(dtype) for t in _inputs(dist.get_rank(), s, 0, dev)] for s in shapes]
    for x, res, w in static:  # eager warm-up: the peer memory and the module exist before the capture
        fused_all_reduce_rmsnorm(x, res, w, EPS)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fused_all_reduce_rmsnorm(x, res, w, EPS) for x, res, w in static]
    ck.count()
    if last_choice().strategy != "fused":
        ck.fail(f"captured: ran {last_choice()}")
    for k in range(replays):
        seed = 1000 + k
        for s, (x, res, w) in zip(shapes, static):
            nx, nres, nw = (t.to(dtype) for t in _inputs(dist.get_rank(), s, seed, dev))
            x.copy_(nx), res.copy_(nres), w.copy_(nw)
        graph.replay()
        for s, (y, r) in zip(shapes, outs):
            want_y, want_r = _want(world, s, seed, dtype, dev)
            _close(ck, f"replay {k} {s} y", y, want_y, dtype)
            _close(ck, f"replay {k} {s} r", r, want_r, dtype)


def check_replan(ck: Checks, world: int, dev: torch.device) -> None:
    dtype, rank, shape = torch.bfloat16, dist.get_rank(), (8, 4096)
    for step, seed in (("first", 300), ("kept", 301), ("view", 302), ("reopened", 303)):
        x, res, w = (t.to(dtype) for t in _inputs(rank, shape, seed, dev))
        if step == "view":  # one element into larger buffers: copied to aligned memory first
            bx, br = torch.empty(x.numel() + 1, dtype=dtype, device=dev), torch.empty(x.numel() + 1, dtype=dtype, device=dev)
            bx[1:].copy_(x.flatten()), br[1:].copy_(res.flatten())
            x, res = bx[1:].view(shape), br[1:].view(shape)
        if step == "reopened" and world > 1:
            close_peer_memory(C.get_communicator())
        _poison(dev)
        y, r = fused_all_reduce_rmsnorm(x, res, w, EPS, strategy="fused")
        torch.cuda.synchronize()
        ck.count()
        want_y, want_r = _want(world, shape, seed, dtype, dev)
        _close(ck, f"{step} r", r, want_r, dtype)
        _close(ck, f"{step} y", y, want_y, dtype)
        same_bits_on_every_rank(ck, f"{step} y", y)


def _soak_rows(k: int) -> int:
    return 1 + (k * 37) % 64


def soak_eager(ck: Checks, world: int, dev: torch.device) -> None:
    dtype, rank = torch.bfloat16, dist.get_rank()
    ins = [[t.to(dtype) for t in _inputs(rank, (_soak_rows(k), 4096), 5000 + k, dev)] for k in range(SOAK_CALLS)]
    torch.cuda.synchronize()
    outs = [fused_all_reduce_rmsnorm(x, res, w, EPS) for x, res, w in ins]  # back to back, nothing between
    torch.cuda.synchronize()
    _tally(ck, "eager", world, outs, dtype, dev)


def soak_graph(ck: Checks, world: int, dev: torch.device) -> None:
    dtype, rank = torch.bfloat16, dist.get_rank()
    static = [t.to(dtype) for t in _inputs(rank, (64, 4096), 0, dev)]
    fused_all_reduce_rmsnorm(*static, EPS)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, r = fused_all_reduce_rmsnorm(*static, EPS)
    ins = [[t.to(dtype) for t in _inputs(rank, (64, 4096), 7000 + k, dev)] for k in range(SOAK_CALLS)]
    outs = []
    for new in ins:  # copies, replay, copies out: all on the stream, nothing waits for the host
        for t, n in zip(static, new):
            t.copy_(n)
        graph.replay()
        outs.append((y.clone(), r.clone()))
    torch.cuda.synchronize()
    _tally(ck, "graph", world, outs, dtype, dev, rows=64, base=7000)


def _tally(ck: Checks, what: str, world: int, outs: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
           dev: torch.device, rows: int | None = None, base: int = 5000) -> None:
    wrong = 0
    for k, (y, r) in enumerate(outs):
        shape = (rows or _soak_rows(k), 4096)
        want_y, want_r = _want(world, shape, base + k, dtype, dev)
        before = len(ck.failures)
        _close(ck, f"{what} call {k} y", y, want_y, dtype)
        _close(ck, f"{what} call {k} r", r, want_r, dtype)
        wrong += len(ck.failures) > before
    if wrong:
        ck.fail(f"{what} soak: {wrong} of {len(outs)} calls wrong")


def main() -> int:
    args = check_arguments(families())
    only = args.only
    comm, dev = shared_gpu_ranks()
    ck = Checks(families(), comm.rank)
    for dtype in DTYPES:
        for kind, fn in (("fused", check_fused), ("graph", check_graph)):
            name = f"{kind}/{dtype_name(dtype)}"
            if name in only:
                with ck.family(name):
                    fn(ck, comm.size, dtype, dev)
    for name, soak in (("replan", check_replan), ("soak/eager", soak_eager), ("soak/graph", soak_graph)):
        if name in only:
            with ck.family(name):
                soak(ck, comm.size, dev)
    failed = report(ck, args.json, "fused all-reduce + RMSNorm", comm.size)
    C.destroy()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
