"""Every ``transformers`` causal-LM family with a parallel plan, tiny and random, sharded by ours and by transformers.

For each model type of the installed ``transformers`` whose config has a tensor-parallel plan
(``base_model_tp_plan``) or an expert-parallel one (``base_model_ep_plan``), :func:`tiny_model`
builds it small from the type's default config (our own rules, ``_TINY``: 2 layers, hidden 64, 4
heads of 16, 2 KV heads, 4 experts of top 2, a vocabulary of 128, no dropout, eager attention),
the same on every rank from one seed, in float32. :func:`check_family` then shards a copy and
holds it against the unsharded model:

- ``logits``: a batch's logits, and those of one sequence of 7 tokens, within 1e-4 of the
  largest reference logit (relative);
- ``split``: the sharded model's parameters hold less than the whole (``local / whole``);
- ``train``: one training step's loss within 1e-4 relative and every parameter's gradient equal
  to its slice of the reference's (1e-4 relative to the slice's largest entry);
- ``generate``: 8 greedy tokens through the KV cache equal.

``layout``: "tp" (tensor parallelism over the group), "ep" (experts over the group) or "tpxep"
(a grid: tensor parallelism in pairs, experts across them). ``impl``: "ours" (``parallelize``)
or "transformers" (``from_pretrained(..., distributed_config=DistributedConfig(...))`` of the
same weights saved once, the anchor). A family is "pass" when every check holds on every rank,
"refused" when its sharding raised a typed error before anything changed (the message is the
reason), "fail" otherwise (the first problem), "skip" where the tiny model cannot be built (why).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from collectives import call_timeout
from collectives.errors import CommopsError

from .model_agree import full_tensor

__all__ = ["ZooRecord", "families", "tiny_model", "check_family", "format_table"]

# our small-config rules: each applies where the type's config has the field
_TINY: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "n_shared_experts": 1, "n_group": 2,
    "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "qk_head_dim": 16, "v_head_dim": 16, "sliding_window": 16, "attention_chunk_size": 16,
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_expand": 2, "mamba_n_groups": 1,
    "ssm_state_size": 8, "global_attn_every_n_layers": 2, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "num_nextn_predict_layers": 0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "attn_implementation": "eager", "use_cache": True,
}
_MOST_PARAMETERS = 4_000_000
_ZERO = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop",
         "ffn_dropout", "activation_dropout", "router_jitter_noise", "hidden_dropout_prob",
         "attention_probs_dropout_prob", "mlp_dropout", "embedding_dropout", "residual_dropout")


@dataclasses.dataclass
class ZooRecord:
    """One family, one layout, one implementation. ``status``: pass / refused / fail / skip."""

    family: str
    layout: str
    impl: str
    status: str
    reason: str = ""
    logits_err: float | None = None
    split: float | None = None
    seconds: float = 0.0


def families() -> dict[str, dict[str, bool]]:
    """Every causal-LM model type of the installed transformers with a plan: {type: {"tp": .., "ep": ..}}."""
    from transformers import AutoConfig  # deferred: the models extra
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: dict[str, dict[str, bool]] = {}
    for kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            cfg = _text(AutoConfig.for_model(kind))
        except Exception:  # noqa: BLE001 - a type whose default config does not build: listed, then skipped
            out[kind] = {"tp": False, "ep": False, "config": False}
            continue
        tp, ep = bool(getattr(cfg, "base_model_tp_plan", None)), bool(getattr(cfg, "base_model_ep_plan", None))
        if tp or ep:
            out[kind] = {"tp": tp, "ep": ep, "config": True}
    return out


def _text(cfg: Any) -> Any:
    try:
        return cfg.get_text_config()
    except (AttributeError, ValueError):
        return cfg


def tiny_config(kind: str, sizes: dict[str, Any] | None = None) -> Any:
    """The type's default config with ``_TINY``'s sizes, then ``sizes`` (config field names: each
    applies where the type's config has the field; raises where that cannot be built)."""
    from transformers import AutoConfig  # deferred: the models extra

    base = AutoConfig.for_model(kind)
    if _text(base) is not base:
        raise CommopsError(f"{kind} is a composite model (a text config inside {type(base).__name__}): its "
                           "tiny form needs its other towers too")
    fields = base.to_dict()
    kw = {k: v for k, v in {**_TINY, **(sizes or {})}.items() if k in fields or k == "attn_implementation"}
    kw.update({k: 0.0 for k in _ZERO if k in fields})
    if "qk_rope_head_dim" in fields:  # MLA: the rotary part is what head_dim sizes, and k and v have every head
        kw["head_dim"] = kw["qk_rope_head_dim"]
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    if "attn_layer_period" in fields:  # Jamba-like hybrids: one attention layer of the two
        kw.update(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1)
    if isinstance(fields.get("layer_types"), list):  # the type's first two kinds of layer, in turn
        kinds = list(dict.fromkeys(fields["layer_types"]))[:2]
        kw["layer_types"] = [kinds[i % len(kinds)] for i in range(int(kw.get("num_hidden_layers", 2)))]
    for name in ("rope_scaling", "rope_parameters"):
        if isinstance(fields.get(name), dict) and "mrope_section" in fields[name]:
            raise CommopsError(f"{kind} takes multimodal rotary sections: its tiny form needs their sizes")
    return AutoConfig.for_model(kind, **kw)


def tiny_model(kind: str, seed: int = 1234, sizes: dict[str, Any] | None = None,
               most_parameters: int = _MOST_PARAMETERS) -> Any:
    """The tiny random model of ``kind`` (float32, eval mode), the same on every rank; ``sizes``
    as :func:`tiny_config` takes them, ``most_parameters`` the size past which the rules missed
    one of the type's own size fields (an error)."""
    import transformers  # deferred: the models extra
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = tiny_config(kind, sizes)
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[kind])
    with torch.device("meta"):
        n = sum(p.numel() for p in cls(cfg).parameters())
    if n > most_parameters:
        raise CommopsError(f"the tiny rules leave {kind} {n / 1e6:.0f}M parameters (its sizes have other names)")
    torch.manual_seed(seed)
    return cls(cfg).float().eval()


def _groups(layout: str) -> tuple[Any, Any, int, int]:
    world = dist.get_world_size()
    if layout == "tp":
        return dist.new_group(list(range(world))), None, world, 1
    if layout == "ep":
        return dist.new_subgroups(1)[0], dist.new_group(list(range(world))), 1, world
    tp = 2
    g = dist.new_subgroups(tp)[0]
    e = dist.new_subgroups_by_enumeration([list(range(q, world, tp)) for q in range(tp)])[0]
    return g, e, tp, world // tp


def _agree(problem: str) -> str:
    """The first rank's problem (or "") as every rank's: each phase ends with every rank knowing."""
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, problem)
    return next((f"rank {r}: {p}" for r, p in enumerate(seen) if p), "")


_REFUSED = "refused: "


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) / max(float(b.float().abs().max()), 1e-30) if b.numel() else 0.0


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _expected(name: str, p: torch.Tensor, ref: dict[str, torch.Tensor], model: Any, tp_rank: int, tp: int) -> Any:
    """The reference gradient's part that this rank's ``p`` holds (None: nothing to compare with)."""
    want = ref.get(name)
    if want is None:
        return _hand_experts(name, ref, model) if ".experts.w" in name else None
    shape = tuple(p.shape)
    if tuple(want.shape) == shape:
        return want
    owner = model.get_submodule(name.rpartition(".")[0])
    ep = getattr(owner, "_commops_ep", None)
    if ep is not None:
        return want[ep.first_expert:ep.first_expert + ep.local]
    return _slice(want, shape, tp_rank, tp, model, name)


def _hand_experts(name: str, ref: dict[str, torch.Tensor], model: Any) -> Any:
    """A hand family's expert-parallel block's ``experts.w1/w3/w2``: the rows of the fused tensors they came from."""
    block_name, _, leaf = name.rpartition(".experts.")
    block = model.get_submodule(block_name)
    first, n = block.first_expert, block.experts.w1.shape[0]
    gate_up, down = ref.get(f"{block_name}.experts.gate_up_proj"), ref.get(f"{block_name}.experts.down_proj")
    if gate_up is None or down is None:
        return None
    gate_up, ffn = gate_up[first:first + n], gate_up.shape[1] // 2
    if leaf == "w1":
        return gate_up[:, :ffn].transpose(1, 2)
    if leaf == "w3":
        return gate_up[:, ffn:].transpose(1, 2)
    return down[first:first + n].transpose(1, 2)


def _slice(want: torch.Tensor, shape: tuple[int, ...], tp_rank: int, tp: int, model: Any, name: str) -> Any:
    dims = [d for d in range(want.dim()) if want.shape[d] != shape[d]]
    if len(dims) != 1:
        return None
    (dim,) = dims
    parts = want.shape[dim] // shape[dim]
    done = getattr(model, "commops_parallel", {}).get("sharded", {}).get(name.rpartition(".")[0], "")
    if done.startswith("packed_colwise"):
        halves = want.chunk(2, dim)
        n = shape[dim] // 2
        return torch.cat([h.narrow(dim, tp_rank * n, n) for h in halves], dim)
    return want.chunk(parts, dim)[tp_rank * parts // tp]


def _grad_problem(model: Any, ref: Any, tp_rank: int, tp: int, transformers_impl: bool) -> str:
    """The first gradient that differs from its part of the reference's by more than 1e-4 of the
    larger of that part's largest entry and 1% of the model's largest gradient entry (a small
    parameter's gradient, a scalar's say, is a sum over every activation, whose float32 rounding the
    order of the ranks' partial sums moves by more than 1e-4 of the sum where its terms cancel)."""
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    biggest = max((float(g.abs().max()) for g in ref_grads.values() if g.numel()), default=1.0)
    for name, p in model.named_parameters():
        g = p.grad
        if transformers_impl:
            g = None if g is None else full_tensor(g)
            want = ref_grads.get(name)
        else:
            want = _expected(name, p, ref_grads, model, tp_rank, tp)
        if want is None and g is None:
            continue
        if g is None or want is None:
            return f"gradient of {name}: {'none here' if g is None else 'none in the reference'}"
        if tuple(g.shape) != tuple(want.shape):
            return f"gradient of {name}: shape {tuple(g.shape)} against {tuple(want.shape)}"
        err = float((g - want).abs().max()) / max(float(want.abs().max()) if want.numel() else 0.0, 1e-2 * biggest)
        if err > 1e-4:
            return f"gradient of {name} {tuple(g.shape)} differs by {err:.3g} (relative)"
    return ""


def _shard(kind: str, layout: str, impl: str, ref: Any, path: str) -> Any:
    """The sharded model: ours from a copy of ``ref``, or transformers' from the checkpoint at ``path``."""
    g, e, tp, ep = _groups(layout)
    if impl == "ours":
        from overlap import parallelize

        return parallelize(copy.deepcopy(ref), tp_group=g, ep_group=e), dist.get_rank(g), tp
    import transformers  # deferred: the models extra
    from transformers.distributed import DistributedConfig

    names = {f.name for f in dataclasses.fields(DistributedConfig)}
    kw: dict[str, Any] = {"tp_size": tp}
    if ep > 1:
        if "ep_size" not in names:  # before 5.21: the experts' plan alone, over the world
            if "enable_expert_parallel" not in names or tp > 1:
                raise CommopsError(f"this transformers ({transformers.__version__}) has no ep_size")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=ep, enable_expert_parallel=True))
            return model.eval(), dist.get_rank(g), tp
        # its experts split over the ranks of its tensor-parallel mesh; tp_plan={} keeps attention whole
        # (the layout ours has with tp_group of one rank)
        kw.update(ep_size=ep, tp_size=max(tp, ep))
        if tp == 1 and "tp_plan" in names:
            kw["tp_plan"] = {}
        if tp > 1 and tp * ep > tp and "dp_replicate_size" in names:
            # a grid: its nearest layout is TP=2 with the experts split over those same ranks, replicated
            kw.update(tp_size=tp, ep_size=tp, dp_replicate_size=ep)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              distributed_config=DistributedConfig(**kw))
    return model.eval(), dist.get_rank(g), tp


def check_family(kind: str, layout: str = "tp", impl: str = "ours", seed: int = 1234, device: str = "cpu") -> ZooRecord:
    """Build ``kind`` tiny, shard it (``layout``, ``impl``) and hold it against the unsharded model.
    Collective over the world; every rank returns the same record. ``device``: where the models and
    data live ("cuda": ranks may share one GPU, the group's traffic over Gloo; ours alone)."""
    start = time.perf_counter()
    rec = ZooRecord(kind, layout, impl, "fail")
    problem, what = "", "build"
    try:
        ref = tiny_model(kind, seed).to(device)
        what = "run"
        with torch.no_grad():
            ref(torch.randint(3, int(_text(ref.config).vocab_size), (1, 6), device=device))
    except Exception as exc:  # noqa: BLE001 - a tiny model that cannot be built or run unsharded is a skip
        problem = f"the tiny model does not {what}: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    if (p := _agree(problem)):
        rec.status, rec.reason = "skip", p.partition(": ")[2]
        return _done(rec, start)
    tmp = tempfile.mkdtemp(prefix="zoo-") if impl == "transformers" else ""
    if impl == "transformers":
        paths: list[Any] = [tmp]
        dist.broadcast_object_list(paths, 0)
        tmp = paths[0]
        if dist.get_rank() == 0:
            ref.save_pretrained(tmp)
        dist.barrier()
    try:
        with call_timeout(60):  # a rank that fails alone must not leave the others waiting forever
            return _done(_checks(rec, kind, layout, impl, ref, tmp), start)
    finally:
        if impl == "transformers":
            dist.barrier()
            if dist.get_rank() == 0:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)


def _checks(rec: ZooRecord, kind: str, layout: str, impl: str, ref: Any, path: str) -> ZooRecord:
    problem = ""
    try:
        model, tp_rank, tp = _shard(kind, layout, impl, ref, path)
    except CommopsError as exc:  # a refusal before anything changed (every rank alike)
        problem = _REFUSED + str(exc).splitlines()[0][:300]
        model, tp_rank, tp = None, 0, 1
    except Exception as exc:  # noqa: BLE001 - the anchor's own refusals, and our crashes, are recorded
        problem = f"sharding raised {type(exc).__name__}: {str(exc).splitlines()[0][:240]}"
        model, tp_rank, tp = None, 0, 1
    if (p := _agree(problem)):
        refused = _REFUSED in p or impl == "transformers"
        rec.status, rec.reason = ("refused" if refused else "fail"), p.replace(_REFUSED, "")
        return rec
    gen = torch.Generator().manual_seed(99)
    vocab = int(_text(ref.config).vocab_size)
    device = next(ref.parameters()).device
    ids = torch.randint(3, vocab, (2, 12), generator=gen).to(device)
    phase = "logits"
    try:
        with torch.no_grad():
            got, want = model(ids).logits, ref(ids).logits
        rec.logits_err = _rel(full_tensor(got), want)
        with torch.no_grad():  # an odd number of tokens (7): the expert exchange pads its share
            odd = _rel(full_tensor(model(ids[:1, :7]).logits), ref(ids[:1, :7]).logits)
        rec.logits_err = max(rec.logits_err, odd)
        if rec.logits_err > 1e-4:
            problem = f"logits differ by {rec.logits_err:.3g} (relative)"
        whole = sum(p.numel() for p in ref.parameters())
        rec.split = sum(_local(p).numel() for p in model.parameters()) / whole
        if not problem and rec.split > 0.999:
            problem = f"the parameters are not split (local {rec.split:.3f} of the whole)"
        if not problem:
            phase = "train"
            model.train()
            ref.train()
            out, exp = model(ids, labels=ids), ref(ids, labels=ids)
            out.loss.backward()
            exp.loss.backward()
            if abs(float(out.loss) - float(exp.loss)) > 1e-4 * abs(float(exp.loss)):
                problem = f"training loss {float(out.loss)} against {float(exp.loss)}"
            problem = problem or _grad_problem(model, ref, tp_rank, tp, impl == "transformers")
            model.eval()
            ref.eval()
        if not problem:
            phase = "generate"
            prompt = torch.randint(3, vocab, (2, 5), generator=gen).to(device)
            kw = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                      attention_mask=torch.ones_like(prompt))
            with torch.no_grad():
                a, b = model.generate(prompt, **kw), ref.generate(prompt, **kw)
            if not torch.equal(a, b):
                problem = f"generate: {a[:, 5:].tolist()} against {b[:, 5:].tolist()}"
    except Exception as exc:  # noqa: BLE001 - recorded as the family's failure
        problem = f"{phase} raised {type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"
    p = _agree(problem)
    rec.status, rec.reason = ("fail", p) if p else ("pass", "")
    return rec


def _done(rec: ZooRecord, start: float) -> ZooRecord:
    rec.seconds = round(time.perf_counter() - start, 2)
    return rec


def format_table(records: list[ZooRecord], version: str) -> str:
    """The README's table: family, ours and transformers' per layout, and the reason where not a pass."""
    by: dict[str, dict[tuple[str, str], ZooRecord]] = {}
    for r in records:
        by.setdefault(r.family, {})[(r.layout, r.impl)] = r
    layouts = sorted({r.layout for r in records}, key=["tp", "ep", "tpxep"].index)
    head = ["family"] + [f"{impl} {lay.upper()}" for lay in layouts for impl in ("ours", "transformers")] + \
        ["reason where not a pass"]
    lines = [f"<!-- made by launch/model_zoo.py with transformers {version}; do not edit by hand -->",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for fam in sorted(by):
        cells, reasons = [fam], []
        for lay in layouts:
            for impl in ("ours", "transformers"):
                r = by[fam].get((lay, impl))
                cells.append("—" if r is None else r.status)
                if r is not None and r.status != "pass" and r.reason and impl == "ours":
                    reasons.append(f"{lay}: {r.reason}")
        cells.append("; ".join(reasons).replace("|", "/")[:300])
        lines.append("| " + " | ".join(cells) + " |")
    counts = {f"{impl} {lay}": sum(1 for f in by.values() if (r := f.get((lay, impl))) and r.status == "pass")
              for lay in layouts for impl in ("ours", "transformers")}
    lines.append("")
    lines.append("Passing: " + ", ".join(f"{k} {v}" for k, v in counts.items()) + f" (of {len(by)} families).")
    return "\n".join(lines)


def env_threads() -> None:
    """One thread per rank (2-core machines run two ranks)."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
