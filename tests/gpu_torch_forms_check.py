"""torch.distributed's list forms and complex tensors over NCCL, beside torch's own calls:
``torchrun --nproc-per-node N tests/gpu_torch_forms_check.py [--json PATH]`` (one rank per GPU;
world 1 on one GPU), run by ``tests/test_gpu_torch_forms.py``.

Every rank draws its data from ``(seed, rank)``, so it knows what the others sent; outputs start
as NaN. Each form is checked against that reference and against torch.distributed's call on the
same inputs; uneven all-to-all sizes (which NCCL takes) and the root's own tensor inside its
gather list are included. Prints one line per failure and a summary; exits non-zero on any.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from tests._checks import Checks, report  # noqa: E402

FAMILIES = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter", "complex")


def families() -> tuple[str, ...]:
    return FAMILIES


def _data(seed: int, who: int, n: int, dev: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + who)
    base = torch.complex128 if dtype.is_complex else torch.float64
    return torch.randn(n, dtype=base, generator=g).to(dtype).to(dev)


def _same(ck: Checks, what: str, got: torch.Tensor, want: torch.Tensor, atol: float = 0.0) -> None:
    ck.count()
    if got.shape != want.shape or not torch.allclose(got, want, rtol=0, atol=atol):
        ck.fail(f"{what}: {got.flatten()[:6].tolist()} vs {want.flatten()[:6].tolist()}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    comm = C.init()
    # (on a machine without GPUs it runs over Gloo, as a check of the script: Gloo's own
    # all_to_all takes equal sizes only, so there torch's is not compared)
    nccl = comm.backend_for("cuda") is not None
    dev = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    r, w = comm.rank, comm.size
    ck = Checks(FAMILIES, r)
    nan = lambda n, dt=torch.float32: torch.full((n,), float("nan"), dtype=dt, device=dev)  # noqa: E731
    for seed in range(1, 4):
        with ck.family("all_gather"):
            x = _data(seed, r, 1000, dev)
            for kind in ("separate", "chunks"):
                out = [nan(1000) for _ in range(w)] if kind == "separate" else list(nan(1000 * w).chunk(w))
                C.all_gather(out, x)
                theirs = [torch.empty(1000, device=dev) for _ in range(w)]
                dist.all_gather(theirs, x)
                for q in range(w):
                    _same(ck, f"all_gather {kind}[{q}]", out[q], _data(seed, q, 1000, dev))
                    _same(ck, f"all_gather {kind}[{q}] vs torch", out[q], theirs[q])
        with ck.family("reduce_scatter"):
            ins = [_data(seed, r * w + q, 500, dev, torch.float64) for q in range(w)]
            out = nan(500, torch.float64)
            work = C.reduce_scatter(out, ins, async_op=True)
            work.wait()
            theirs = torch.empty(500, dtype=torch.float64, device=dev)
            dist.reduce_scatter(theirs, [t.clone() for t in ins])
            want = sum(_data(seed, q * w + r, 500, dev, torch.float64) for q in range(w))
            _same(ck, "reduce_scatter", out, want, 1e-12)
            _same(ck, "reduce_scatter vs torch", out, theirs, 1e-12)
        with ck.family("all_to_all"):
            size = lambda src, dst: 17 * (src + 1) + dst  # noqa: E731 - uneven, as NCCL takes
            ins = [_data(seed, r * w + q, size(r, q), dev) for q in range(w)]
            out = [nan(size(q, r)) for q in range(w)]
            C.all_to_all(out, ins)
            theirs = [torch.empty(size(q, r), device=dev) for q in range(w)]
            if nccl:
                dist.all_to_all(theirs, ins)
            for q in range(w):
                _same(ck, f"all_to_all[{q}]", out[q], _data(seed, q * w + r, size(q, r), dev))
                if nccl:
                    _same(ck, f"all_to_all[{q}] vs torch", out[q], theirs[q])
        root = (seed - 1) % w
        with ck.family("gather"):
            x = _data(seed, r, 300, dev)
            gl = [nan(300) for _ in range(w)] if r == root else None
            if r == root:
                gl[root] = x  # the root's own tensor in its list
            C.gather(x, gl, group_dst=root)
            theirs = [torch.empty(300, device=dev) for _ in range(w)] if r == root else None
            dist.gather(x, theirs, group_dst=root)
            ck.count()
            if r == root:
                for q in range(w):
                    _same(ck, f"gather[{q}]", gl[q], _data(seed, q, 300, dev))
                    _same(ck, f"gather[{q}] vs torch", gl[q], theirs[q])
        with ck.family("scatter"):
            sl = [_data(seed, q, 200, dev) for q in range(w)] if r == root else None
            got = nan(200)
            C.scatter(got, sl, src=root)
            theirs = torch.empty(200, device=dev)
            dist.scatter(theirs, sl, src=root)
            _same(ck, "scatter", got, _data(seed, r, 200, dev))
            _same(ck, "scatter vs torch", got, theirs)
        with ck.family("complex"):
            z = _data(seed, r, 256, dev, torch.complex64)
            theirs = z.clone()
            C.all_reduce(z)
            C.all_reduce(z)  # a repeat: the fast path must not take the complex tensor as real
            dist.all_reduce(theirs)
            dist.all_reduce(theirs)
            want = w * sum(_data(seed, q, 256, dev, torch.complex128) for q in range(w))
            _same(ck, "complex all_reduce", z.to(torch.complex128), want, 1e-4)
            _same(ck, "complex all_reduce vs torch", z, theirs, 1e-5)
            ck.count()
            try:
                C.all_reduce(z.clone(), op=dist.ReduceOp.MAX)
                ck.fail("complex all_reduce MAX did not raise")
            except ValueError as exc:  # torch raises a ValueError for it
                if "does not support" not in str(exc):
                    ck.fail(f"complex all_reduce MAX: {exc}")
    failed = report(ck, args.json, f"torch forms ({comm.backend})", w)
    C.destroy()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
