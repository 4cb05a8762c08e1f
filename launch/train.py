"""Train a Hugging Face causal LM parallelized by ``overlap.parallelize``, on synthetic data.

    torchrun --nproc-per-node 2 launch/train.py                          # a small Llama, TP=2, Gloo or NCCL
    torchrun --nproc-per-node 2 launch/train.py --model qwen3_moe --tp 1 --ep 2
    torchrun --nproc-per-node 4 launch/train.py --model mixtral --tp 2 --ep 2 --steps 200
    torchrun --nproc-per-node 2 launch/train.py --model /path/to/checkpoint --dtype bfloat16
    torchrun --nproc-per-node 2 launch/train.py --model gpt_oss --tp 1 --ep 2     # any family with a plan

``--model`` is a family name (a small model of that family from random weights: no download; one
of ``SMALL``, or any other model type of the installed transformers whose config has a parallel
plan, built tiny by ``bench/model_zoo.py``'s rules) or a local checkpoint directory (``AutoModelForCausalLM.from_pretrained``, every rank loading the same).
The ranks form a grid of ``--tp`` x ``--ep`` (their product the world size): tensor parallelism
over consecutive ranks, expert parallelism across them; every rank sees the same batches. The data
counts up by 1 or 2 from a random token (its first two tokens say which), so the loss falls from
about ln(vocab) as the model learns the next token. Prints a progress bar, then the loss and tokens/s every
``--log-every`` steps; rank 0 writes ``--json`` (the losses, tokens/s and the run's settings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import collectives as C  # noqa: E402
from overlap import parallelize  # noqa: E402

SMALL = {  # a small model per family, its sizes divisible by TP and EP up to 4
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=4, head_dim=64)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_key_value_heads=4, head_dim=64, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=256, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=4, num_local_experts=8,
                                                           num_experts_per_tok=2)),
}


def build_model(name: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    try:
        import transformers  # deferred: the models extra, needed by this program only
    except ModuleNotFoundError as exc:
        raise SystemExit(f"launch/train.py needs transformers ({exc}): install the models extra, "
                         "python3 -m pip install -e '.[models]'") from None

    if os.path.isdir(name):
        return transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    if name not in SMALL:
        from bench.model_zoo import families, tiny_model

        if name not in families():
            raise SystemExit(f"--model {name!r}: not a directory, nor one of {', '.join(SMALL)}, nor a model type "
                             f"with a parallel plan in transformers {transformers.__version__}")
        return tiny_model(name).to(dtype=dtype, device=device)
    config_name, model_name, extra = SMALL[name]
    cfg = getattr(transformers, config_name)(vocab_size=512, hidden_size=256, intermediate_size=512,
                                             num_hidden_layers=4, num_attention_heads=4,
                                             max_position_embeddings=1024, tie_word_embeddings=False, **extra)
    torch.manual_seed(0)  # the same weights on every rank
    return getattr(transformers, model_name)(cfg).to(dtype=dtype, device=device)


def groups(tp: int, ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """This rank's tensor-parallel group (consecutive ranks) and expert-parallel group (across them)."""
    world = dist.get_world_size()
    if tp * ep != world:
        raise SystemExit(f"--tp {tp} x --ep {ep} = {tp * ep}, but the world has {world} ranks: make them equal")
    tp_group = dist.new_subgroups(tp)[0]
    if ep == 1:
        return tp_group, None
    return tp_group, dist.new_subgroups_by_enumeration([list(range(q, world, tp)) for q in range(tp)])[0]


def batches(vocab: int, batch: int, seq: int, seed: int, device: torch.device):  # noqa: ANN201
    """Synthetic batches, the same on every rank: each row counts up by 1 or 2 (its first two tokens
    say which) from a random token, modulo the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.arange(seq)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        stride = torch.randint(1, 3, (batch, 1), generator=g)
        yield ((start + stride * steps) % vocab).to(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama", help=f"one of {', '.join(SMALL)}, or a local checkpoint directory")
    p.add_argument("--tp", type=int, default=0, help="tensor-parallel size (default: the world size / --ep)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE families)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--strategy", default="auto", help="the overlap operators' strategy")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (--seq a multiple of --tp)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="rank 0 writes the losses and tokens/s here")
    p.add_argument("--backend", default=None, help="force a backend (default: nccl on GPUs, else gloo)")
    args = p.parse_args()
    comm = C.init(backend=args.backend)
    cuda = comm.backend_for("cuda") is not None and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tp = args.tp or comm.size // args.ep
    tp_group, ep_group = groups(tp, args.ep)
    dtype = getattr(torch, args.dtype)
    model = parallelize(build_model(args.model, dtype, device), tp_group=tp_group, ep_group=ep_group,
                        strategy=args.strategy, sequence_parallel=args.sp)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    lead = comm.rank == 0
    from tqdm import tqdm  # deferred: comes with transformers (the models extra)

    bar = tqdm(total=args.steps, disable=not lead, desc=f"{args.model} tp={tp} ep={args.ep} {comm.backend}")
    data = batches(model.config.vocab_size, args.batch, args.seq, args.seed, device)
    losses: list[float] = []
    rates: list[float] = []
    t_log, tokens = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        ids = next(data)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())  # the host waits for the step: the time below is whole steps
        tokens += ids.numel()
        bar.update(1)
        if step % args.log_every == 0 or step == args.steps:
            rate = tokens / (time.perf_counter() - t_log)
            rates.append(rate)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}")
            if lead:
                tqdm.write(f"step {step:5d}  loss {losses[-1]:.4f}  tokens/s {rate:,.0f}")
            t_log, tokens = time.perf_counter(), 0
    bar.close()
    if lead:
        first, last = sum(losses[:5]) / len(losses[:5]), sum(losses[-5:]) / len(losses[-5:])
        print(f"# loss: first 5 steps {first:.4f}, last 5 steps {last:.4f}; tokens/s (last) {rates[-1]:,.0f}",
              flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({
                "model": args.model, "tp": tp, "ep": args.ep, "world": comm.size, "backend": comm.backend,
                "device": str(device), "dtype": args.dtype, "batch": args.batch, "seq": args.seq,
                "steps": args.steps, "losses": losses, "tokens_per_s": rates, "torch": torch.__version__,
                "parallel": getattr(model, "commops_parallel", None)}, indent=1))
    C.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
