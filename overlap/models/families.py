"""Which modules of each ``transformers`` family ``parallelize`` shards, written once per family.

A family is its decoder layers and the dotted names, inside a layer, of the linear layers that are
column-parallel (their output features split) and row-parallel (their input features split). A
family whose modules carry these names with these meanings is one more entry in ``FAMILIES``;
an entry is added only with a test that runs that family (``tests/test_models_parallelize.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Family", "FAMILIES", "PLAN_OVERRIDES", "LLAMA", "QWEN3", "QWEN3_MOE", "MIXTRAL"]


@dataclass(frozen=True)
class Family:
    """How to find a family's decoder layers and the linear layers to shard in each.

    Attributes:
        name: what errors and ``model.commops_parallel`` call it.
        decoder_layers: the model's decoder layers, in order.
        column: dotted names (inside a layer) of the column-parallel linears: q, k, v and the
            MLP's gate and up.
        row: those of the row-parallel linears: o and the MLP's down.
        per_head: dotted names of modules kept whole on every rank but applied to each rank's own
            heads (Qwen3's q_norm and k_norm): each rank's gradient of their parameters is a part
            of the whole, so the parts are summed over the group in the backward pass.
        moe: the dotted name of a layer's MLP where it may be a sparse MoE block (one with
            ``experts``), or None for a dense family. In a layer whose MLP is one, the names in
            ``column`` and ``row`` that start with ``"{moe}."`` are not sharded: the block goes
            over expert parallelism instead (``ExpertParallelMoE``), or stays whole.
        attention: the dotted name of a layer's attention module, whose ``num_key_value_groups``
            (query heads per KV head) is set to the local count when KV heads are replicated.
        mlp: the dotted name of a layer's MLP (dense or MoE); final_norm: that of the norm after
            the last layer, from the model's root (both where sequence parallelism gathers).
        kv: the names in ``column`` of the k and v projections, replicated per KV head when the
            KV heads are fewer than the ranks (``_kv.py``).
        input_norm, post_norm: the dotted names of a layer's RMSNorms before the attention and
            before the MLP (where decode fuses the all-reduces with them, ``_decode.py``).
    """

    name: str
    decoder_layers: Callable[[Any], Iterable[nn.Module]]
    column: tuple[str, ...]
    row: tuple[str, ...]
    per_head: tuple[str, ...] = ()
    moe: str | None = None
    attention: str = "self_attn"
    mlp: str = "mlp"
    final_norm: str = "model.norm"
    kv: tuple[str, ...] = ("self_attn.k_proj", "self_attn.v_proj")
    input_norm: str = "input_layernorm"
    post_norm: str = "post_attention_layernorm"

    def layers(self, model: Any) -> list[nn.Module]:
        return list(self.decoder_layers(model))

    def moe_block(self, layer: nn.Module) -> nn.Module | None:
        """The layer's sparse MoE block, or None (a dense layer)."""
        if self.moe is None:
            return None
        block = layer.get_submodule(self.moe)
        return block if hasattr(block, "experts") and hasattr(block, "gate") else None

    def sharded(self, layer: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The (column, row) linears of this layer that tensor parallelism splits."""
        if self.moe_block(layer) is None:
            return self.column, self.row
        inside = f"{self.moe}."
        return (tuple(n for n in self.column if not n.startswith(inside)),
                tuple(n for n in self.row if not n.startswith(inside)))

    @staticmethod
    def module(layer: nn.Module, dotted: str) -> Any:
        return layer.get_submodule(dotted)

    @staticmethod
    def replace(layer: nn.Module, dotted: str, new: nn.Module) -> None:
        parent, _, leaf = dotted.rpartition(".")
        setattr(layer.get_submodule(parent) if parent else layer, leaf, new)


def _decoder_layers(model: Any) -> Iterable[nn.Module]:
    return model.model.layers  # type: ignore[no-any-return]


_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj")
_ROW = ("self_attn.o_proj", "mlp.down_proj")

# Llama: model.model.layers[i].self_attn.{q,k,v,o}_proj and .mlp.{gate,up,down}_proj.
LLAMA = Family("llama", _decoder_layers, column=_ATTENTION + _MLP, row=_ROW)
# Qwen3 (dense): Llama's modules plus an RMSNorm over each head's dim of q and of k.
QWEN3 = Family("qwen3", _decoder_layers, column=_ATTENTION + _MLP, row=_ROW,
               per_head=("self_attn.q_norm", "self_attn.k_norm"))

# Qwen3-MoE: Qwen3's attention; each layer's mlp a sparse block (gate: top-k router with
# norm_topk_prob; experts: fused gate_up_proj / down_proj) or, in mlp_only_layers, a dense MLP.
QWEN3_MOE = Family("qwen3_moe", _decoder_layers, column=_ATTENTION + _MLP, row=_ROW,
                   per_head=("self_attn.q_norm", "self_attn.k_norm"), moe="mlp")

# Mixtral: Llama's attention; every layer's mlp a sparse block (gate: top-k router, always
# renormalised; experts: fused gate_up_proj / down_proj).
MIXTRAL = Family("mixtral", _decoder_layers, column=_ATTENTION + _MLP, row=_ROW, moe="mlp")

FAMILIES: dict[str, Family] = {"llama": LLAMA, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL}

# What a family's own plan leaves out, laid over it by ``parallelize`` before the caller's ``tp_plan``
# (each one found by the zoo, ``bench/model_zoo.py``: a gradient of the sharded model that was a
# part of the unsharded one's). A per-head norm or an activation between the column- and the
# row-parallel layers sees only this rank's heads or features, so its parameters' gradients are
# partial sums: ``replicated_with_grad_allreduce`` sums them over the group.
_PER_HEAD_NORMS = {"model.layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
                   "model.layers.*.self_attn.k_norm": "replicated_with_grad_allreduce"}
_TRAINED_ACTIVATION = {"model.layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}  # xIELU's alpha_p, alpha_n
# Doge's dynamic mask: dt_proj maps every KV head's values to one number per KV head, and A scales
# them; its plan makes dt_proj rowwise (every head's number, summed) and leaves A whole, so the mask
# has every KV head where the attention has this rank's. Each rank keeps its heads' share of both.
# (Its q_norm and k_norm are per-head norms the plan does not name either.)
_DOGE_MASK = {"model.layers.*.self_attn.dt_proj": "rowwise_own_output", "model.layers.*.self_attn.A": "colwise",
              **_PER_HEAD_NORMS}
PLAN_OVERRIDES: dict[str, dict[str, str]] = {
    "param2moe": _PER_HEAD_NORMS,  # the plan shards q/k/v but does not name q_norm and k_norm
    "sarvam_moe": _PER_HEAD_NORMS,
    "apertus": _TRAINED_ACTIVATION,
    "apertus1p5_text": _TRAINED_ACTIVATION,
    "doge": _DOGE_MASK,
}
