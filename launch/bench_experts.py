"""Benchmark one rank's experts: ``python launch/bench_experts.py`` on one CUDA GPU.

``GroupedSwiGLU`` without autograd: its Triton kernels (``overlap/moe/_grouped_gemm.py``) against
torch's GEMMs (``fused=False``, the anchor), side by side in rounds, at the rows one rank of two
receives in the MoE benchmark's configurations (``launch/bench_moe.py``: tokens x top-k), expert
sizes drawn unevenly around the mean, each checked against float64 (``bench/experts.py``); with
``--padded`` also ``forward_padded`` on the low-latency layout, eagerly and under CUDA graphs;
with ``--beside`` the experts' slowdown beside copy-engine copies and beside an SM copy kernel of
8-32 blocks (with and without the experts' grid reduced by as many SMs), and with ``--gather``
the gate/up kernel reading the rows where they landed through a table against ``index_select``
then torch's grouped GEMMs (``bench/experts_beside.py``; prefill configurations).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.experts import (dense_peaks, measure_experts, measure_fp8_experts, measure_padded,  # noqa: E402
                           plot_experts, plot_fp8_experts)
from bench.experts_beside import measure_beside, measure_gather, plot_beside  # noqa: E402
from bench.report import write_csv, write_json  # noqa: E402

# name, rows on one rank of two (tokens x top-k), hidden, expert width, local experts
CONFIGS = [("qwen3-30b-prefill", 8192 * 8, 2048, 768, 16), ("top2-h4096-f512", 16384 * 2, 4096, 512, 16),
           ("top1-h4096-f1024", 16384, 4096, 1024, 8), ("qwen3-prefill", 4096 * 8, 4096, 1536, 16),
           ("dsv3-prefill", 4096 * 8, 7168, 2048, 32), ("dsv3-decode", 128 * 8, 7168, 2048, 32),
           ("qwen3-30b-decode", 128 * 8, 2048, 768, 16)]
# FP8 (--fp8): name, hidden, expert width, local experts (one rank of two), top-k; rows = tokens x
# top-k / 2. GPT-OSS's 2880 is rounded up to 2944 (23 x 128: the FP8 format scales whole blocks).
FP8_MODELS = [("dsv3", 7168, 2048, 128, 8), ("qwen3-30b-a3b", 2048, 768, 64, 8), ("gpt-oss-like", 2944, 2944, 16, 4)]
FP8_TOKENS = {"prefill": [4096, 32768], "decode": [16, 256]}
TOP_K = {"qwen3-30b-prefill": 8, "top2-h4096-f512": 2, "top1-h4096-f1024": 1, "qwen3-prefill": 8, "dsv3-prefill": 8}


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/bench_experts.py", description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--iters", type=int, default=10)
    p.add_argument("-r", "--reps", type=int, default=9)
    p.add_argument("-d", "--dtype", default="bf16",
                   help="comma-separated: bf16, fp16 (fp16's anchor is one GEMM per expert: torch's grouped GEMM "
                        "does not take it)")
    p.add_argument("--padded", action="store_true",
                   help="also time forward_padded on the low-latency layout of the decode configurations")
    p.add_argument("--beside", action="store_true",
                   help="time the experts beside copy-engine and SM-budget copies instead (prefill configurations)")
    p.add_argument("--gather", action="store_true",
                   help="with --beside: also the gate/up kernel reading rows through a table against index_select "
                        "+ torch's grouped GEMMs")
    p.add_argument("--json")
    p.add_argument("--csv")
    p.add_argument("--plot")
    p.add_argument("--fp8", action="store_true",
                   help="our FP8 experts against our bf16 experts, torch's bf16 and rowwise-FP8 grouped GEMMs, at "
                        "DeepSeek-V3-, Qwen3-30B-A3B- and GPT-OSS-like shapes, prefill and decode")
    p.add_argument("--tokens", help="with --fp8: comma-separated token counts (default: 4096,32768 and 16,256)")
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    if args.beside:
        return _beside(args, dev)
    if args.fp8:
        return _fp8(args, dev)
    records = []
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for dt, (name, rows, hidden, ffn, experts) in itertools.product(args.dtype.split(","), CONFIGS):
        rec = measure_experts(name, rows, hidden, ffn, experts, dev, iters=args.iters, reps=args.reps,
                              dtype=dtypes[dt])
        records.append(rec)
        print(f"{rec.config:<18} {rec.dtype:<8} rows {rec.rows:>6} ({rec.counts_min}-{rec.counts_max} per expert) "
              f"h {rec.hidden:>5} f {rec.ffn_hidden:>5} E {rec.experts:>3} | torch {rec.torch_us:8.1f} us | fused "
              f"{rec.fused_us:8.1f} us | paired {rec.fused_over_torch_paired:.3f}x ({rec.fused_path}) | #wrong "
              f"{rec.wrong_fused}/{rec.wrong_torch}", flush=True)
        torch.cuda.empty_cache()
    padded = []
    if args.padded:  # blocks of W x max_tokens rows per local expert, W = 2, 128 tokens per rank
        for name, rows, hidden, ffn, experts in CONFIGS:
            if name.endswith("-decode"):
                rec_p = measure_padded(name, experts, 2 * 128, rows, hidden, ffn, dev, iters=args.iters,
                                       reps=args.reps)
                padded.append(rec_p)
                print(f"{rec_p.config:<18} padded {rec_p.experts} x {rec_p.capacity} rows, {rec_p.rows} counted | "
                      f"every row {rec_p.bmm_us:8.1f} us (graph {rec_p.bmm_graph_us:8.1f}) | counted rows "
                      f"{rec_p.fused_us:8.1f} us (graph {rec_p.fused_graph_us:8.1f}) | graph paired "
                      f"{rec_p.fused_over_bmm_graph_paired:.3f}x | #wrong {rec_p.wrong_fused}/{rec_p.wrong_bmm}",
                      flush=True)
    import triton

    meta = {"command": " ".join(["launch/bench_experts.py", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(dev)}
    if args.json:
        write_json([*records, *padded], args.json, meta)  # type: ignore[arg-type]
    if args.csv:
        write_csv(records, args.csv)  # type: ignore[arg-type]
        if padded:
            write_csv(padded, args.csv.removesuffix(".csv") + "_padded.csv")  # type: ignore[arg-type]
    if args.plot:
        plot_experts(records, args.plot, f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}")
    bad = any(r.wrong_fused or r.wrong_torch for r in records) or any(r.wrong_fused or r.wrong_bmm for r in padded)
    return 1 if bad else 0


def _meta(dev: torch.device) -> dict[str, str]:
    import triton

    return {"command": " ".join(["launch/bench_experts.py", *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(dev)}


def _fp8(args: argparse.Namespace, dev: torch.device) -> int:
    peaks = dense_peaks(dev)
    print(f"dense peaks measured: bf16 {peaks[0]:.0f} TFLOP/s, e4m3 {peaks[1]:.0f} TFLOP/s", flush=True)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else [*FP8_TOKENS["decode"], *FP8_TOKENS["prefill"]]
    records = []
    for (name, hidden, ffn, experts, k), t in itertools.product(FP8_MODELS, tokens):
        rows = max(1, t * k // 2)
        r = measure_fp8_experts(f"{name}-{t}tok", rows, hidden, ffn, experts, dev, iters=args.iters, reps=args.reps,
                                peaks=peaks)
        records.append(r)
        print(f"{r.config:<24} rows {r.rows:>6} | fp8 {r.fp8_us:9.1f} us {r.fp8_tflops:6.0f} TF "
              f"({r.fp8_tflops / r.fp8_peak_tflops:.0%} of FP8 peak) | bf16 {r.bf16_us:9.1f} us "
              f"{r.bf16_tflops:6.0f} TF ({r.bf16_tflops / r.bf16_peak_tflops:.0%}) | torch bf16 {r.torch_bf16_us:9.1f} | "
              f"torch fp8 {r.torch_fp8_us:9.1f} | fp8/bf16 {r.fp8_over_bf16_paired:.3f}x, fp8/torch fp8 "
              f"{r.fp8_over_torch_fp8_paired:.3f}x paired | rel err {r.fp8_rel_error:.4f} | #wrong {r.wrong_fp8}",
              flush=True)
        torch.cuda.empty_cache()
    meta = _meta(dev)
    if args.json:
        write_json(records, args.json, meta)  # type: ignore[arg-type]
    if args.plot:
        plot_fp8_experts(records, args.plot, f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}")
    return 1 if any(r.wrong_fp8 for r in records) else 0


def _beside(args: argparse.Namespace, dev: torch.device) -> int:
    beside, gather = [], []
    for name, rows, hidden, ffn, experts in CONFIGS:
        if name not in TOP_K:
            continue
        for r in measure_beside(name, rows, hidden, ffn, experts, dev, reps=args.reps):
            beside.append(r)
            print(f"{r.config:<18} {r.transfer:<16} experts {r.experts_us:8.1f} us, beside {r.experts_beside_us:8.1f} "
                  f"us ({r.slowdown:.3f}x paired) | copies {r.copy_GBps:7.1f} GB/s alone, {r.copy_beside_GBps:7.1f} "
                  f"beside ({r.copy_slowdown:.3f}x)", flush=True)
        if args.gather:
            g = measure_gather(name, rows, hidden, ffn, experts, dev, tokens=2 * rows // TOP_K[name],
                               iters=args.iters, reps=args.reps)
            gather.append(g)
            print(f"{g.config:<18} gate/up of {g.rows} rows from {g.tokens} tokens | index_select + torch "
                  f"{g.gather_torch_us:8.1f} us | index_select + fused {g.gather_fused_us:8.1f} us | fused through "
                  f"the index {g.fused_index_us:8.1f} us ({g.index_over_torch_paired:.3f}x torch's, "
                  f"{g.index_over_gather_fused_paired:.3f}x gathered, paired) | #wrong {g.wrong_index}/{g.wrong_torch}",
                  flush=True)
        torch.cuda.empty_cache()
    meta = _meta(dev)
    if args.json:
        write_json([*beside, *gather], args.json, meta)  # type: ignore[arg-type]
    if args.plot:
        plot_beside(beside, gather, args.plot, f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}")
    return 1 if any(g.wrong_index or g.wrong_torch for g in gather) else 0


if __name__ == "__main__":
    raise SystemExit(main())
