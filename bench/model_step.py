"""A Hugging Face model's training, prefill and decode steps, parallelized three ways, side by side.

The same checkpoint (random weights of a named size, saved once by rank 0) is loaded on the same
ranks three ways:

- ``ours/auto``: ``overlap.parallelize(model, strategy="auto")``, the MoE blocks' rows over the
  peer transport where every expert-parallel rank is a GPU of this node, else over NCCL;
- ``ours/sequential``: ``strategy="sequential"`` (each GEMM, then its collective) and the MoE
  blocks over the plain NCCL transport (``all_to_all_single``);
- ``transformers``: ``from_pretrained(..., distributed_config=DistributedConfig(...))``, its own
  tensor parallelism over DTensor for a dense family, its own expert parallelism for a MoE one.

Both of ours take the layout transformers' expert parallelism has in the installed version, so
that the three split the same modules: a dense family is tensor-parallel over all ranks; a MoE
family's experts are expert-parallel over all ranks, and its attention is split too where
transformers splits it (``ep_size``, 5.21 and later) or kept whole on every rank where it does not
(``enable_expert_parallel``, before 5.21). ``layout`` in the records says which.

Each variant is first checked on a small case in float32 against the unsharded model in float32:
``wrong`` counts logits (prefill and one decode step) outside ``1e-4 * max|ref| + 1e-4 * |ref|``,
``max_rel_err`` is the largest difference over the largest magnitude. Then, in the bench dtype:

- ``train``: forward + backward of ``[batch, seq]`` ids with their loss (no optimizer step);
- ``prefill``: a ``[batch, seq]`` prompt written into a static KV cache (``StaticCache``), for each
  prompt length asked for, eagerly;
- ``decode``: one new token per sequence of the batch against a static KV cache holding ``seq``
  tokens (the same position each call, so every call does the same work), for each batch asked for;

train and decode eagerly and, on CUDA, replayed from a CUDA graph, every variant in the same
rounds (``bench.harness.time_interleaved``); ``vs_transformers`` is the median over rounds of
transformers' time over the variant's in that round (above 1: faster than transformers), and
``vs_sequential`` the same against ``ours/sequential``. A variant that cannot run a step (a CUDA
graph capture that fails, say) gets a record with its ``error`` and no time: nothing is left out
without saying why. After the timing, ``bench/model_agree.py`` compares the variants in the bench
dtype: greedy tokens from one prompt, and the losses of a short training run.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import collectives as C
from overlap import parallelize
from overlap.moe import PeerOptions

from .harness import _captured, _slowest, paired_ratio, time_interleaved
from .model_agree import AgreeRecord, compare, greedy_tokens, loss_curve

__all__ = ["StepRecord", "PRESETS", "FAMILY_PRESETS", "small_model", "save_checkpoint", "measure_model", "format_steps", "plot_steps"]

VARIANTS = ("ours/auto", "ours/sequential", "transformers")

_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM")}
_MOE = ("qwen3_moe", "mixtral")
FAMILY_PRESETS = tuple(_CLASSES)  # the hand families; any other family with a plan is sized by model_zoo's rules
# Sizes by preset: "tiny" divides TP and EP up to 4 (CPU tests); "gpu" is about 0.9B parameters
# dense (Llama) and 1.0B MoE (Qwen3-MoE: 32 experts of 768, 4 per token); "llama3-8b-4l" and
# "qwen3-30b-a3b-4l" have the layer shapes and vocabularies of Llama-3-8B and Qwen3-30B-A3B
# (128 experts of 768, 8 per token), with 4 layers instead of 32 and 48.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab=512, hidden=256, ffn=512, layers=2, heads=8, kv=4, head_dim=32, experts=8, top_k=2, moe_ffn=128),
    "gpu": dict(vocab=32000, hidden=2048, ffn=5632, layers=8, heads=16, kv=8, head_dim=128, experts=32, top_k=4,
                moe_ffn=768),
    "llama3-8b-4l": dict(vocab=128256, hidden=4096, ffn=14336, layers=4, heads=32, kv=8, head_dim=128, experts=8,
                         top_k=2, moe_ffn=14336),
    "qwen3-30b-a3b-4l": dict(vocab=151936, hidden=2048, ffn=6144, layers=4, heads=32, kv=4, head_dim=128, experts=128,
                             top_k=8, moe_ffn=768),
}
# Beyond "tiny", what a family of another kind takes besides the preset's sizes, in its config's
# names (each where the config has the field): for MLA (DeepSeek-V2/V3, Kimi) DeepSeek-V3's
# per-head sizes (a rotary part of 64, 128 more for q and k, v of 128) and kv rank (512), a q
# rank of 3/8 of the hidden size; one shared expert; the routed experts in 4 groups of which a
# token's top-k come from 2; the first layer dense; a sliding window of 128 (GPT-OSS's).
_LARGER = dict(qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, qk_head_dim=192, kv_lora_rank=512,
               n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, sliding_window=128)


def _config_sizes(family: str, p: dict[str, int]) -> dict[str, Any]:
    """``PRESETS`` sizes in the names of ``family``'s config."""
    sizes: dict[str, Any] = dict(vocab_size=p["vocab"], hidden_size=p["hidden"], intermediate_size=p["ffn"],
                                 num_hidden_layers=p["layers"], num_attention_heads=p["heads"],
                                 num_key_value_heads=p["kv"], head_dim=p["head_dim"])
    if family == "qwen3_moe":
        sizes.update(num_experts=p["experts"], num_experts_per_tok=p["top_k"], moe_intermediate_size=p["moe_ffn"],
                     norm_topk_prob=True)
    elif family == "mixtral":  # its experts are intermediate_size wide
        sizes.update(num_local_experts=p["experts"], num_experts_per_tok=p["top_k"], intermediate_size=p["moe_ffn"])
    return sizes


def _plan_sizes(family: str, preset: str) -> dict[str, Any]:
    """``PRESETS[preset]`` in the config names of a family that is not a hand one (``model_zoo.tiny_config``
    applies each where the family's config has it)."""
    from transformers import AutoConfig  # deferred: the models extra

    p = PRESETS[preset]
    fields = AutoConfig.for_model(family).to_dict()
    sizes = _config_sizes("llama", p)
    experts = {k: p["experts"] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in fields}
    sizes.update(experts, num_experts_per_tok=p["top_k"], moe_topk=p["top_k"], moe_intermediate_size=p["moe_ffn"],
                 shared_expert_intermediate_size=p["moe_ffn"])
    if experts and "moe_intermediate_size" not in fields:  # GPT-OSS, Mixtral-like: intermediate_size is the experts'
        sizes["intermediate_size"] = p["moe_ffn"]
    if preset != "tiny":
        sizes.update(_LARGER, q_lora_rank=p["hidden"] * 3 // 8)
    return sizes


@functools.lru_cache(maxsize=None)
def is_moe(family: str) -> bool:
    """Whether ``family``'s models have experts (a hand MoE family, or a plan for them)."""
    if family in _CLASSES:
        return family in _MOE
    from transformers import AutoConfig  # deferred: the models extra

    return bool(getattr(AutoConfig.for_model(family), "base_model_ep_plan", None))


def small_model(family: str, preset: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                positions: int = 4096) -> Any:
    """A ``family`` model of ``PRESETS[preset]`` sizes from random weights, the same on every rank,
    for sequences of up to ``positions`` tokens. ``family``: a hand family (``FAMILY_PRESETS``) or
    any other causal-LM type with a tensor-parallel plan (``bench.model_zoo.families``), sized by
    ``bench.model_zoo.tiny_config`` with the preset's sizes laid over its rules."""
    import transformers  # deferred: the models extra

    if preset not in PRESETS:
        raise C.InvalidArgumentError("preset", preset, "is not a preset", f"use one of {sorted(PRESETS)}")
    if family not in _CLASSES:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        from .model_zoo import tiny_config, tiny_model

        planned = family in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and bool(
            getattr(tiny_config(family), "base_model_tp_plan", None))
        if not planned:
            raise C.InvalidArgumentError("family", family, "is neither a hand family nor a causal-LM type of this "
                                         "transformers with a tensor-parallel plan",
                                         f"use one of {sorted(_CLASSES)} or a type bench.model_zoo.families() lists")
        sizes = {**_plan_sizes(family, preset), "max_position_embeddings": positions}
        return tiny_model(family, seed, sizes, most_parameters=1 << 40).to(dtype=dtype, device=device)
    config_name, model_name = _CLASSES[family]
    cfg = getattr(transformers, config_name)(max_position_embeddings=positions, tie_word_embeddings=False,
                                             **_config_sizes(family, PRESETS[preset]))
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(cfg).to(dtype=dtype, device=device)


def save_checkpoint(model: Any, comm: C.Communicator, folder: str | None = None) -> str:
    """Rank 0 writes ``model`` with ``save_pretrained`` into ``folder`` (default a new temporary
    folder named by rank 0); every rank returns its path once it is written."""
    path = [folder or (tempfile.mkdtemp(prefix="commops-model-") if comm.rank == 0 else None)]
    dist.broadcast_object_list(path, src=0, group=comm.group)
    if comm.rank == 0:
        model.save_pretrained(path[0])
    dist.barrier(group=comm.group)
    return str(path[0])


@dataclass
class StepRecord:
    family: str
    variant: str             # ours/auto, ours/sequential, transformers
    step: str                # train (forward + backward), prefill or decode (one token, static KV cache)
    graph: bool              # replayed from a CUDA graph
    world: int
    layout: str              # e.g. "tp=2" or "tp=1,ep=2"
    moe_transport: str | None
    dtype: str
    device: str
    batch: int
    seq: int                 # the training sequence, the prompt, or the tokens in the KV cache
    time_us: float | None
    tokens_per_s: float | None
    vs_transformers: float | None   # transformers' time / this one's, paired by round
    vs_sequential: float | None     # ours/sequential's time / this one's, paired by round
    wrong: int | None        # logits off the unsharded fp32 model's (small fp32 case)
    max_rel_err: float | None
    error: str | None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _hf_layout(world: int, moe: bool) -> tuple[dict[str, Any], int, int]:
    """transformers' ``DistributedConfig`` keywords for ``world`` ranks, and the (tp, ep) it gives."""
    if world == 1:
        return {}, 1, 1
    if not moe:
        return {"tp_size": world}, world, 1
    from transformers.distributed import DistributedConfig  # deferred: the models extra

    if "ep_size" in {f.name for f in dataclasses.fields(DistributedConfig)}:
        return {"tp_size": world, "ep_size": world}, world, world  # 5.21+: attention TP, experts EP
    return {"tp_size": world, "enable_expert_parallel": True}, 1, world  # before: the experts' plan alone


_SUBGROUPS: dict[int, Any] = {}


def _groups(comm: C.Communicator, tp: int, ep: int) -> tuple[Any, Any]:
    """(tp_group, ep_group): the tensor-parallel groups made once per size (collective the first time)."""
    if tp == comm.size:
        tp_group = comm.group
    else:
        tp_group = _SUBGROUPS.get(tp) or _SUBGROUPS.setdefault(tp, dist.new_subgroups(tp)[0])
    return tp_group, (None if ep == 1 else comm.group)


def _moe_transport(variant: str, family: str, comm: C.Communicator, device: torch.device, ep: int, tokens: int,
                   top_k: int) -> Any:
    """"peer" options for ours/auto where the expert-parallel ranks (all ranks) are GPUs of one node."""
    if variant != "ours/auto" or not is_moe(family) or ep == 1 or device.type != "cuda" or len(comm.topology.nodes) > 1:
        return "nccl"
    return PeerOptions(max_tokens=-(-tokens // ep), top_k=top_k)


def _load(variant: str, family: str, path: str, comm: C.Communicator, dtype: torch.dtype, device: torch.device,
          tokens: int) -> Any:
    """One variant of the checkpoint at ``path``, on this rank."""
    import transformers  # deferred: the models extra

    hf, tp, ep = _hf_layout(comm.size, is_moe(family))
    if variant == "transformers":
        if not hf:
            return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        from transformers.distributed import DistributedConfig  # deferred: the models extra

        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                                 distributed_config=DistributedConfig(**hf))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    tp_group, ep_group = _groups(comm, tp, ep)
    top_k = int(getattr(model.config, "num_experts_per_tok", 1))
    return parallelize(model, tp_group=tp_group, ep_group=ep_group,
                       strategy="auto" if variant == "ours/auto" else "sequential",
                       moe_transport=_moe_transport(variant, family, comm, device, ep, tokens, top_k))


def _logits(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill logits and one decode step's, through a static cache."""
    from transformers import StaticCache  # deferred: the models extra

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)
    with torch.no_grad():
        n = ids.shape[1]
        pre = model(input_ids=ids, past_key_values=cache, use_cache=True,
                    cache_position=torch.arange(n, device=ids.device))
        nxt = pre.logits[:, -1:].argmax(-1)
        dec = model(input_ids=nxt, past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([n], device=ids.device))
    full = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in (pre.logits, dec.logits)]
    return full[0].float(), full[1].float()


def _wrong(got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> tuple[int, float]:
    bad, err = 0, 0.0
    for g, r in zip(got, ref, strict=True):
        scale = float(r.abs().max())
        bad += int((~torch.isclose(g, r, rtol=1e-4, atol=1e-4 * scale)).sum())
        err = max(err, float((g - r).abs().max()) / max(scale, 1e-30))
    return bad, err


def _check(family: str, variants: tuple[str, ...], preset: str, comm: C.Communicator,
           device: torch.device) -> dict[str, tuple[int, float] | str]:
    """#wrong and the largest relative error of each variant's fp32 logits against the unsharded model's."""
    ref_model = small_model(family, preset, torch.float32, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, ref_model.config.vocab_size, (2, 24), generator=g).to(device)
    ref = _logits(ref_model, ids)
    path = save_checkpoint(ref_model, comm)
    del ref_model
    out: dict[str, tuple[int, float] | str] = {}
    for v in variants:
        wrong, why = _on_every_rank(
            lambda: _wrong(_logits(_load(v, family, path, comm, torch.float32, device, ids.numel()), ids), ref),  # noqa: B023
            comm, device)
        out[v] = why or wrong
        gc.collect()
    _forget(path, comm)
    return out


def _train_step(model: Any, ids: torch.Tensor) -> Callable[[], None]:
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        model.train()
        for p in params:
            p.grad = None
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return step


def _rewind(cache: Any, position: int) -> None:
    """Set the write position of each layer of a ``StaticCache`` that keeps its own (transformers
    5.17 and 5.24 write at ``cumulative_length``, not at ``cache_position``) to ``position``. Looked
    up on every call: a layer's first write replaces that tensor with one on the cache's device."""
    for layer in getattr(cache, "layers", ()):
        t = getattr(layer, "cumulative_length", None)
        if isinstance(t, torch.Tensor):
            t.fill_(position)


def _prefill_step(model: Any, ids: torch.Tensor) -> Callable[[], None]:
    """The prompt ``ids`` written into a static cache with room for 16 more tokens (the same
    slots every call)."""
    from transformers import StaticCache  # deferred: the models extra

    n = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=n + 16)
    pos = torch.arange(n, device=ids.device)

    def step() -> None:
        model.eval()
        _rewind(cache, 0)
        with torch.no_grad():  # the next token's logits alone, as generation asks for
            model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=pos, logits_to_keep=1)
    return step


def _decode_step(model: Any, ids: torch.Tensor) -> Callable[[], None]:
    """One token per row against a static cache prefilled with ``ids`` (the same slot every call)."""
    from transformers import StaticCache  # deferred: the models extra

    n = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=n + 1)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(n, device=ids.device),
              logits_to_keep=1)
    tok, pos = ids[:, -1:].clone(), torch.tensor([n], device=ids.device)

    def step() -> None:
        model.eval()
        _rewind(cache, n)
        with torch.no_grad():
            model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos, position_ids=pos.view(1, 1))
    return step


def _agreed(comm: C.Communicator, ok: bool, device: torch.device) -> bool:
    """Whether every rank's ``ok`` holds (so that all ranks go on, or none)."""
    return _slowest(comm, [0.0 if ok else 1.0], device)[0] == 0.0


def _on_every_rank(fn: Callable[[], Any], comm: C.Communicator, device: torch.device) -> tuple[Any, str]:
    """``(fn(), "")`` where ``fn`` ran on every rank, else ``(None, why)``: its own error, or "failed
    on another rank". Collective: every rank calls it, and all go on with the same variants."""
    try:
        got, why = fn(), ""
    except Exception as e:  # a variant that does not run here is reported in its records, not dropped
        got, why = None, f"{type(e).__name__}: {e}"[:300]
    if not _agreed(comm, not why, device):
        return None, why or "failed on another rank"
    return got, ""


def _first_call(fn: Callable[[], None], graph: bool, device: torch.device) -> None:
    """One call of ``fn`` (and its capture in a CUDA graph) alone, finished."""
    fn()
    if graph:
        _captured(fn, 1)()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fns: dict[str, Callable[[], None]], comm: C.Communicator, device: torch.device, graph: bool, iters: int,
          reps: int) -> tuple[dict[str, float], dict[str, list[float]], dict[str, str]]:
    """Each function's time (us), its times by round, and why those that could not run did not."""
    errors: dict[str, str] = {}
    ready = {}
    for name, fn in fns.items():  # one call (or capture) alone first: a failure is its own record
        _, why = _on_every_rank(functools.partial(_first_call, fn, graph, device), comm, device)
        if why:
            errors[name] = why
        else:
            ready[name] = fn
    rounds: dict[str, list[float]] = {}
    times = time_interleaved(ready, comm, device, iters, reps, graph=graph, rounds=rounds) if ready else {}
    return times, rounds, errors


def measure_model(family: str, comm: C.Communicator, device: torch.device, dtype: torch.dtype, *, preset: str,
                  batch: int, seq: int, decode_batches: Sequence[int], decode_seq: int, graphs: bool,
                  prefill_seqs: Sequence[int] = (), prefill_batch: int = 1, iters: int = 5, reps: int = 5,
                  variants: tuple[str, ...] = VARIANTS, check_preset: str | None = None, agree_tokens: int = 0,
                  train_steps: int = 0, lr: float = 1e-3, loss_rtol: float | None = None, profile: str | None = None,
                  progress: Callable[[str], None] = lambda s: None) -> tuple[list[StepRecord], list[AgreeRecord]]:
    """The records of one family: each variant's check, its steps' times, then (``agree_tokens``,
    ``train_steps`` > 0) its greedy tokens and training losses against the anchor's
    (``bench/model_agree.py``; ``loss_rtol`` by default 2% in half precision, else 1e-4).
    ``profile``: a folder for one profiled eager call of each variant's step, a trace and a table
    per rank."""
    check = _check(family, variants, check_preset or preset, comm, device)
    progress(f"{family}: checked " + ", ".join(f"{v}: {c if isinstance(c, str) else c[0]} wrong"
                                                for v, c in check.items()))
    longest = max([seq, decode_seq + 1, *prefill_seqs])
    base = small_model(family, preset, dtype, device, positions=max(4096, longest + 16))
    vocab = int(base.config.get_text_config().vocab_size)
    path = save_checkpoint(base, comm)
    del base
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    plan = [("train", ids)] + [("prefill", torch.randint(0, vocab, (prefill_batch, n), generator=gen).to(device))
                               for n in prefill_seqs]
    plan += [("decode", torch.randint(0, vocab, (b, decode_seq), generator=gen).to(device)) for b in decode_batches]
    models: dict[str, Any] = {}
    errors: dict[str, str] = {v: c for v, c in check.items() if isinstance(c, str)}
    for v in variants:
        if v in errors:
            continue
        model, why = _on_every_rank(lambda: _load(v, family, path, comm, dtype, device,  # noqa: B023
                                                  max(t.numel() for _, t in plan)), comm, device)
        if why:
            errors[v] = why
        else:
            models[v] = model
    _, tp, ep = _hf_layout(comm.size, is_moe(family))
    layout = f"tp={tp}" + (f",ep={ep}" if is_moe(family) else "")
    steps = {"train": _train_step, "prefill": _prefill_step, "decode": _decode_step}
    records = []
    for step, data in plan:
        for graph in ((False, True) if graphs and device.type == "cuda" and step != "prefill" else (False,)):
            fns, unbuilt = _built(steps[step], models, data, comm, device)
            times, rounds, failed = _time(fns, comm, device, graph, iters, reps)
            failed.update(unbuilt)
            if profile and not graph:
                _profile(fns, failed, profile, f"{family}-{step}-b{data.shape[0]}-s{data.shape[1]}", comm, device)
            tokens = data.numel() if step != "decode" else data.shape[0]
            for v in variants:
                c = check[v]
                t = times.get(v)
                ratios = [paired_ratio(rounds, b, v) if t and b in rounds else None
                          for b in ("transformers", "ours/sequential")]
                par = getattr(models.get(v), "commops_parallel", None) or {}
                wrong, err = (None, None) if isinstance(c, str) else c
                records.append(StepRecord(
                    family, v, step, graph, comm.size, layout, par.get("moe_transport"),
                    str(dtype).removeprefix("torch."), str(device), data.shape[0], data.shape[1], t,
                    tokens / (t * 1e-6) if t else None, *ratios, wrong, err, errors.get(v) or failed.get(v)))
            progress(format_steps(records[-len(variants):]))
    agree = _agreement(family, models, errors, comm, device, dtype, vocab, decode_seq, ids, agree_tokens,
                       train_steps, lr, loss_rtol)
    models.clear()
    gc.collect()
    _forget(path, comm)
    return records, agree


def _built(make: Callable[[Any, torch.Tensor], Callable[[], None]], models: dict[str, Any], data: torch.Tensor,
           comm: C.Communicator, device: torch.device) -> tuple[dict[str, Callable[[], None]], dict[str, str]]:
    """Each variant's step function (building a decode step runs its prompt's prefill), and why
    those that could not be built were not (on any rank: all go on with the same variants)."""
    fns: dict[str, Callable[[], None]] = {}
    why: dict[str, str] = {}
    for v, m in models.items():
        fn, failed = _on_every_rank(functools.partial(make, m, data), comm, device)
        if failed:
            why[v] = failed
        else:
            fns[v] = fn
    return fns, why


def _agreement(family: str, models: dict[str, Any], errors: dict[str, str], comm: C.Communicator,
               device: torch.device, dtype: torch.dtype, vocab: int, decode_seq: int, ids: torch.Tensor, n_tokens: int,
               train_steps: int, lr: float, loss_rtol: float | None) -> list[AgreeRecord]:
    """Each variant's greedy tokens (4 sequences of a prompt of up to 128 tokens), then its losses
    over ``train_steps`` steps on ``ids``, against the anchor's (transformers, else ours/sequential)."""
    if not n_tokens and not train_steps:
        return []
    prompt = torch.randint(0, vocab, (4, min(128, decode_seq)), generator=torch.Generator().manual_seed(3)).to(device)
    results: dict[str, dict[str, Any]] = {v: {"error": e} for v, e in errors.items()}
    for what in ("tokens", "losses"):
        if not (n_tokens if what == "tokens" else train_steps):
            continue
        for v, m in models.items():
            got = results.setdefault(v, {})
            run = functools.partial(greedy_tokens, m, prompt, n_tokens) if what == "tokens" else \
                functools.partial(loss_curve, m, ids, train_steps, lr)
            value, why = _on_every_rank(run, comm, device)
            if why:
                got["error"] = "; ".join(filter(None, (got.get("error"), f"{what}: {why}")))
            elif what == "tokens":
                got["tokens"], got["margins"] = value
            else:
                got["losses"] = value
    # the first variant with something to compare with: transformers, else ours/sequential
    anchor = next((v for v in ("transformers", "ours/sequential", "ours/auto")
                   if results.get(v, {}).get("tokens") is not None or results.get(v, {}).get("losses") is not None),
                  "transformers")
    half = dtype in (torch.bfloat16, torch.float16)
    return compare(family, dtype, results, anchor, loss_rtol if loss_rtol is not None else (2e-2 if half else 1e-4))


def _profile(fns: dict[str, Callable[[], None]], failed: dict[str, str], folder: str, name: str,
             comm: C.Communicator, device: torch.device) -> None:
    """One call of each function that ran, under ``torch.profiler``: ``folder/name-variant-rankR``
    ``.json`` (a Chrome trace) and ``.txt`` (the 30 largest ops by device, else host, time)."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for v, fn in fns.items():
        if v in failed:
            continue
        dist.barrier(group=comm.group)
        with profile(activities=acts) as prof:
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        stem = os.path.join(folder, f"{name}-{v.replace('/', '_')}-rank{comm.rank}")
        prof.export_chrome_trace(stem + ".json")
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        with open(stem + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=key, row_limit=30) + "\n")


def _forget(path: str, comm: C.Communicator) -> None:
    """Rank 0 removes a checkpoint folder once every rank has loaded it."""
    dist.barrier(group=comm.group)
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def format_steps(records: list[StepRecord]) -> str:
    lines = []
    for r in records:
        head = (f"{r.family:<10} {r.step:<6} {'graph' if r.graph else 'eager':<5} {r.variant:<16} {r.layout:<10} "
                f"b={r.batch} s={r.seq}")
        if r.time_us is None:
            lines.append(f"{head}  not run: {r.error}")
            continue
        vs = f"{r.vs_transformers:5.2f}x vs transformers" if r.vs_transformers else ""
        vs += f" {r.vs_sequential:5.2f}x vs sequential" if r.vs_sequential and r.variant == "ours/auto" else ""
        lines.append(f"{head} {r.time_us:11.1f} us {r.tokens_per_s:12,.0f} tok/s  {vs}  #wrong {r.wrong} "
                     f"(max rel {r.max_rel_err:.1e})")
    return "\n".join(lines)


def plot_steps(records: list[StepRecord], path: str, title: str = "") -> None:
    """PNG: tokens/s per variant, a row of panels per family, one per step and shape, eager and
    graph side by side."""
    import matplotlib  # deferred: the plot extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(r.family for r in records))
    rows = [list(dict.fromkeys((r.family, r.step, r.batch, r.seq) for r in records if r.family == f)) for f in families]
    cols = max(len(row) for row in rows)
    variants = list(dict.fromkeys(r.variant for r in records))
    fig, axes = plt.subplots(len(rows), cols, figsize=(3.6 * cols, 3.4 * len(rows)), squeeze=False)
    for ax in axes.flat[:]:
        ax.set_visible(False)
    for ax, key in ((axes[i][j], key) for i, row in enumerate(rows) for j, key in enumerate(row)):
        ax.set_visible(True)
        family, step, batch, seq = key
        mine = [r for r in records if (r.family, r.step, r.batch, r.seq) == key]
        modes = list(dict.fromkeys(r.graph for r in mine))
        width = 0.8 / len(variants)
        for i, v in enumerate(variants):
            for j, g in enumerate(modes):
                hit = [r for r in mine if (r.variant, r.graph) == (v, g)]
                if hit and hit[0].tokens_per_s:
                    ax.bar(j + i * width, hit[0].tokens_per_s, width, color=f"C{i}", label=v if j == 0 else None)
                elif hit:
                    ax.text(j + i * width, 0, "x", ha="center", va="bottom", color=f"C{i}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(modes))], ["graph" if g else "eager" for g in modes])
        ax.set_title(f"{family} {step} {batch}x{seq}", fontsize=9)
        ax.set_ylabel("tokens/s")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
