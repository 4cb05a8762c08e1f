"""Parallelize any ``transformers`` model from its own tensor- and expert-parallel plans.

A ``transformers`` model names, for each module it can shard, a style: ``config.base_model_tp_plan``
and the model class's ``_tp_plan`` (the head) for tensor parallelism, ``base_model_ep_plan`` for
expert parallelism, merged by the model into ``model._tp_plan`` / ``model._ep_plan`` with ``*``
for a layer's number (``"model.layers.*.self_attn.q_proj": "colwise"``). ``parallelize`` reads
those plans and maps each style onto commops' layers (``STYLES``): the meaning of a style is the
layout of its module's input and output (replicated, or split along the features), which is
what decides the layer; how ``transformers`` itself realises it (DTensor placements) is not used.

What each style becomes here:

- ``colwise`` (and ``unit_colwise``): ``ColumnParallelLinear`` (output features split, the local
  heads' output; the input gradient all-reduced over ``gemm``'s overlap strategy); a k or v
  projection whose KV heads are fewer than the ranks is replicated per KV head (``_kv.py``).
- ``colwise_gather_output`` / ``colwise_rep``: the same with the output all-gathered (a packed
  projection that the model splits itself, the LM head).
- ``rowwise``: ``RowParallelLinear`` (input features split; ``gemm_all_reduce``);
  ``rowwise_split_input`` / ``rowwise_rep``: the same taking a replicated input and its slice.
- ``rowwise_own_output`` (ours, for overrides): row-parallel, then this rank's share of the summed
  output's features (a per-head projection of every head's values, Doge's ``dt_proj``).
- ``packed_colwise`` on a linear: its two packed halves each split, so a rank's rows are its gate
  rows then its up rows and the model's own ``chunk(2)`` finds them.
- ``embedding_rowwise`` / ``embedding_colwise``: ``VocabParallelEmbedding`` (the table's rows split;
  a scaled embedding keeps its scale); the input embedding is split so by default, as Megatron
  does, and a tied head shares its shard.
- ``replicated_with_grad_allreduce``: kept whole, its parameters' gradients summed over the group
  (a per-head norm sees only this rank's heads).
- ``mla_kv_a_proj``: kept whole; the gradient of its output's rotary part, which reaches the
  attention's local heads alone, is summed over the group (the rest goes through a column layer).
- ``all_reduce``: the module's output (a partial sum) all-reduced; where its own parameters are
  split by parameter entries, its inputs' gradients (each rank's part) are summed too.
- an experts module's styles (``grouped_gemm``, ``ep_dispatch_experts``, ``ep_router``,
  ``moe_tp_experts``, ``packed_rowwise``) with ``ep_group``: the module over
  ``MoEDispatcher`` (``experts_over_dispatcher``: whole experts per rank, the model's own expert
  code); without it, the experts are kept whole on every rank (tensor-parallel experts would split
  each expert's FFN, whose layout differs per family: interleaved or packed, ``[in, out]`` or
  ``[out, in]``).
- ``replicate``, ``sequence_parallel``, ``local_params``, ``local``: nothing to do (kept whole;
  commops' sequence parallelism is the hand families' ``sequence_parallel=True``).
- a plan entry naming a parameter (attention sinks): its rows of the heads' dimension.

Everything is resolved and checked before the first module changes; a style this table does not
know, a module that is not what the style shards, or a size that does not divide raises a typed
error naming the module's dotted path, and the model is left as it was. ``tp_plan=`` and
``ep_plan=`` override entries (``"replicate"`` keeps a module whole).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from collectives.errors import InvalidArgumentError, UnsupportedError

from ..layers import ColumnParallelLinear, RowParallelLinear, _SumGradOverRanks
from ._experts import experts_count, experts_over_dispatcher
from ._kv import replicated_kv_linear
from ._sequence import summed_over
from ._vocab import VocabParallelEmbedding, reduce_from_group

__all__ = ["STYLES", "Style", "PlanStep", "model_plans", "resolve", "apply"]


def _wildcard(name: str) -> str:
    """``model.layers.3.mlp`` -> ``model.layers.*.mlp``: how the plans name every layer's module."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def model_plans(model: Any, tp_override: dict[str, str] | None = None,
                ep_override: dict[str, str] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The model's merged tensor- and expert-parallel plans (glob keys from the model's root), with
    the overrides laid over them."""
    tp = dict(getattr(model, "_tp_plan", None) or {})
    ep = dict(getattr(model, "_ep_plan", None) or {})
    if not tp and not ep:  # a model built without post_init's merge: read the config's own
        prefix = getattr(model, "base_model_prefix", "model")
        config = model.config
        tp = {f"{prefix}.{k}": v for k, v in (getattr(config, "base_model_tp_plan", None) or {}).items()}
        ep = {f"{prefix}.{k}": v for k, v in (getattr(config, "base_model_ep_plan", None) or {}).items()}
        tp.update(getattr(type(model), "_tp_plan", None) or {})
    tp.update(tp_override or {})
    ep.update(ep_override or {})
    return tp, ep


@dataclass
class Context:
    """What a style needs beyond its module: the group, the model's head sizes, and what was done."""

    model: Any
    group: Any
    tp: int
    strategy: str
    heads: int
    kv_heads: int
    head_dim: int | None
    rope_dim: int | None
    kept: dict[str, str] = field(default_factory=dict)
    done: dict[str, str] = field(default_factory=dict)

    def refuse(self, path: str, style: str, why: str, fix: str) -> UnsupportedError:
        return UnsupportedError("model", f"{path} (style {style!r})", why, fix)


def _keep_fix(path: str) -> str:
    return f"pass tp_plan={{{path!r}: 'replicate'}} to keep it whole, or tp_group=None"


@dataclass(frozen=True)
class Style:
    """One plan style's meaning here: ``check`` raises before anything changes, ``apply`` changes
    the module (or parameter) at ``path``; ``what`` is the one line ``model.commops_parallel`` records."""

    what: str
    check: Callable[[Context, str, str, Any], None]
    apply: Callable[[Context, str, str, Any], None]


def _is_linear(m: Any) -> bool:
    return isinstance(m, nn.Linear) and not isinstance(m, (ColumnParallelLinear, RowParallelLinear))


def _need_linear(ctx: Context, path: str, style: str, m: Any) -> None:
    if not _is_linear(m):
        raise UnsupportedError("model", f"{path} = {type(m).__name__} (style {style!r})", "is not an nn.Linear "
                               "(quantised, fused or already parallelized?)", _keep_fix(path))


def _divides(path: str, style: str, what: str, n: int, tp: int) -> None:
    if n % tp:
        raise InvalidArgumentError("tp_group", f"a group of {tp} ranks", f"does not divide {path}'s {n} {what} "
                                   f"(style {style!r})", f"use a tensor-parallel size that divides {n}, or pass "
                                   f"tp_plan={{{path!r}: 'replicate'}}")


def _leaf(path: str) -> str:
    return path.rpartition(".")[2]


def _kv_replicated(ctx: Context, path: str, m: nn.Linear) -> bool:
    """A k or v projection of whole KV heads that are fewer than the ranks."""
    return (_leaf(path) in ("k_proj", "v_proj") and ctx.head_dim is not None and ctx.kv_heads < ctx.tp
            and m.out_features == ctx.kv_heads * ctx.head_dim)


def _check_column(ctx: Context, path: str, style: str, m: Any) -> None:
    _need_linear(ctx, path, style, m)
    if _kv_replicated(ctx, path, m):
        if ctx.tp % ctx.kv_heads:
            raise InvalidArgumentError("tp_group", f"a group of {ctx.tp} ranks", f"neither divides the "
                                       f"{ctx.kv_heads} KV heads of {path} nor is a multiple of them",
                                       f"use a tensor-parallel size that divides {ctx.kv_heads} or a multiple of it")
        return
    _divides(path, style, "output features", m.out_features, ctx.tp)
    hd = ctx.head_dim
    if hd and _leaf(path) in ("q_proj", "k_proj", "v_proj") and m.out_features % hd == 0:
        _divides(path, style, "heads", m.out_features // hd, ctx.tp)


def _replace(ctx: Context, path: str, new: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(ctx.model.get_submodule(parent) if parent else ctx.model, leaf, new)


def _column(gather: bool) -> Callable[[Context, str, str, Any], None]:
    def apply(ctx: Context, path: str, style: str, m: Any) -> None:
        if not gather and _kv_replicated(ctx, path, m):
            _replace(ctx, path, replicated_kv_linear(m, ctx.group, ctx.kv_heads, strategy=ctx.strategy))
            attention = ctx.model.get_submodule(path.rpartition(".")[0])
            if hasattr(attention, "num_key_value_groups"):  # the model repeats each local KV head this often
                attention.num_key_value_groups = ctx.heads // ctx.tp
            return
        _replace(ctx, path, ColumnParallelLinear.from_linear(m, ctx.group, gather_output=gather,
                                                             strategy=ctx.strategy))
    return apply


def _check_packed(ctx: Context, path: str, style: str, m: Any) -> None:
    _need_linear(ctx, path, style, m)
    _divides(path, style, "output features (two packed halves)", m.out_features, 2 * ctx.tp)


def _apply_packed(ctx: Context, path: str, style: str, m: Any) -> None:
    """Reorder the halves' rows so that rank r's contiguous block is [its gate rows; its up rows]."""
    tp, n = ctx.tp, m.out_features // (2 * ctx.tp)
    with torch.no_grad():
        m.weight.copy_(m.weight.view(2, tp, n, -1).transpose(0, 1).reshape_as(m.weight))
        if m.bias is not None:
            m.bias.copy_(m.bias.view(2, tp, n).transpose(0, 1).reshape_as(m.bias))
    _replace(ctx, path, ColumnParallelLinear.from_linear(m, ctx.group, strategy=ctx.strategy))


def _check_row(ctx: Context, path: str, style: str, m: Any) -> None:
    _need_linear(ctx, path, style, m)
    _divides(path, style, "input features", m.in_features, ctx.tp)


def _row(split_input: bool) -> Callable[[Context, str, str, Any], None]:
    def apply(ctx: Context, path: str, style: str, m: Any) -> None:
        _replace(ctx, path, RowParallelLinear.from_linear(m, ctx.group, input_is_parallel=not split_input,
                                                          strategy=ctx.strategy))
    return apply


def _check_row_own(ctx: Context, path: str, style: str, m: Any) -> None:
    _check_row(ctx, path, style, m)
    _divides(path, style, "output features", m.out_features, ctx.tp)


def _own_share(group: Any) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        n = out.shape[-1] // dist.get_world_size(group)
        return out.narrow(-1, dist.get_rank(group) * n, n)
    return hook


def _apply_row_own(ctx: Context, path: str, style: str, m: Any) -> None:
    _row(False)(ctx, path, style, m)
    ctx.model.get_submodule(path).register_forward_hook(_own_share(ctx.group))


def plain_embedding(m: Any) -> bool:
    """An ``nn.Embedding`` whose forward is the table's lookup, or that lookup times its ``embed_scale``."""
    if not isinstance(m, nn.Embedding) or isinstance(m, VocabParallelEmbedding):
        return False
    if type(m).forward is nn.Embedding.forward:
        return True
    scale = getattr(m, "embed_scale", None)
    return isinstance(scale, (torch.Tensor, float, int)) and type(m).__mro__[1] is nn.Embedding


def _check_embedding(ctx: Context, path: str, style: str, m: Any) -> None:
    if not plain_embedding(m):
        raise UnsupportedError("model", f"{path} = {type(m).__name__} (style {style!r})", "is not an nn.Embedding "
                               "whose forward is the lookup (or the lookup times embed_scale)", _keep_fix(path))
    _divides(path, style, "rows (the vocabulary)", m.num_embeddings, ctx.tp)


def _scaled(scale: Any) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        s = scale.to(out.dtype) if isinstance(scale, torch.Tensor) else scale
        return out * s
    return hook


def _apply_embedding(ctx: Context, path: str, style: str, m: Any) -> None:
    new = VocabParallelEmbedding.from_embedding(m, ctx.group)
    scale = getattr(m, "embed_scale", None)
    if type(m).forward is not nn.Embedding.forward and scale is not None:
        new.register_buffer("embed_scale", scale.clone() if isinstance(scale, torch.Tensor) else torch.tensor(scale),
                            persistent=False)
        new.register_forward_hook(_scaled(new.embed_scale))
    _replace(ctx, path, new)


def _check_any(ctx: Context, path: str, style: str, m: Any) -> None:
    if not isinstance(m, nn.Module):
        raise ctx.refuse(path, style, "is not a module", _keep_fix(path))


def _apply_grad_sum(ctx: Context, path: str, style: str, m: Any) -> None:
    for p in m.parameters():
        p.register_hook(summed_over(ctx.group))


def _check_mla(ctx: Context, path: str, style: str, m: Any) -> None:
    _check_any(ctx, path, style, m)
    if not ctx.rope_dim:
        raise UnsupportedError("model", f"{path} (style {style!r})", "needs config.qk_rope_head_dim, which the "
                               "config lacks", _keep_fix(path))


def _rope_grad_summed(group: Any, rope: int) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        rest, rot = out.split([out.shape[-1] - rope, rope], dim=-1)
        return torch.cat([rest, _SumGradOverRanks.apply(rot, group)], dim=-1)
    return hook


def _apply_mla(ctx: Context, path: str, style: str, m: Any) -> None:
    assert ctx.rope_dim
    m.register_forward_hook(_rope_grad_summed(ctx.group, ctx.rope_dim))


def _reduced(group: Any) -> Callable[[nn.Module, Any, Any], Any]:
    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        return None if out is None else reduce_from_group(out, group)
    return hook


def _apply_all_reduce(ctx: Context, path: str, style: str, m: Any) -> None:
    m.register_forward_hook(_reduced(ctx.group))


def _nothing(ctx: Context, path: str, style: str, m: Any) -> None:
    return None


def _param_dim(p: torch.Tensor, colwise: bool) -> int:
    return max(p.dim() - 2, 0) if colwise else p.dim() - 1


def _param_check(colwise: bool) -> Callable[[Context, str, str, Any], None]:
    def check(ctx: Context, path: str, style: str, p: Any) -> None:
        if not isinstance(p, torch.Tensor) or p.dim() == 0:
            raise ctx.refuse(path, style, "is not a parameter with a dimension to split", _keep_fix(path))
        if not colwise and p.dim() == 1:
            return  # a row style's bias: kept whole
        d = _param_dim(p, colwise)
        _divides(path, style, f"entries along dimension {d}", int(p.shape[d]), ctx.tp)
    return check


def _param_apply(colwise: bool) -> Callable[[Context, str, str, Any], None]:
    def apply(ctx: Context, path: str, style: str, p: Any) -> None:
        if not colwise and p.dim() == 1:
            return
        owner_path, _, name = path.rpartition(".")
        owner = ctx.model.get_submodule(owner_path)
        d, rank = _param_dim(p, colwise), dist.get_rank(ctx.group)
        n = p.shape[d] // ctx.tp
        with torch.no_grad():
            shard = p.detach().narrow(d, rank * n, n).clone()
        setattr(owner, name, nn.Parameter(shard, requires_grad=p.requires_grad))
    return apply


_COLUMN = Style("column-parallel (ColumnParallelLinear)", _check_column, _column(False))
_GATHERED = Style("column-parallel, output all-gathered", _check_column, _column(True))
_ROW = Style("row-parallel (RowParallelLinear, gemm_all_reduce)", _check_row, _row(False))
_ROW_SPLIT = Style("row-parallel of a replicated input", _check_row, _row(True))
_EMBEDDING = Style("vocabulary-parallel (VocabParallelEmbedding)", _check_embedding, _apply_embedding)
_KEEP = Style("kept whole", _check_any, _nothing)
_EXPERTS = Style("experts: over expert parallelism with ep_group, else kept whole", _check_any, _nothing)

# style name (every name the installed transformers versions use, 5.17 to 5.25) -> its meaning here
STYLES: dict[str, Style] = {
    "colwise": _COLUMN, "unit_colwise": _COLUMN, "local_colwise": _COLUMN,
    "colwise_gather_output": _GATHERED, "colwise_rep": _GATHERED, "gather": _GATHERED,
    "rowwise": _ROW, "unit_rowwise": _ROW, "local_rowwise": _ROW,
    "rowwise_split_input": _ROW_SPLIT, "rowwise_rep": _ROW_SPLIT,
    "rowwise_own_output": Style("row-parallel, then this rank's share of the output features", _check_row_own,
                                _apply_row_own),
    "packed_colwise": Style("column-parallel, two packed halves split alike", _check_packed, _apply_packed),
    "embedding_rowwise": _EMBEDDING, "embedding_colwise": _EMBEDDING,
    "replicated_with_grad_allreduce": Style("kept whole, gradients summed over the group", _check_any,
                                            _apply_grad_sum),
    "mla_kv_a_proj": Style("kept whole, the rotary part's gradient summed over the group", _check_mla, _apply_mla),
    "all_reduce": Style("output all-reduced", _check_any, _apply_all_reduce),
    "replicate": _KEEP, "sequence_parallel": _KEEP, "local_params": _KEEP, "local": _KEEP,
    "grouped_gemm": _EXPERTS, "ep_dispatch_experts": _EXPERTS, "ep_router": _KEEP, "moe_tp_experts": _EXPERTS,
    "packed_rowwise": _EXPERTS, "local_packed_rowwise": _EXPERTS, "megamoe_experts": _EXPERTS,
    "megamoe_router": _KEEP, "moe_identity_expert": _KEEP,
}
# a plan entry that names a parameter rather than a module
_PARAM_STYLES: dict[str, Style] = {
    "colwise": Style("its rows of the heads' dimension", _param_check(True), _param_apply(True)),
    "rowwise": Style("its slice of the last dimension", _param_check(False), _param_apply(False)),
}
for _alias, _base in (("unit_colwise", "colwise"), ("local_colwise", "colwise"), ("rowwise_split_input", "rowwise"),
                      ("local_rowwise", "rowwise")):
    _PARAM_STYLES[_alias] = _PARAM_STYLES[_base]
_EXPERT_STYLES = {"ep_dispatch_experts", "moe_tp_experts", "megamoe_experts"}


@dataclass(frozen=True)
class PlanStep:
    """One resolved plan entry: a concrete dotted path, its style's name and meaning."""

    path: str
    style: str
    meaning: Style
    param: bool


def _names(model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Parameter]]:
    return dict(model.named_modules()), dict(model.named_parameters(remove_duplicate=False))


def expert_modules(model: nn.Module, ep: dict[str, str], tp: dict[str, str]) -> list[str]:
    """The dotted paths of the model's experts modules (those an expert style names, in either plan)."""
    modules, _ = _names(model)
    styled = {k for plan in (ep, tp) for k, v in plan.items() if v in _EXPERT_STYLES}
    return [n for n, m in modules.items() if n and _wildcard(n) in styled]


def resolve(model: nn.Module, plan: dict[str, str], skip: list[str]) -> list[PlanStep]:
    """The plan's entries at concrete paths, in the model's module order; entries under one of
    ``skip`` (experts modules, and their parameters) left out. Raises on an unknown style."""
    modules, params = _names(model)
    steps: list[PlanStep] = []
    inside = tuple(f"{s}." for s in skip)
    for name in [*modules, *params]:
        if not name:
            continue
        style = plan.get(_wildcard(name))
        if style is None or name in skip or name.startswith(inside):
            continue
        is_param = name in params and name not in modules
        table = _PARAM_STYLES if is_param else STYLES
        meaning = table.get(style)
        if meaning is None:
            raise UnsupportedError("model", f"{name} (style {style!r})", "names a style parallelize does not map"
                                   + (" onto a parameter" if is_param else ""),
                                   f"pass tp_plan={{{_wildcard(name)!r}: 'replicate'}} (kept whole) or one of "
                                   f"{sorted(table)}")
        steps.append(PlanStep(name, style, meaning, is_param))
    return steps


def target(model: nn.Module, step: PlanStep) -> Any:
    if step.param:
        owner, _, name = step.path.rpartition(".")
        return getattr(model.get_submodule(owner), name)
    return model.get_submodule(step.path)


def check(ctx: Context, steps: list[PlanStep]) -> None:
    for step in steps:
        step.meaning.check(ctx, step.path, step.style, target(ctx.model, step))


def _input_grad_summed(group: Any) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]:
    """A forward pre-hook: each floating-point tensor input's gradient summed over ``group``."""
    def summed(x: Any) -> Any:
        return _SumGradOverRanks.apply(x, group) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return tuple(summed(a) for a in args), {k: summed(v) for k, v in kwargs.items()}
    return hook


def apply(ctx: Context, steps: list[PlanStep]) -> None:
    for step in steps:
        step.meaning.apply(ctx, step.path, step.style, target(ctx.model, step))
        ctx.done[step.path] = f"{step.style}: {step.meaning.what}"
    for step in steps:
        # an all-reduced module whose own parameters are split (no column layer sums its input's
        # gradient, as ColumnParallelLinear does): each rank's input gradients are parts, summed here
        if step.style == "all_reduce" and any(s.param and s.path.startswith(step.path + ".") for s in steps):
            ctx.model.get_submodule(step.path).register_forward_pre_hook(_input_grad_summed(ctx.group),
                                                                         with_kwargs=True)


def check_experts(model: nn.Module, paths: list[str], ep: int) -> None:
    """Every experts module holds ``E`` experts in ``[E, ...]`` parameters, ``E`` divisible by ``ep``."""
    for path in paths:
        m = model.get_submodule(path)
        n = experts_count(m)
        params = dict(m.named_parameters(recurse=False))
        odd = [k for k, p in params.items() if p.dim() == 0 or p.shape[0] != n]
        if not params or odd:
            raise UnsupportedError("model", f"{path} = {type(m).__name__}", f"has parameters {odd or 'none'} that "
                                   f"are not [{n} experts, ...]", "leave ep_group=None for this model")
        takes = [q for q in inspect.signature(type(m).forward).parameters.values()
                 if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
        if len(takes) < 4:  # self, hidden_states, top_k_index, top_k_weights
            names = ", ".join(q.name for q in takes[1:])
            raise UnsupportedError("model", f"{path} = {type(m).__name__}", f"takes ({names}), not the experts "
                                   "contract (hidden_states, top_k_index, top_k_weights) that the exchange calls",
                                   "leave ep_group=None for this model")
        if n % ep:
            raise InvalidArgumentError("ep_group", f"a group of {ep} ranks", f"does not divide the {n} experts of "
                                       f"{path}", f"use an expert-parallel size that divides {n}")


def apply_experts(model: nn.Module, paths: list[str], group: Any, transport: Any, done: dict[str, str]) -> None:
    for path in paths:
        experts_over_dispatcher(model.get_submodule(path), group, transport)
        done[path] = "experts over expert parallelism (MoEDispatcher; the model's own expert code)"
