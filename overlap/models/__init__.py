"""Parallelize a Hugging Face ``transformers`` causal LM in place with commops' layers.

``parallelize(model, tp_group=g)`` shards a model as Megatron-LM does, module by module, taking
each rank's slice of the weights the model already holds (so ``from_pretrained`` checkpoints work
unchanged, every rank loading the same one):

- attention: q, k and v column-parallel (rank r keeps heads ``r * H/p ...``, and the KV heads that
  go with them), o row-parallel (its all-reduce runs as ``gemm_all_reduce``, overlapped per
  ``strategy``); the model's own attention code runs on the local heads unchanged, as it sizes
  its views by ``head_dim`` and ``-1`` heads;
- the MLP: gate and up column-parallel, down row-parallel;
- modules kept whole but applied per head (Qwen3's q_norm and k_norm): their gradients summed
  over the group by a hook on their parameters;
- the embedding vocabulary-parallel (``VocabParallelEmbedding``: each rank's rows, then an
  all-reduce), the LM head column-parallel over the vocabulary with its logits all-gathered, so
  that the model's own loss, ``generate()`` and the KV cache (which holds the local heads) work as
  they do unsharded; a tied head shares the embedding's shard.

Which modules are which is written once per family (``families.py``); a model of another family is
refused by name before anything is changed. Everything is checked before the first module is
replaced (sizes that do not divide, a model that is not one we know), so a refused call leaves the
model as it was.

Not yet: expert parallelism (``ep_group``), ``sequence_parallel=True`` (Hugging Face's activations
are ``[batch, seq, hidden]``, where our sequence-parallel layers split dimension 0), and KV heads
fewer than the tensor-parallel size (replicated KV heads); each is refused with its own error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import collectives as C

from collectives.errors import InvalidArgumentError, InvalidTypeError, UnsupportedError

from ..layers import ColumnParallelLinear, RowParallelLinear
from ._vocab import VocabParallelEmbedding, reduce_from_group
from .families import FAMILIES, Family

__all__ = ["parallelize", "VocabParallelEmbedding", "reduce_from_group", "FAMILIES", "Family"]


def _family(model: Any) -> Family:
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if not isinstance(model, nn.Module) or kind is None:
        raise InvalidTypeError("model", model, "is not a transformers model (no config.model_type)",
                               "pass a transformers causal LM, e.g. AutoModelForCausalLM.from_pretrained(...)")
    family = FAMILIES.get(kind)
    if family is None:
        raise UnsupportedError("model", f"{type(model).__name__} (model_type {kind!r})", "is not a family parallelize "
                               "knows", f"use a model of one of {sorted(FAMILIES)}")
    return family


def _divides(what: str, n: int, size: int, fix: str) -> None:
    if n % size:
        raise InvalidArgumentError("tp_group", f"a group of {size} ranks", f"does not divide {what} ({n})", fix)


def _check(model: Any, family: Family, tp: int) -> None:
    """Every size the sharding splits, checked before any module is replaced."""
    c = model.config
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    _divides("the attention heads", heads, tp, f"use a tensor-parallel size that divides {heads}")
    if kv % tp:
        raise UnsupportedError("tp_group", f"a group of {tp} ranks", f"is larger than or does not divide the KV heads "
                               f"({kv}); replicated KV heads are not supported yet",
                               f"use a tensor-parallel size that divides {kv}")
    for layer in family.layers(model):
        for name in (*family.column, *family.row):
            lin = family.module(layer, name)
            if not isinstance(lin, nn.Linear):
                raise UnsupportedError("model", f"{name} = {type(lin).__name__}", "is not an nn.Linear (quantised "
                                       "or already parallelized?)", "pass the model as transformers builds it")
        for name in family.column:
            _divides(f"{name}'s {family.module(layer, name).out_features} output features",
                     family.module(layer, name).out_features, tp, "use a size that divides it")
        for name in family.row:
            _divides(f"{name}'s {family.module(layer, name).in_features} input features",
                     family.module(layer, name).in_features, tp, "use a size that divides it")
    vocab = model.get_input_embeddings().num_embeddings
    _divides("the vocabulary", vocab, tp, f"pad it to a multiple of {tp}: model.resize_token_embeddings(n, "
             f"pad_to_multiple_of={tp})")


def _summed_over(group: Any) -> Any:
    """A gradient hook: the sum of the ranks' gradients (each rank's is the part its heads gave)."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        total = grad.contiguous().clone()
        C.all_reduce(total, group=group)
        return total
    return hook


def parallelize(model: Any, *, tp_group: Any = None, ep_group: Any = None, sequence_parallel: bool = False,
                strategy: str = "auto") -> Any:
    """Shard ``model`` (a ``transformers`` causal LM, the same on every rank) in place over ``tp_group``.

    Args:
        model: a model of a family in ``FAMILIES`` (``config.model_type``), built or loaded the same way
            on every rank of ``tp_group``.
        tp_group: the tensor-parallel group (default: world). Collective: every rank of it calls this.
        ep_group: the expert-parallel group, for MoE families (not supported yet: refused).
        sequence_parallel: split the activations between the layer pairs along the sequence (not
            supported yet for these models: refused).
        strategy: the overlap operators' strategy for the row-parallel layers' all-reduce and the
            column-parallel layers' backward ("auto", "sequential", "chunked", "copy_engine").

    Returns:
        ``model``, whose forward on the same ids on every rank returns the unsharded model's logits
        (all gathered, ``[batch, seq, vocab]``) and whose parameters are this rank's shards (same
        names as before). ``model.config`` is left as it was (the full model's sizes).
    """
    family = _family(model)
    if ep_group is not None:
        raise UnsupportedError("ep_group", ep_group, f"expert parallelism is not supported for {family.name} yet",
                               "pass ep_group=None")
    if sequence_parallel:
        raise UnsupportedError("sequence_parallel", True, "is not supported for transformers models yet (their "
                               "activations are [batch, seq, hidden]; our sequence-parallel layers split dim 0)",
                               "pass sequence_parallel=False")
    if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
        raise InvalidTypeError("tp_group", tp_group, f"is a {type(tp_group).__name__}, not a process group",
                               "pass a torch.distributed.ProcessGroup (new_group) or None for the world")
    tp = dist.get_world_size(tp_group)
    _check(model, family, tp)
    if tp == 1:
        return model
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    tied = head is not None and head.weight is emb.weight
    for layer in family.layers(model):
        for name in family.column:
            family.replace(layer, name, ColumnParallelLinear.from_linear(family.module(layer, name), tp_group,
                                                                         strategy=strategy))
        for name in family.row:
            family.replace(layer, name, RowParallelLinear.from_linear(family.module(layer, name), tp_group,
                                                                      strategy=strategy))
        for name in family.per_head:
            for p in family.module(layer, name).parameters():
                p.register_hook(_summed_over(tp_group))
    new_emb = VocabParallelEmbedding.from_embedding(emb, tp_group)
    model.set_input_embeddings(new_emb)
    if head is not None:
        new_head = ColumnParallelLinear.from_linear(head, tp_group, gather_output=True, strategy=strategy)
        if tied:
            new_head.weight = new_emb.weight  # the same rows of the same table
        model.set_output_embeddings(new_head)
    model.commops_parallel = {"family": family.name, "tp": tp, "strategy": strategy}
    return model
