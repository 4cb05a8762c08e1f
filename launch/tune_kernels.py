"""Search the Triton kernels' launch configurations on one GPU: ``python launch/tune_kernels.py --out FILE``.

For each kernel in ``overlap._kernel_tuning.CANDIDATES`` (the FP8 experts' gate/up and down
grouped GEMMs, and the bf16 ones of ``overlap/moe/_grouped_gemm.py``) and each shape of the FP8 benchmark's models (``launch/bench_experts.py --fp8``)
at each token count, every candidate configuration is timed against the kernel's default in
the same rounds; the fastest is written as that shape class's entry when it beat the default by
``--margin`` (paired median), else the default is written, so the table says it was measured.
``COMMOPS_KERNELS_TUNED=FILE`` (or ``overlap._kernel_tuning.set_kernel_table``) makes the kernels
follow it; nothing is searched at import or at a call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.experts import timed_us, uneven_counts  # noqa: E402
from launch.bench_experts import FP8_MODELS  # noqa: E402
from overlap import _kernel_tuning as T  # noqa: E402
from overlap.moe import _fp8_gemm as G  # noqa: E402
from overlap.moe import _grouped_gemm as B  # noqa: E402
from overlap.moe.fp8 import quantize_rows  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/tune_kernels.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the kernel table to write (JSON)")
    p.add_argument("--tokens", default="16,256,4096,32768")
    p.add_argument("--models", default=",".join(m[0] for m in FP8_MODELS))
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("-r", "--reps", type=int, default=5)
    p.add_argument("--margin", type=float, default=1.03, help="how much faster than the default a winner must be")
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    name = torch.cuda.get_device_name(dev)
    entries = []
    for model, hidden, ffn, experts, k in [m for m in FP8_MODELS if m[0] in args.models.split(",")]:
        g = torch.Generator(device=dev).manual_seed(0)
        w = {n: (torch.randn(experts, a, b, generator=g, device=dev, dtype=torch.bfloat16) * a ** -0.5)
             for n, (a, b) in {"w1": (hidden, ffn), "w3": (hidden, ffn), "w2": (ffn, hidden)}.items()}
        q = {n: G.quantize_weight(v) for n, v in w.items()}
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows = max(1, tokens * k // 2)
            counts = uneven_counts(rows, experts, 0)
            ends = torch.tensor(counts, device=dev).cumsum(0).to(torch.int32)
            xq, xs = G.split_rows(quantize_rows(torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)), hidden)
            hq, hs = G.grouped_swiglu_fp8(xq, xs, q["w1"], q["w3"], ends, config=G._SWIGLU)
            xb = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
            hb = torch.randn(rows, ffn, device=dev, dtype=torch.bfloat16)
            kernels = {"fp8_swiglu": (G._SWIGLU, q["w1"], lambda c: G.grouped_swiglu_fp8(xq, xs, q["w1"], q["w3"], ends,
                                                                                         config=c)),
                       "fp8_mm": (G._PLAIN, q["w2"], lambda c: G.grouped_mm_fp8(hq, hs, q["w2"], ends, torch.bfloat16,
                                                                              config=c)),
                       "gmm_swiglu": (B._FUSED, w["w1"], lambda c: B.grouped_swiglu(xb, w["w1"], w["w3"], ends,
                                                                                    config=c)),
                       "gmm": (B._PLAIN, w["w2"], lambda c: B.grouped_mm(hb, w["w2"], ends, config=c))}
            for kernel, (default, wq, run) in kernels.items():
                cands = [default, *(c for c in T.CANDIDATES[kernel] if c != default)]
                for c in cands:  # compile and warm each
                    run(c)
                torch.cuda.synchronize(dev)
                per: dict[tuple[int, ...], list[float]] = {c: [] for c in cands}
                for rep in range(args.reps):
                    for c in (cands if rep % 2 else cands[::-1]):
                        per[c].append(timed_us(lambda c=c: run(c), args.iters))
                ratio = {c: statistics.median(a / b for a, b in zip(per[c], per[default], strict=True)) for c in cands}
                best = min(cands, key=lambda c: ratio[c])
                chosen = best if ratio[best] * args.margin <= 1.0 else default
                if kernel.startswith("fp8"):
                    (E, N, K), dtype = wq.q.shape, "e4m3"
                else:
                    (E, K, N), dtype = wq.shape, "bfloat16"
                entries.append({"kernel": kernel, "device": name, "dtype": dtype, "N": N, "K": K, "experts": E,
                                "rows_class": T.rows_class(rows, E), "rows": rows, "model": model, "tokens": tokens,
                                "config": list(chosen), "us": statistics.median(per[chosen]),
                                "default_us": statistics.median(per[default]),
                                "tried": {str(list(c)): round(statistics.median(per[c]), 2) for c in cands}})
                print(f"{kernel:<11} {model:<14} {tokens:>6} tok ({rows} rows): default {list(default)} "
                      f"{statistics.median(per[default]):9.1f} us, best {list(best)} {statistics.median(per[best]):9.1f} "
                      f"us ({ratio[best]:.3f}x) -> {list(chosen)}", flush=True)
        torch.cuda.empty_cache()
    import triton

    meta = {"command": " ".join(["launch/tune_kernels.py", *sys.argv[1:]]), "device": name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__, "margin": args.margin}
    Path(args.out).write_text(json.dumps({"meta": meta, "entries": entries}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
