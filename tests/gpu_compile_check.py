"""The torch.ops.commops ops under torch.compile and CUDA graphs (run by ``tests/test_gpu_compile.py``):
``torchrun --nproc-per-node N tests/gpu_compile_check.py [--json out.json]``.

On CUDA over NCCL (one rank per GPU; world 1 on one GPU): the verbs in place and functional
(gradients included), the overlap operators, a two-layer tensor-parallel MLP and ``MoELayer``
(with and without its FP8 dispatch) forward and backward, compiled with ``fullgraph=True``
(Inductor) and compared with float64 references
built from every rank's data; the same programs compiled with ``mode="reduce-overhead"``,
replayed from CUDA graphs with fresh inputs (and no graph skipped); eager and compiled code
captured with ``torch.cuda.graph`` and replayed; and the native algorithm's fast path for
repeated calls (``Native.fast_path``), inside torch's coalescing manager too. On CPU over Gloo
the compiled families run (how the script itself is tried without a GPU). Families:
``families(device_type)`` (``tests/_checks.py``).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import gc
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from collectives import functional as F  # noqa: E402
from collectives.recorder import RECORDER  # noqa: E402
from overlap import ops  # noqa: E402
from overlap.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from tests._checks import Checks, report  # noqa: E402
from tests._compiled import compile_checked  # noqa: E402
from tests.test_overlap_moe import _layer_case  # noqa: E402
from tests.test_overlap_moe_fp8 import layer_case as fp8_layer_case  # noqa: E402

COMPILED = ("compiled/verbs", "compiled/functional", "compiled/overlap", "compiled/tp_mlp", "compiled/moe_layer")
CUDA_ONLY = ("reduce_overhead/verbs", "reduce_overhead/tp_mlp", "cuda_graph/eager", "cuda_graph/compiled",
             "native_fast_path")
TOL = 1e-4  # float32 against float64 references, sums of a few dozen terms of size ~1


def families(device_type: str) -> tuple[str, ...]:
    """The families a run on ``device_type`` ("cuda" over NCCL, "cpu" over Gloo) records checks into."""
    return COMPILED + (CUDA_ONLY if device_type == "cuda" else ())


def _data(q: int, seed: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + q)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(device)


def _verbs(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    world = dist.get_world_size()
    y = x * 2 + 1
    C.all_reduce(y)
    m = x.clone()
    C.all_reduce(m, op="max", algorithm="native")
    b = x.clone()
    C.broadcast(b, world - 1)
    gathered = x.new_empty((world * x.shape[0], *x.shape[1:]))
    C.all_gather_single(gathered, x)
    scattered = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    C.reduce_scatter_tensor(scattered, x)
    swapped = torch.empty_like(x)
    C.all_to_all_single(swapped, x)
    return y, m, b, gathered, scattered, swapped


def _verbs_expected(xs: list[torch.Tensor], rank: int) -> list[torch.Tensor]:
    world = len(xs)
    rows = xs[0].shape[0] // world
    return [sum(2 * x + 1 for x in xs), torch.stack(xs).amax(0), xs[-1], torch.cat(xs),
            sum(xs).split(rows)[rank], torch.cat([x.split(rows)[rank] for x in xs])]


def _functional(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = F.all_reduce(torch.sin(x), "sum")
    z = F.all_gather_tensor(y * x, 1)
    s = F.reduce_scatter_tensor(z, "sum", 0)
    return (F.broadcast(s * s, 0).reshape(-1) * w).sum()


def _functional_reference(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> torch.Tensor:
    world = len(xs)
    ys = [sum(torch.sin(x) for x in xs) for _ in range(world)]
    zs = [torch.cat([y * x for x in xs], 1) for y in ys]
    s0 = sum(zs).split(xs[0].shape[0] // world)[0]
    return sum(((s0 * s0).reshape(-1) * w).sum() for w in ws)


def _mlp(world: int, rank: int, device: torch.device, sequence_parallel: bool, strategy: str) -> Any:
    """A two-layer MLP, full (float64, the reference) and sharded (float32), with the same weights."""
    torch.manual_seed(1234)
    h, ffn = 16, 8 * world
    ref1 = torch.nn.Linear(h, ffn).double().to(device)
    ref2 = torch.nn.Linear(ffn, h).double().to(device)
    opts = {"sequence_parallel": sequence_parallel, "strategy": strategy}
    fc1 = ColumnParallelLinear.from_linear(copy.deepcopy(ref1).float(), **opts)
    fc2 = RowParallelLinear.from_linear(copy.deepcopy(ref2).float(), **opts)

    def sharded(t: torch.Tensor) -> torch.Tensor:
        return fc2(torch.nn.functional.gelu(fc1(t)))

    def full(t: torch.Tensor) -> torch.Tensor:
        return ref2(torch.nn.functional.gelu(ref1(t)))
    return sharded, full, (fc1, fc2), (ref1, ref2)


Close = Callable[..., None]


def closer(ck: Checks, r: int) -> Close:
    """``close(what, got, want, tol=TOL)``: a check in ``ck`` that ``got`` has ``want``'s shape and
    lies within ``tol`` of it, relative to ``want``'s largest magnitude where that exceeds 1."""
    def close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
        ck.count()
        if got.shape != want.shape:
            ck.fail(f"rank {r} {what}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
            return
        err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        scale = want.double().abs().max().item() if want.numel() else 1.0
        if not err <= tol * max(1.0, scale):
            ck.fail(f"rank {r} {what}: max error {err:.3g} (scale {scale:.3g})")
    return close


def guarder(ck: Checks, r: int) -> Callable[[str, Callable[[], None]], None]:
    """``guarded(what, fn)``: ``fn()``, and what it raised as a failure in ``ck`` (a check that
    raises leaves the script's other families to run)."""
    def guarded(what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported as a failure, with what raised
            ck.count()
            ck.fail(f"rank {r} {what}: {type(exc).__name__}: {str(exc)[:400]}")
    return guarded


def mlp_checks(close: Close, w: int, r: int, dev: torch.device, mode: str | None, strategy: str = "chunked") -> None:
    """The two-layer tensor-parallel MLP (``strategy``), with and without sequence parallelism,
    against the float64 unsharded one: compiled (``fullgraph``, Inductor) forward and backward
    with ``mode=None``, else compiled in ``mode`` and its forward replayed with fresh inputs."""
    for sp in (False, True):
        sharded, full, (fc1, fc2), (ref1, ref2) = _mlp(w, r, dev, sp, strategy)
        rows = slice(r * 4, (r + 1) * 4) if sp else slice(None)
        example = _data(0, 0, (4 * w, 2, 16), dev).float()[rows]
        fn = compile_checked(sharded, "inductor", example)[0] if mode is None \
            else torch.compile(sharded, fullgraph=True, mode=mode)
        for seed in (31, 32, 33, 34):
            x = _data(0, seed, (4 * w, 2, 16), dev).requires_grad_()  # the same full input on every rank
            want = full(x)
            if mode is not None:  # forward only: replays of the inference graph
                with torch.no_grad():
                    close(f"tp mlp {mode} sp={sp} seed {seed}", fn(x[rows].float()), want[rows])
                continue
            xr = x.detach()[rows].float().clone().requires_grad_()
            g = _data(0, seed + 100, tuple(want.shape), dev)
            (want * g).sum().backward()
            (fn(xr) * g[rows].float()).sum().backward()
            f = fc1.out_per_rank
            close(f"tp mlp sp={sp} output", fn(xr).detach(), want[rows].detach())
            close(f"tp mlp sp={sp} input grad", xr.grad, x.grad[rows])
            close(f"tp mlp sp={sp} fc1 weight grad", fc1.weight.grad, ref1.weight.grad[r * f:(r + 1) * f])
            close(f"tp mlp sp={sp} fc2 weight grad", fc2.weight.grad, ref2.weight.grad[:, r * f:(r + 1) * f])
            for m in (fc1, fc2, ref1, ref2):
                m.zero_grad(set_to_none=True)
            del x


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", help="write the results by family here (tests/_checks.py)")
    args = p.parse_args()
    comm = C.init()
    w, r = comm.size, comm.rank
    cuda = bool(comm.backend_for("cuda"))
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ck = Checks(families(dev.type), r)
    close, guarded = closer(ck, r), guarder(ck, r)

    shape = (2 * w, 3)

    def verbs_checks(mode: str | None) -> None:
        torch._dynamo.reset()
        fn: Any = None
        for seed in (1, 2, 3, 4):  # reduce-overhead: the first calls warm up and capture, the later ones replay
            xs = [_data(q, seed, shape, dev).float() for q in range(w)]
            if fn is None and mode is None:
                fn, traced = compile_checked(_verbs, "inductor", xs[r])
                ck.count()
                if "commops.all_reduce_" not in traced:
                    ck.fail(f"rank {r} verbs: not traced to commops ops: {sorted(traced)}")
            elif fn is None:
                fn = torch.compile(_verbs, fullgraph=True, mode=mode)
            RECORDER.clear()
            got = fn(xs[r].clone())
            if mode is None:  # (a replayed CUDA graph runs no host code: nothing is recorded)
                ck.count()
                if len(RECORDER.entries()) != 6:
                    ck.fail(f"rank {r} compiled verbs: {len(RECORDER.entries())} recorder entries, want 6")
            for i, (g, want) in enumerate(zip(got, _verbs_expected([x.double() for x in xs], r), strict=True)):
                close(f"verbs {mode} seed {seed} output {i}", g, want)

    with ck.family("compiled/verbs"):
        guarded("compiled verbs", lambda: verbs_checks(None))

    def functional_checks() -> None:
        n = shape[0] // w * shape[1] * w
        ws = [_data(q, 9, (n,), dev) for q in range(w)]
        xs = [_data(q, 5, shape, dev).requires_grad_() for q in range(w)]
        loss = _functional_reference(xs, ws)
        loss.backward()
        x = _data(r, 5, shape, dev).float().requires_grad_()
        fn, _ = compile_checked(_functional, "inductor", x, ws[r].float())
        out = fn(x, ws[r].float())
        out.backward()
        close("functional loss (summed over ranks)", F.all_reduce(out.detach(), "sum"), loss.detach())
        close("functional gradient", x.grad, xs[r].grad)

    with ck.family("compiled/functional"):
        guarded("compiled functional", functional_checks)

    def overlap_checks() -> None:
        for strategy in ("sequential", "chunked", "auto"):
            a = [_data(q, 21, (4, 3, 8), dev) for q in range(w)]
            b = [_data(q, 22, (8, 6), dev) for q in range(w)]
            fn, _ = compile_checked(ops.gemm_all_reduce, "inductor", a[r].float(), b[r].float(), strategy=strategy)
            close(f"gemm_all_reduce {strategy}", fn(a[r].float(), b[r].float(), strategy=strategy),
                  sum(aq @ bq for aq, bq in zip(a, b)))
            fn, _ = compile_checked(ops.gemm_reduce_scatter, "inductor", a[r].float(), b[r].float(), strategy=strategy)
            got = fn(a[r].float(), b[r].float(), strategy=strategy)
            close(f"gemm_reduce_scatter {strategy}", got, sum(aq @ bq for aq, bq in zip(a, b)).chunk(w, 0)[r])
            fn, _ = compile_checked(ops.all_gather_gemm, "inductor", a[r].float(), b[r].float(), strategy=strategy)
            got = fn(a[r].float(), b[r].float(), strategy=strategy)
            close(f"all_gather_gemm {strategy}", got, torch.cat(a) @ b[r])

    with ck.family("compiled/overlap"):
        guarded("compiled overlap", overlap_checks)

    with ck.family("compiled/tp_mlp"):
        guarded("compiled tp mlp", lambda: mlp_checks(close, w, r, dev, None))

    def moe_checks() -> None:
        # a rank without tokens: where another rank has some (alone, no gradient reaches the experts)
        for tokens in [[9 + 2 * q for q in range(w)]] + ([[0] + [5] * (w - 1)] if w > 1 else []):
            ck.count()
            err = _layer_case(r, w, tokens, None, "auto", "inductor", dev.type)  # float64, outputs and gradients
            if not err < 1e-10:
                ck.fail(f"rank {r} compiled MoELayer, tokens {tokens}: max error {err:.3g} against the single-process layer")
            # with the FP8 dispatch: against the layer whose experts take each token rounded
            ck.count()
            err, apart = fp8_layer_case(r, w, tokens, "inductor", dev.type)
            if not err < 1e-10 or (tokens[r] and not apart > 1e-4):
                ck.fail(f"rank {r} compiled MoELayer(fp8_dispatch=True), tokens {tokens}: max error {err:.3g} against "
                        f"the rounded single-process layer, {apart:.3g} from the unrounded one")

    with ck.family("compiled/moe_layer"):
        guarded("compiled moe layer", moe_checks)

    if cuda:
        from torch._dynamo.utils import counters

        def tp_mlp(mode: str | None) -> None:
            mlp_checks(close, w, r, dev, mode)

        for name, checks in (("verbs", verbs_checks), ("tp_mlp", tp_mlp)):
            with ck.family(f"reduce_overhead/{name}"):
                counters.clear()
                guarded(f"reduce-overhead {name}", lambda: checks("reduce-overhead"))  # noqa: B023 - called at once
                ck.count()
                if counters["inductor"].get("cudagraph_skips", 0):
                    ck.fail(f"rank {r} reduce-overhead {name}: cudagraph skipped: {dict(counters['inductor'])}")
        with ck.family("cuda_graph/eager"):
            guarded("captured eager verbs", lambda: _captured_checks(close, w, r, dev, compiled=False))
        with ck.family("cuda_graph/compiled"):
            guarded("captured compiled verbs", lambda: _captured_checks(close, w, r, dev, compiled=True))
        with ck.family("native_fast_path"):
            guarded("native fast path", lambda: _native_checks(ck, close, comm, w, r, dev))

    failed = report(ck, args.json, "compile", w)
    # NCCL's destroy waits while CUDA graphs that captured its kernels live: reduce-overhead's
    # graphs go with Dynamo's caches (measured: without this, destroy hung on one H200)
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
    faulthandler.dump_traceback_later(45, exit=True)  # a hang past here prints its stacks and ends the run
    C.destroy()
    faulthandler.cancel_dump_traceback_later()
    return 1 if failed else 0


def _step(x: torch.Tensor, wt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A small TP step: a GEMM all-reduced in place, and the functional all-gather of another."""
    y = x @ wt
    C.all_reduce(y)
    z = F.all_gather_tensor(torch.relu(x), 0)
    return y, z


def _captured_checks(close: Any, w: int, r: int, dev: torch.device, compiled: bool) -> None:
    """``_step`` (eager, or compiled in the default mode) captured with ``torch.cuda.graph`` after a
    warm-up, then replayed with fresh data copied into its static inputs."""
    fn = torch.compile(_step, fullgraph=True) if compiled else _step
    x = torch.empty(4, 8, device=dev)
    wt = _data(0, 40, (8, 5), dev).float()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            x.copy_(_data(r, 41, (4, 8), dev))
            fn(x, wt)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, z = fn(x, wt)
    for seed in (50, 51, 52):
        xs = [_data(q, seed, (4, 8), dev) for q in range(w)]
        x.copy_(xs[r])
        graph.replay()
        torch.cuda.synchronize()
        what = "compiled" if compiled else "eager"
        close(f"captured {what} step replay {seed}: all_reduce", y, sum(xq @ wt.double() for xq in xs))
        close(f"captured {what} step replay {seed}: all_gather", z, torch.cat([torch.relu(xq) for xq in xs]))


def _native_checks(ck: Checks, close: Any, comm: C.Communicator, w: int, r: int, dev: torch.device) -> None:
    """Repeats of native all-reduce, reduce-scatter and all-gather take the fast path
    (``Native.fast_path``), give the right values every time and are recorded, inside torch's
    coalescing manager too."""
    for seed in range(4):
        xs = [_data(q, 60 + seed, (6 * w,), dev).float() for q in range(w)]
        y = xs[r].clone()
        C.all_reduce(y, algorithm="native")
        close(f"native all_reduce repeat {seed}", y, sum(x.double() for x in xs))
        out = torch.full((6,), float("nan"), device=dev)
        C.reduce_scatter_tensor(out, xs[r], algorithm="native")
        close(f"native reduce_scatter repeat {seed}", out, sum(x.double() for x in xs).split(6)[r])
        full = torch.full((6 * w * w,), float("nan"), device=dev)
        C.all_gather_single(full, xs[r], algorithm="native")
        close(f"native all_gather repeat {seed}", full, torch.cat(xs))
    ck.count()
    runners = [v[0] for v in comm._fast.values()]
    if len(runners) < 3 or not all(getattr(f, "__qualname__", "").startswith("Native.fast_path") for f in runners):
        ck.fail(f"rank {r} native fast path: comm._fast holds {runners}")
    RECORDER.clear()
    seq = comm.seq
    y = torch.ones(5, device=dev)
    for _ in range(10):
        C.all_reduce(y, algorithm="native")
    ck.count()
    if comm.seq != seq + 10 or len(RECORDER.entries()) != 10:
        ck.fail(f"rank {r} native fast path: seq moved {comm.seq - seq}, {len(RECORDER.entries())} recorded")
    close("native fast path: ten repeats", y, torch.full((5,), float(w) ** 10, device=dev))
    a, b = torch.ones(3, device=dev), torch.full((3,), 2.0, device=dev)
    with dist._coalescing_manager(device=dev):
        C.all_reduce(a, algorithm="native")
        C.all_reduce(b, algorithm="native")
    close("native all_reduce inside a coalescing manager (a)", a, torch.full((3,), float(w), device=dev))
    close("native all_reduce inside a coalescing manager (b)", b, torch.full((3,), 2.0 * w, device=dev))


if __name__ == "__main__":
    raise SystemExit(main())
