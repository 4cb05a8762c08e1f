"""The operators over peer memory under torch.compile and CUDA graphs, on the GPUs of one node
with ranks that may share them (run by ``tests/test_gpu_compile.py``):
``torchrun --nproc-per-node N tests/gpu_compile_peer_check.py [--json F] [--time F]``.

Where ranks share a GPU (more ranks than GPUs) the group's own traffic is Gloo's
(``tests._checks.shared_gpu_ranks``) and every exchange below goes through peer memory, which maps
a buffer of the same GPU as it maps a peer GPU's. Families (float32 against float64 references
built from every rank's data; the operators compiled also against eager, bit for bit):

- ``peer/overlap``: ``gemm_all_reduce``, ``gemm_reduce_scatter`` and ``all_gather_gemm`` with
  ``strategy="copy_engine"`` (1 and 3 chunks), compiled with ``fullgraph=True`` (Inductor, one
  graph, the ``commops`` op in it); the copy-engine strategy is the one that ran.
- ``peer/tp_mlp``: the two-layer tensor-parallel MLP over the copy-engine strategy, with and
  without sequence parallelism, compiled, forward and backward (``gpu_compile_check.mlp_checks``).
- ``peer/moe_layer``: ``MoELayer(transport="peer")`` eager and compiled (its ``moe_layer`` op in
  the graph), gradients against the float64 single-process layer, a rank without tokens too.
- ``reduce_overhead/peer_tp_mlp``: the MLP compiled with ``mode="reduce-overhead"`` (CUDA graphs),
  its forward replayed with fresh inputs, and no graph skipped.

``--time F``: forward and backward in bf16 of the MLP (sequence parallel, copy-engine strategy:
eager, compiled and ``reduce-overhead``) and of ``MoELayer(transport="peer")`` (eager and
compiled), timed paired by round, written to F. Where ranks share a
GPU the times hold the ranks' contention for it, not a link's: the ratios say what compiling
costs or saves on the host and in launches, nothing about the overlap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from overlap import ops  # noqa: E402
from overlap.layers import ColumnParallelLinear, MoELayer, RowParallelLinear  # noqa: E402
from tests._checks import Checks, report, shared_gpu_ranks  # noqa: E402
from tests._compiled import compile_checked  # noqa: E402
from tests.gpu_compile_check import Close, _data, closer, guarder, mlp_checks  # noqa: E402
from tests.test_overlap_moe import _layer_case  # noqa: E402

FAMILIES = ("peer/overlap", "peer/tp_mlp", "peer/moe_layer", "reduce_overhead/peer_tp_mlp")
STRATEGY = "copy_engine"
MOE_TOL = 1e-4  # float32 layer, sums of a few dozen terms of size ~1, against float64


def families() -> tuple[str, ...]:
    return FAMILIES


def overlap_checks(ck: Checks, close: Close, w: int, r: int, dev: torch.device) -> None:
    """Each operator over the copy engines, eager and compiled, against float64 and each other."""
    cases = ((ops.gemm_all_reduce, lambda a, b: sum(aq @ bq for aq, bq in zip(a, b))),
             (ops.gemm_reduce_scatter, lambda a, b: sum(aq @ bq for aq, bq in zip(a, b)).chunk(w, 0)[r]),
             (ops.all_gather_gemm, lambda a, b: torch.cat(a) @ b[r]))
    for chunks in (1, 3):
        for op, reference in cases:
            name = op.__name__
            a = [_data(q, 80 + chunks, (6, 5, 40), dev) for q in range(w)]  # 6 rows: whole shards at 2 and 3 ranks
            b = [_data(q, 90 + chunks, (40, 24), dev) for q in range(w)]
            want = reference(a, b)
            eager = op(a[r].float(), b[r].float(), strategy=STRATEGY, chunks=chunks)
            ck.count()
            choice = ops.last_choice()
            if choice is None or choice.strategy != STRATEGY:
                ck.fail(f"rank {r} {name} chunks {chunks}: ran {choice}, not {STRATEGY}")
            fn, traced = compile_checked(op, "inductor", a[r].float(), b[r].float(), strategy=STRATEGY, chunks=chunks)
            ck.count()
            if f"commops.{name}" not in traced:
                ck.fail(f"rank {r} {name}: the compiled graph holds {sorted(traced)}, not commops.{name}")
            got = fn(a[r].float(), b[r].float(), strategy=STRATEGY, chunks=chunks)
            close(f"eager {name} chunks {chunks}", eager, want)
            close(f"compiled {name} chunks {chunks}", got, want)
            ck.count()
            if not torch.equal(got, eager):  # the op runs the same kernels inside the graph
                ck.fail(f"rank {r} compiled {name} chunks {chunks}: differs from eager by "
                        f"{(got - eager).abs().max().item():.3g}")


def moe_checks(ck: Checks, r: int, w: int, dev: torch.device) -> None:
    """``MoELayer`` over the peer transport, float32, eager and compiled, against float64."""
    for tokens in ([9 + 2 * q for q in range(w)], [0] + [5] * (w - 1)):
        for backend in (None, "inductor"):
            ck.count()
            err = _layer_case(r, w, tokens, None, "auto", backend, dev.type, torch.float32, transport="peer",
                              max_tokens=32)
            if not err < MOE_TOL:
                ck.fail(f"rank {r} MoELayer(transport='peer') {backend or 'eager'}, tokens {tokens}: max error "
                        f"{err:.3g} against the float64 single-process layer")


def _timed(variants: dict[str, Any], x: torch.Tensor, rounds: int, steps: int) -> dict[str, Any]:
    """Forward and backward of each of ``variants`` (name -> function of ``x``; "eager" first),
    ``steps`` steps per variant per round, the variants in turn within each round: the median step
    time of each and its median ratio to eager's in the same round. (Not
    ``bench.harness.time_interleaved``: it lines the ranks up with a collective on the GPU, which
    ranks sharing one cannot make; these line up over Gloo.)"""
    def run(fn: Any) -> None:
        for _ in range(steps):
            fn(x).float().sum().backward()

    for fn in variants.values():  # compiles and captures before timing
        for _ in range(3):
            run(fn)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            torch.distributed.all_reduce(torch.zeros(1))  # every rank starts the variant together (Gloo)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(fn)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / steps)
    return {"rounds": rounds, "steps_per_round": steps,
            "median_step_ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
            "median_paired_ratio": {f"{name}/eager": statistics.median(t / e for t, e in zip(times[name], times["eager"]))
                                    for name, t in times.items() if name != "eager"}}


def _time_mlp(w: int, dev: torch.device, rounds: int, steps: int) -> dict[str, Any]:
    """The bf16 sequence-parallel MLP over the copy engines: eager, compiled and reduce-overhead."""
    tokens, hidden = 2048, 2048
    ffn = 4 * hidden // w * w  # whole shards at any world size
    torch.manual_seed(7)
    fc1 = ColumnParallelLinear.from_linear(torch.nn.Linear(hidden, ffn, bias=False, dtype=torch.bfloat16, device=dev),
                                           sequence_parallel=True, strategy=STRATEGY)
    fc2 = RowParallelLinear.from_linear(torch.nn.Linear(ffn, hidden, bias=False, dtype=torch.bfloat16, device=dev),
                                        sequence_parallel=True, strategy=STRATEGY)

    def step(x: torch.Tensor) -> torch.Tensor:
        return fc2(torch.nn.functional.gelu(fc1(x)))

    x = torch.randn(tokens // w, hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
    variants = {"eager": step, "compiled": torch.compile(step, fullgraph=True),
                "reduce_overhead": torch.compile(step, fullgraph=True, mode="reduce-overhead")}
    return {"shape": {"tokens": tokens, "hidden": hidden, "ffn": ffn, "dtype": "bf16", "sequence_parallel": True,
                      "strategy": STRATEGY}, **_timed(variants, x, rounds, steps)}


def _time_moe(w: int, dev: torch.device, rounds: int, steps: int) -> dict[str, Any]:
    """``MoELayer(transport="peer")`` in bf16, top-2 of 8 experts per rank: eager and compiled."""
    tokens, hidden, ffn, experts, k = 2048, 1024, 512, 8 * w, 2
    torch.manual_seed(11)
    # built on the host, then moved: its router's broadcast goes over the group's Gloo
    layer = MoELayer(hidden, ffn, experts, k, dtype=torch.bfloat16, transport="peer", max_tokens=tokens).to(dev)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device=dev, requires_grad=True)
    variants = {"eager": layer, "compiled": torch.compile(layer, fullgraph=True)}
    out = {"shape": {"tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": experts, "top_k": k, "dtype": "bf16",
                     "transport": "peer"}, **_timed(variants, x, rounds, steps)}
    layer.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", help="write the results by family here (tests/_checks.py)")
    p.add_argument("--time", help="time the compiled steps beside the eager ones; write the figures here")
    args = p.parse_args()
    comm, dev = shared_gpu_ranks()
    w, r = comm.size, comm.rank
    shared = torch.cuda.device_count() < w
    ck = Checks(FAMILIES, r)
    close, guarded = closer(ck, r), guarder(ck, r)

    from torch._dynamo.utils import counters

    with ck.family("peer/overlap"):
        guarded("compiled copy-engine operators", lambda: overlap_checks(ck, close, w, r, dev))
    with ck.family("peer/tp_mlp"):
        guarded("compiled copy-engine tp mlp", lambda: mlp_checks(close, w, r, dev, None, STRATEGY))
    with ck.family("peer/moe_layer"):
        guarded("MoELayer over the peer transport", lambda: moe_checks(ck, r, w, dev))
    with ck.family("reduce_overhead/peer_tp_mlp"):
        counters.clear()
        guarded("reduce-overhead copy-engine tp mlp", lambda: mlp_checks(close, w, r, dev, "reduce-overhead", STRATEGY))
        ck.count()
        if counters["inductor"].get("cudagraph_skips", 0):
            ck.fail(f"rank {r} reduce-overhead tp mlp: cudagraph skipped: {dict(counters['inductor'])}")
    failed = report(ck, args.json, f"compile over peer memory{' (ranks sharing GPUs)' if shared else ''}", w)
    if args.time and not failed:
        figures = {"tp_mlp": _time_mlp(w, dev, rounds=10, steps=5), "moe_layer": _time_moe(w, dev, rounds=10, steps=5)}
        if r == 0:
            figures.update(world=w, gpus=torch.cuda.device_count(), ranks_share_gpus=shared,
                           torch=torch.__version__, device=torch.cuda.get_device_name(dev))
            Path(args.time).write_text(json.dumps(figures, indent=2) + "\n")
            print(json.dumps(figures), flush=True)
    torch._dynamo.reset()  # reduce-overhead's graphs hold the peer buffers' kernels
    torch.cuda.synchronize()
    C.destroy()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
