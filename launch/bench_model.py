"""Time a Hugging Face model's training, prefill and decode steps, parallelized by commops and by transformers.

    torchrun --nproc-per-node 2 launch/bench_model.py                      # llama and qwen3_moe
    torchrun --nproc-per-node 2 launch/bench_model.py --families llama --batch 8 --seq 1024
    torchrun --nproc-per-node 2 launch/bench_model.py --families llama --preset llama=llama3-8b-4l
    torchrun --nproc-per-node 2 launch/bench_model.py --preset tiny --backend gloo   # on CPUs
    torchrun --nproc-per-node 1 launch/bench_model.py --model deepseek_v3,gpt_oss,qwen2  # any family with a plan

The same checkpoint three ways on the same ranks and data (``bench/model_step.py`` says how):
``ours/auto``, ``ours/sequential`` (and the plain NCCL transport for MoE rows) and transformers'
own tensor or expert parallelism; each variant's logits checked against the unsharded float32
model first (``#wrong``), then its forward + backward step, its prefill at each prompt length and
its decode step at each batch timed side by side, eagerly and (train and decode, on CUDA)
replayed from CUDA graphs; then, in the bench dtype, each variant's greedy tokens and the losses
of a short AdamW run against transformers' (``bench/model_agree.py``). ``--profile DIR`` keeps a
profile of one eager call of each. Rank 0 prints a table and writes ``results.json`` (records
and agreement), ``results.csv`` and ``plot.png`` into ``--out`` (default
``commops-results/model-<date>-<time>/``; ``--out none`` for none).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import difflib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import collectives as C  # noqa: E402
from bench.cli import DTYPES  # noqa: E402
from bench.model_step import FAMILY_PRESETS, PRESETS, VARIANTS, measure_model, plot_steps  # noqa: E402
from bench.report import run_meta  # noqa: E402


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _presets(text: str | None, families: list[str], default: str) -> dict[str, str]:
    """``--preset``: one preset for every family, or ``family=preset`` pairs (the rest ``default``)."""
    if text is None or "=" not in text:
        return dict.fromkeys(families, text or default)
    chosen = dict.fromkeys(families, default)
    for pair in text.split(","):
        family, _, name = pair.partition("=")
        chosen[family.strip()] = name.strip()
    return chosen


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/bench_model.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--families", "--model", default="llama,qwen3_moe",
                   help="comma-separated model types: the hand families (llama, qwen3, qwen3_moe, mixtral) or any "
                        "causal-LM type of the installed transformers with a tensor-parallel plan (qwen2, gpt_oss, "
                        "deepseek_v3, ...), sized by the preset through bench/model_zoo.py's rules")
    p.add_argument("--preset", default=None,
                   help=f"model sizes, one of {', '.join(PRESETS)}, or family=preset pairs, comma-separated "
                        "(default gpu on GPUs, else tiny)")
    p.add_argument("--batch", type=int, default=None, help="training batch (default 4 on GPUs, 2 on CPUs)")
    p.add_argument("--seq", type=int, default=None, help="training sequence (default 1024 on GPUs, 32 on CPUs)")
    p.add_argument("--decode-batch", default=None, help="decode batches, comma-separated (default 1,16,64 on GPUs, 2 on CPUs)")
    p.add_argument("--decode-seq", type=int, default=None, help="tokens in the KV cache (default 1024 / 32)")
    p.add_argument("--prefill", default=None,
                   help="prefill prompt lengths, comma-separated; '' for none (default 2048,8192,16384 on GPUs, 48 on CPUs)")
    p.add_argument("--prefill-batch", type=int, default=1, help="prompts per prefill (default 1)")
    p.add_argument("--agree-tokens", type=int, default=None,
                   help="greedy tokens each variant decodes for the agreement check, 0 for none (default 16 / 4)")
    p.add_argument("--train-steps", type=int, default=None,
                   help="AdamW steps of the loss agreement check, 0 for none (default 20 on GPUs, 3 on CPUs)")
    p.add_argument("--lr", type=float, default=1e-3, help="the loss check's learning rate (default 1e-3)")
    p.add_argument("--loss-rtol", type=float, default=None,
                   help="losses agree within this relative difference (default 2e-2 in bf16/fp16, else 1e-4)")
    p.add_argument("--profile", default=None, help="folder for a profile of one eager call of each variant's steps")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    p.add_argument("--no-graphs", action="store_true", help="eager only (on CPUs it always is)")
    p.add_argument("-d", "--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on GPUs, float on CPUs")
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-r", "--reps", type=int, default=5)
    p.add_argument("--backend", default=None, help="force a backend (default: nccl on GPUs, else gloo)")
    p.add_argument("--out", default=None, help="folder for results.json/csv and plot.png, or 'none'")
    args = p.parse_args()
    families = [f.strip() for f in args.families.split(",")]
    planned = [f for f in families if f not in FAMILY_PRESETS]
    if planned:
        try:
            from bench.model_zoo import families as zoo
        except ImportError as e:
            p.error(f"--families {','.join(planned)}: needs transformers (pip install -e '.[models]'): {e}")
        known = {k for k, v in zoo().items() if v.get("tp")}
        for f in planned:
            if f not in known:
                near = difflib.get_close_matches(f, sorted(known | set(FAMILY_PRESETS)), n=3)
                p.error(f"--families: {f!r} is neither a hand family ({', '.join(FAMILY_PRESETS)}) nor a causal-LM "
                        "type of this transformers with a tensor-parallel plan"
                        + (f"; did you mean {', '.join(near)}?" if near else ""))
    variants = tuple(v.strip() for v in args.variants.split(","))
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if args.backend == "gloo" and torch.cuda.is_available():  # transformers would take the GPUs regardless
        p.error("--backend gloo on a machine with CUDA GPUs: transformers' own parallelism would load its model "
                "onto them; for a CPU run hide them: CUDA_VISIBLE_DEVICES= torchrun ... --backend gloo")
    cuda_here = torch.cuda.is_available() and args.backend != "gloo"  # the preset's default, before C.init
    presets = _presets(args.preset, families, "gpu" if cuda_here else "tiny")
    for f, name in presets.items():
        if f not in families or name not in PRESETS:
            p.error(f"--preset: {f}={name} is not a family of --families with one of {', '.join(PRESETS)}")
    out = None
    if args.out != "none":
        out = Path(args.out or f"commops-results/model-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    comm = C.init(backend=args.backend)
    cuda = comm.backend_for("cuda") is not None and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    lead = comm.rank == 0
    if lead and out is not None:
        out.mkdir(parents=True, exist_ok=True)  # before the run: a folder that cannot be made fails now
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "float")]
    records, agreement = [], []
    for family in families:
        gpu = presets[family] != "tiny"
        steps, agree = measure_model(
            family, comm, device, dtype, preset=presets[family], batch=args.batch or (4 if gpu else 2),
            seq=args.seq or (1024 if gpu else 32), decode_batches=_ints(args.decode_batch or ("1,16,64" if gpu else "2")),
            decode_seq=args.decode_seq or (1024 if gpu else 32), graphs=cuda and not args.no_graphs,
            prefill_seqs=_ints(args.prefill if args.prefill is not None else ("2048,8192,16384" if gpu else "48")),
            prefill_batch=args.prefill_batch, iters=args.iters, reps=args.reps, variants=variants, check_preset="tiny",
            agree_tokens=args.agree_tokens if args.agree_tokens is not None else (16 if gpu else 4),
            train_steps=args.train_steps if args.train_steps is not None else (20 if gpu else 3), lr=args.lr,
            loss_rtol=args.loss_rtol, profile=args.profile,
            progress=lambda s: print(s, flush=True) if lead else None)
        records += steps
        agreement += agree
        if lead:
            for a in agree:
                print(f"{family:<10} {a.variant:<16} vs {a.anchor}: tokens "
                      f"{'equal' if a.tokens_equal else 'differ' if a.tokens_equal is False else 'not compared'}"
                      + (f" from step {a.first_diff} (anchor's top-2 margin {a.margin_at_diff:.3g})"
                         if a.first_diff is not None else "")
                      + (f"; losses within {a.max_loss_rel_diff:.2e} (rtol {a.loss_rtol:g}: "
                         f"{'agree' if a.losses_agree else 'DIFFER'})" if a.max_loss_rel_diff is not None else "")
                      + (f"; {a.error}" if a.error else ""), flush=True)
    if lead:
        meta = run_meta("launch/bench_model.py", comm, cuda)
        import transformers  # deferred: the models extra

        meta.update(transformers=transformers.__version__, presets=presets,
                    sizes={f: PRESETS[name] for f, name in presets.items()},
                    omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
        checked = {(r.family, r.variant): r.wrong for r in records}  # one check per variant, in 2-4 records
        bad = sum(w or 0 for w in checked.values())
        unchecked = sorted(f"{f}/{v}" for (f, v), w in checked.items() if w is None)
        print(f"# logits off the unsharded fp32 model: {bad}  ({'OK' if bad == 0 and not unchecked else 'FAILED'})"
              + (f"; not checked (did not run): {', '.join(unchecked)}" if unchecked else ""), flush=True)
        if out is not None and records:
            rows = [r.as_dict() for r in records]
            (out / "results.json").write_text(json.dumps({"meta": meta, "records": rows,
                                                          "agreement": [a.as_dict() for a in agreement]}, indent=1) + "\n")
            with open(out / "results.csv", "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
            wrote = ["results.json", "results.csv"]
            try:
                title = (f"{comm.size} x {meta['device']}, {str(dtype).removeprefix('torch.')}, "
                         f"transformers {transformers.__version__}")
                plot_steps(records, str(out / "plot.png"), title)
                wrote.append("plot.png")
            except ImportError as e:
                print(f"# no plot: {e}", flush=True)
            print(f"# wrote {', '.join(f'{out}/{w}' for w in wrote)}", flush=True)
    C.destroy()
    # tokens may part at a near tie in half precision (reported, with the margin); losses may not
    return 1 if any(r.wrong or r.wrong is None for r in records) or any(a.losses_agree is False for a in agreement) \
        else 0


if __name__ == "__main__":
    sys.exit(main())
