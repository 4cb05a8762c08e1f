"""Parallelize a Hugging Face ``transformers`` causal LM in place with commops' layers.

``parallelize(model, tp_group=g)`` shards a model as Megatron-LM does, module by module, taking
each rank's slice of the weights the model already holds (so ``from_pretrained`` checkpoints work
unchanged, every rank loading the same one):

- attention: q, k and v column-parallel (rank r keeps heads ``r * H/p ...``, and the KV heads that
  go with them), o row-parallel (its all-reduce runs as ``gemm_all_reduce``, overlapped per
  ``strategy``); the model's own attention code runs on the local heads unchanged, as it sizes
  its views by ``head_dim`` and ``-1`` heads; with fewer KV heads than ranks (a multiple of
  them), each KV head replicated on the ranks whose query heads read it (``_kv.py``);
- the MLP: gate and up column-parallel, down row-parallel;
- modules kept whole but applied per head (Qwen3's q_norm and k_norm): their gradients summed
  over the group by a hook on their parameters;
- the embedding vocabulary-parallel (``VocabParallelEmbedding``: each rank's rows, then an
  all-reduce), the LM head column-parallel over the vocabulary with its logits all-gathered, so
  that the model's own loss, ``generate()`` and the KV cache (which holds the local heads) work as
  they do unsharded; a tied head shares the embedding's shard.

Which modules are which is written once per family for the hand families (``families.py``);
a model of any other family is sharded by its own tensor- and expert-parallel plans
(``plans.py``, which says what each plan style becomes), and refused by module path and style
where a plan asks for what the mapping cannot do. Everything is checked before the first module is
replaced (sizes that do not divide, a model that is not one we know), so a refused call leaves the
model as it was.

- with ``ep_group``, each sparse MoE block (Qwen3-MoE, Mixtral) over expert parallelism: the model's own
  router, this rank's experts as a ``GroupedSwiGLU``, the rows through ``MoEDispatcher``
  (``_experts.py`` says how the ranks share the tokens); its parameters are then named
  ``experts.w1/w3/w2`` (this rank's experts' gate, up and down) instead of the fused tensors.

- with ``sequence_parallel=True``, the residual stream between the layer pairs split along the
  sequence (dimension 1 of Hugging Face's ``[batch, seq, hidden]``) in every forward whose
  sequence divides the group; o and down reduce-scatter instead of all-reducing (``_sequence.py``).

- at decode (a forward without autograd of at most 256 tokens), with ``strategy="auto"``, each
  all-reduce of o and down fused with the residual add and the RMSNorm after it
  (``fused_all_reduce_rmsnorm``, ``_decode.py``); ``model.commops_parallel["decode_norms"]`` says
  whether it is on.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from collectives.errors import InvalidArgumentError, InvalidTypeError, UnsupportedError

from ..layers import ColumnParallelLinear, RowParallelLinear
from ._decode import fuse_decode_norms
from ._experts import ExpertParallelMoE
from ._kv import replicated_kv_linear
from ._sequence import SequenceRowParallelLinear, SequenceSplit, split_sequence, summed_over
from ._vocab import VocabParallelEmbedding, reduce_from_group
from . import plans
from .families import FAMILIES, PLAN_OVERRIDES, Family

__all__ = ["parallelize", "ExpertParallelMoE", "VocabParallelEmbedding", "reduce_from_group", "FAMILIES", "Family"]


def _kind(model: Any) -> str:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if not isinstance(model, nn.Module) or kind is None:
        raise InvalidTypeError("model", model, "is not a transformers model (no config.model_type)",
                               "pass a transformers causal LM, e.g. AutoModelForCausalLM.from_pretrained(...)")
    return str(kind)


def _divides(what: str, n: int, size: int, fix: str) -> None:
    if n % size:
        raise InvalidArgumentError("tp_group", f"a group of {size} ranks", f"does not divide {what} ({n})", fix)


def _check(model: Any, family: Family, tp: int, ep: int) -> None:
    """Every size the sharding splits, checked before any module is replaced."""
    c = model.config
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    _divides("the attention heads", heads, tp, f"use a tensor-parallel size that divides {heads}")
    if kv % tp and tp % kv:
        raise InvalidArgumentError("tp_group", f"a group of {tp} ranks", f"neither divides the {kv} KV heads nor is a "
                                   "multiple of them (each rank's query heads must read whole KV heads)",
                                   f"use a tensor-parallel size that divides {kv} or a multiple of {kv} that "
                                   f"divides {heads}")
    for layer in family.layers(model):
        column, row = family.sharded(layer)
        for name in (*column, *row):
            lin = family.module(layer, name)
            if not isinstance(lin, nn.Linear):
                raise UnsupportedError("model", f"{name} = {type(lin).__name__}", "is not an nn.Linear (quantised "
                                       "or already parallelized?)", "pass the model as transformers builds it")
        block = family.moe_block(layer)
        if block is not None and ep > 1:
            n = int(getattr(block.experts, "gate_up_proj").shape[0])
            if n % ep:
                raise InvalidArgumentError("ep_group", f"a group of {ep} ranks", f"does not divide the {n} experts",
                                           f"use an expert-parallel size that divides {n}")
        for name in column:
            _divides(f"{name}'s {family.module(layer, name).out_features} output features",
                     family.module(layer, name).out_features, tp, "use a size that divides it")
        for name in row:
            _divides(f"{name}'s {family.module(layer, name).in_features} input features",
                     family.module(layer, name).in_features, tp, "use a size that divides it")
    vocab = model.get_input_embeddings().num_embeddings
    _divides("the vocabulary", vocab, tp, f"pad it to a multiple of {tp}: model.resize_token_embeddings(n, "
             f"pad_to_multiple_of={tp})")


def _grid(tp_group: Any, ep_group: Any) -> None:
    """This rank is in both groups, and they are the same ranks or cross in this rank alone (a grid)."""
    if ep_group is None:
        return
    for name, g in (("tp_group", tp_group), ("ep_group", ep_group)):
        if g is not None and dist.get_rank(g) < 0:
            raise InvalidArgumentError(name, f"ranks {dist.get_process_group_ranks(g)}",
                                       f"does not hold this rank ({dist.get_rank()})", "pass a group this rank is in")
    tp = set(range(dist.get_world_size())) if tp_group is None else set(dist.get_process_group_ranks(tp_group))
    ep = set(dist.get_process_group_ranks(ep_group))
    if tp != ep and tp & ep != {dist.get_rank()}:
        raise InvalidArgumentError("ep_group", f"ranks {sorted(ep)}", f"shares ranks {sorted(tp & ep)} with tp_group "
                                   f"{sorted(tp)}: the groups must be the same ranks or cross in this rank alone",
                                   "build them as the rows and columns of one grid of ranks")


def parallelize(model: Any, *, tp_group: Any = None, ep_group: Any = None, sequence_parallel: bool = False,
                strategy: str = "auto", moe_transport: Any = "nccl", tp_plan: dict[str, str] | None = None,
                ep_plan: dict[str, str] | None = None, fp8: bool = False) -> Any:
    """Shard ``model`` (a ``transformers`` causal LM, the same on every rank) in place over ``tp_group``.

    Args:
        model: a ``transformers`` model, built or loaded the same way on every rank of ``tp_group``. A
            family in ``FAMILIES`` (``config.model_type``) is sharded by its hand entry (which adds
            sequence parallelism and the fused decode norms); any other by its own plans
            (``plans.py``: ``model._tp_plan`` and ``model._ep_plan``).
        tp_group: the tensor-parallel group (default: world; a group of this rank alone,
            ``torch.distributed.new_subgroups(1)[0]``, for none). Collective: every rank of it calls this.
        ep_group: the expert-parallel group, for MoE families (``ExpertParallelMoE``): its ranks hold
            the same activations and split the experts; the same ranks as ``tp_group``, or the other
            side of a grid with it (``tp_group`` the rows, ``ep_group`` the columns). None: the
            experts stay whole on every rank.
        sequence_parallel: split the activations between the layer pairs along the sequence, in
            each forward whose sequence length divides the group (others, such as decode steps,
            run without the split); ``_sequence.py`` says where it gathers and scatters, and what
            it costs. Nothing to split with a tensor-parallel group of one rank
            (``model.commops_parallel["sequence_parallel"]`` says whether it is on).
        strategy: the overlap operators' strategy for the row-parallel layers' all-reduce and the
            column-parallel layers' backward ("auto", "sequential", "chunked", "copy_engine").
        moe_transport: the expert-parallel blocks' dispatcher transport (``MoEDispatcher``'s
            ``transport``): "nccl" (all-to-all), or e.g. ``PeerOptions(max_tokens=..., top_k=...)``
            on the GPUs of one node, ``max_tokens`` at least ``ceil(batch * seq / ep)``.
        fp8: the expert-parallel blocks of a hand family (``FAMILIES``) send their tokens as e4m3
            and run their experts in e4m3 (``GroupedSwiGLU(..., fp8=True)``: blockwise-scaled
            weights, float32 accumulation; hidden and the experts' width multiples of 128); the
            rest of the model keeps its dtype. Needs ``ep_group``.
        tp_plan, ep_plan: entries laid over the model's own plans (glob names from the model's root,
            ``{"model.layers.*.mlp.down_proj": "replicate"}``); either given, the model goes by its
            plans even where it has a hand entry.

    Returns:
        ``model``, whose forward on the same ids on every rank returns the unsharded model's logits
        (all gathered, ``[batch, seq, vocab]``) and whose parameters are this rank's shards (the
        same names, but for a hand family's expert-parallel block's experts: ``w1``, ``w3``, ``w2``).
        ``model.config`` is left as it was (the full model's sizes). ``model.commops_parallel``
        says what was done: ``"source"`` (``"hand"`` or ``"plan"``) and, from plans, ``"sharded"``
        (each path and what its style became) and ``"kept_whole"`` (each path kept whole, and why).
    """
    kind = _kind(model)
    if not isinstance(sequence_parallel, bool):
        raise InvalidTypeError("sequence_parallel", sequence_parallel, "is not a bool", "pass True or False")
    for name, g in (("tp_group", tp_group), ("ep_group", ep_group)):
        if g is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on the ranks outside it
            raise InvalidArgumentError(name, g, f"is not a group this rank ({dist.get_rank()}) is a member of",
                                       "pass, on each rank, the group that holds it")
        if g is not None and not isinstance(g, dist.ProcessGroup):
            raise InvalidTypeError(name, g, f"is a {type(g).__name__}, not a process group",
                                   "pass a torch.distributed.ProcessGroup (new_group) or None")
    for name, plan in (("tp_plan", tp_plan), ("ep_plan", ep_plan)):
        if plan is not None and not (isinstance(plan, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                    for k, v in plan.items())):
            raise InvalidTypeError(name, plan, "is not a dict of dotted names to style names",
                                   "pass e.g. {'model.layers.*.mlp.down_proj': 'replicate'}, or None")
    family = FAMILIES.get(kind) if tp_plan is None and ep_plan is None else None
    _check_fp8(model, fp8, family, kind, ep_group)
    if family is None:
        return _parallelize_from_plans(model, kind, tp_group, ep_group, sequence_parallel, strategy, moe_transport,
                                       tp_plan, ep_plan)
    if ep_group is not None and family.moe is None:
        raise UnsupportedError("ep_group", ep_group, f"{family.name} is a dense family: it has no experts",
                               "pass ep_group=None")
    tp = dist.get_world_size(tp_group)
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    _grid(tp_group, ep_group)
    _check(model, family, tp, ep)
    if tp == 1 and ep == 1:
        return model
    heads = model.config.num_attention_heads
    kv = getattr(model.config, "num_key_value_heads", None) or heads
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    tied = head is not None and head.weight is emb.weight
    split = SequenceSplit(tp_group) if sequence_parallel and tp > 1 else None
    for layer in family.layers(model):
        block = family.moe_block(layer)
        if block is not None and ep > 1:
            assert family.moe is not None
            family.replace(layer, family.moe, ExpertParallelMoE(block, ep_group, moe_transport, fp8=fp8))
        if tp == 1:
            continue
        column, row = family.sharded(layer)
        for name in column:
            lin = family.module(layer, name)
            if kv < tp and name in family.kv:
                family.replace(layer, name, replicated_kv_linear(lin, tp_group, kv, strategy=strategy))
            else:
                family.replace(layer, name, ColumnParallelLinear.from_linear(lin, tp_group, strategy=strategy))
        if kv < tp:  # the model's attention repeats each local KV head for its local query heads
            family.module(layer, family.attention).num_key_value_groups = heads // tp
        row_cls = SequenceRowParallelLinear if split is not None else RowParallelLinear
        for name in row:
            family.replace(layer, name, row_cls.from_linear(family.module(layer, name), tp_group, strategy=strategy))
            if split is not None:
                family.module(layer, name).split = split
        for name in family.per_head:
            for p in family.module(layer, name).parameters():
                p.register_hook(summed_over(tp_group))
    transports = sorted({m.dispatcher.transport for m in model.modules() if isinstance(m, ExpertParallelMoE)})
    if split is not None:
        split_sequence(model, family, split)
    model.commops_parallel = {"family": family.name, "source": "hand", "tp": tp, "ep": ep, "strategy": strategy,
                              "sequence_parallel": split is not None,
                              "moe_transport": transports[0] if transports else None,
                              "decode_norms": "off: no tensor parallelism"}
    if tp == 1:
        return model
    model.commops_parallel["decode_norms"] = fuse_decode_norms(model, family, split) \
        if strategy == "auto" else f"off: strategy={strategy!r} (the fused norms follow 'auto')"
    new_emb = VocabParallelEmbedding.from_embedding(emb, tp_group)
    model.set_input_embeddings(new_emb)
    if head is not None:
        new_head = ColumnParallelLinear.from_linear(head, tp_group, gather_output=True, strategy=strategy)
        if tied:
            new_head.weight = new_emb.weight  # the same rows of the same table
        model.set_output_embeddings(new_head)
    return model


def _head_sizes(model: Any) -> tuple[int, int, int | None, int | None]:
    """(query heads, KV heads, head_dim, rotary dim of MLA) of the model's text config."""
    config = model.config
    try:
        config = config.get_text_config()
    except (AttributeError, ValueError):  # several text configs: the model's own is the one it runs
        pass
    heads, kv, head_dim, rope = (_size(config, n) for n in ("num_attention_heads", "num_key_value_heads", "head_dim",
                                                             "qk_rope_head_dim"))
    heads = heads or 0
    kv = kv or heads
    if not isinstance(head_dim, int) or not head_dim:
        hidden = getattr(config, "hidden_size", None)
        head_dim = hidden // heads if isinstance(hidden, int) and heads and hidden % heads == 0 else None
    return heads, kv, head_dim, rope


def _size(config: Any, name: str) -> int | None:
    """An int field of ``config``, or None where it has none, or one per layer (which the config refuses
    to give as one number)."""
    try:
        v = getattr(config, name, None)
    except Exception:  # noqa: BLE001 - e.g. transformers' per-layer attributes raise their own error type
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _check_fp8(model: Any, fp8: Any, family: Any, kind: str, ep_group: Any) -> None:
    """Raise before anything changes where ``parallelize(..., fp8=fp8)`` cannot run FP8 experts."""
    if not isinstance(fp8, bool):
        raise InvalidTypeError("fp8", fp8, "is not a bool", "pass True or False")
    if not fp8:
        return
    if family is None or family.moe is None:
        raise UnsupportedError("fp8", True, f"runs the expert-parallel blocks of the hand families "
                               f"{sorted(k for k, f in FAMILIES.items() if f.moe is not None)}; {kind} goes by "
                               f"{'its plans, whose experts run as the model defines them' if family is None else 'a dense family'}",
                               "pass fp8=False")
    if ep_group is None or dist.get_world_size(ep_group) < 2:
        raise UnsupportedError("fp8", True, "applies to expert-parallel blocks; there are none without an ep_group "
                               "of 2 or more ranks", "pass ep_group, or fp8=False")
    cfg = model.config
    ffn = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    for name, v in (("hidden_size", cfg.hidden_size), ("the experts' intermediate size", ffn)):
        if v % 128:
            raise InvalidArgumentError("fp8", True, f"needs {name} in whole blocks of 128; the model has {v}",
                                       "pass fp8=False")


def _parallelize_from_plans(model: Any, kind: str, tp_group: Any, ep_group: Any, sequence_parallel: bool,
                            strategy: str, moe_transport: Any, tp_override: dict[str, str] | None,
                            ep_override: dict[str, str] | None) -> Any:
    """``parallelize`` of a model by its own plans (``plans.py``): everything resolved and checked,
    then applied."""
    if sequence_parallel:
        raise UnsupportedError("sequence_parallel", True, f"is built for the families {sorted(FAMILIES)} alone "
                               f"({kind} goes by its plans, which do not say where its layers' norms are)",
                               "pass sequence_parallel=False")
    tp = dist.get_world_size(tp_group)
    ep = 1 if ep_group is None else dist.get_world_size(ep_group)
    _grid(tp_group, ep_group)
    tp_plan, ep_plan = plans.model_plans(model, {**PLAN_OVERRIDES.get(kind, {}), **(tp_override or {})}, ep_override)
    experts = plans.expert_modules(model, ep_plan, tp_plan)
    if tp > 1 and not tp_plan:
        raise UnsupportedError("tp_group", f"a group of {tp} ranks", f"{type(model).__name__} (model_type {kind!r}) "
                               "has no tensor-parallel plan (config.base_model_tp_plan)",
                               "pass tp_plan={...} naming its modules' styles, or tp_group=None")
    if ep > 1 and not experts:
        raise UnsupportedError("ep_group", f"a group of {ep} ranks", f"{type(model).__name__} (model_type {kind!r}) "
                               "has no experts module in its plans (config.base_model_ep_plan)",
                               "pass ep_group=None")
    if ep > 1:
        plans.check_experts(model, experts, ep)
    heads, kv, head_dim, rope = _head_sizes(model)
    ctx = plans.Context(model, tp_group, tp, strategy, heads, kv, head_dim, rope)
    steps = plans.resolve(model, tp_plan, experts) if tp > 1 else []
    if tp > 1:
        steps = _embedding_and_head(model, steps, tp, ctx.kept)
    plans.check(ctx, steps)  # everything that can refuse has refused: from here on the model changes
    if tp == 1 and ep == 1:
        return model
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and emb is not None and head.weight is emb.weight
    if ep > 1:
        plans.apply_experts(model, experts, ep_group, moe_transport, ctx.done)
    else:
        for path in experts:
            ctx.kept[path] = "experts kept whole on every rank (pass ep_group to split them)"
    plans.apply(ctx, steps)
    if tied and isinstance(model.get_input_embeddings(), VocabParallelEmbedding) and \
            isinstance(model.get_output_embeddings(), ColumnParallelLinear):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight  # the same rows of one table
    transports = sorted({m._commops_ep.dispatcher.transport for m in model.modules() if hasattr(m, "_commops_ep")})
    model.commops_parallel = {"family": kind, "source": "plan", "tp": tp, "ep": ep, "strategy": strategy,
                              "sequence_parallel": False, "moe_transport": transports[0] if transports else None,
                              "decode_norms": "off: built for the hand families (plans do not say where the norms are)",
                              "sharded": dict(ctx.done), "kept_whole": dict(ctx.kept)}
    return model


def _embedding_and_head(model: Any, steps: list[plans.PlanStep], tp: int, kept: dict[str, str]) -> list[plans.PlanStep]:
    """The plan's steps with the input embedding vocabulary-parallel where the plan does not name it
    (a plain table whose rows divide), and a tied head and embedding split alike or both kept whole."""
    names = {m: n for n, m in model.named_modules()}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    emb_path = names.get(emb)
    by_path = {s.path: s for s in steps}
    if emb_path is not None and emb_path not in by_path and plans.plain_embedding(emb) and \
            emb.num_embeddings % tp == 0:
        steps = [plans.PlanStep(emb_path, "embedding_rowwise", plans.STYLES["embedding_rowwise"], False), *steps]
        by_path[emb_path] = steps[0]
    tied = head is not None and emb is not None and getattr(head, "weight", None) is getattr(emb, "weight", 0)
    head_path = names.get(head)
    if tied and head_path is not None:
        e, h = by_path.get(emb_path or ""), by_path.get(head_path)
        alike = e is not None and h is not None and e.meaning is plans.STYLES["embedding_rowwise"] and \
            h.meaning is plans.STYLES["colwise_gather_output"]
        if not alike:
            steps = [s for s in steps if s.path not in (emb_path, head_path)]
            for p in (emb_path, head_path):
                kept[str(p)] = "the head is tied to the input embedding, and the two are not split alike by the plan"
    for p, why in ((emb_path, "not a plain table whose rows divide the group"), (head_path, "not in the plan")):
        if p is not None and p not in kept and p not in {s.path for s in steps}:
            kept[p] = why
    return steps
