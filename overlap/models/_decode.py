"""A parallelized model's decoder layers at decode: each all-reduce, residual add and RMSNorm fused.

A decoder layer of the families we know is pre-norm:

    h   = x + o(attention(input_norm(x)))          # o: row-parallel, ends in an all-reduce
    out = h + down(mlp(post_norm(h)))               # down: row-parallel (a dense MLP)

and the next layer (or the model's final norm) begins with ``input_norm(out)``. At decode the
layer runs its own modules in the same order, but o and down return their partial sums
(``RowParallelLinear.deferred``) and each all-reduce goes into ``fused_all_reduce_rmsnorm``
with the residual add and the norm that follows it:

    y1, h   = fused(o_partial, x, post_norm)        # post_norm(h) as y1
    y2, out = fused(down_partial, h, next_norm)     # the next layer's input_norm(out) as y2

``y2`` is handed to the next layer (or the final norm), which takes it in place of its own norm
of ``out`` (``_Carry``: only for that very tensor, so anything else that reaches a layer is
normed as usual). A MoE block (expert parallel, or whole on every rank) has no row-parallel
down: there ``out = h + mlp(y1)`` as in the model. The norms keep their parameters; the layers
keep their class (a subclass of it, made here, with this forward) and their parameters' names.

"Decode" is a forward that autograd does not record (``generate()``'s, under ``no_grad``) of at
most ``DECODE_ROWS`` tokens without a sequence split; every other forward runs the model's own
code. The fused operator picks its kernel (``strategy="auto"``) and records why; the rounding
differs from the model's own order of operations within the dtype's (the operator's note).

One forward at a time per model, as for any tensor-parallel forward: every rank must issue the
group's collectives in one order, which two threads running the model at once would not keep.
The path's own state follows the same rule (the row layers' ``deferred`` flag is set for the
attention or MLP call and cleared after it); the carried norm is taken only for the very tensor
it is the norm of, so a forward that meets a stale one norms its input as usual. Under
``torch.compile`` the whole path is traced into one graph (``tests/test_compile_models.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layers import RowParallelLinear
from ..norm import DECODE_ROWS

__all__ = ["fuse_decode_norms"]


def _eps(norm: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        v = getattr(norm, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _fusable_norm(norm: Any) -> bool:
    w = getattr(norm, "weight", None)
    return isinstance(norm, nn.Module) and isinstance(w, torch.Tensor) and w.dim() == 1 and _eps(norm) is not None


class _Carry:
    """The last fused norm's output and the tensor it is the norm of, for the module that norms
    that tensor next."""

    def __init__(self) -> None:
        self.of: torch.Tensor | None = None
        self.y: torch.Tensor | None = None

    def put(self, of: torch.Tensor, y: torch.Tensor) -> None:
        self.of, self.y = of, y

    def take(self, x: torch.Tensor) -> torch.Tensor | None:
        of, y = self.of, self.y
        self.of = self.y = None
        return y if of is x else None


class _Plan:
    """One layer's decode path: the modules it calls and where its norm goes (the row layers
    reduce over their own group)."""

    def __init__(self, carry: _Carry, split: Any, o: RowParallelLinear, down: RowParallelLinear | None,
                 norm_names: tuple[str, str], attention: str, mlp: str, next_norm: nn.Module | None) -> None:
        self.carry, self.split = carry, split
        self.o, self.down = o, down
        self.input_norm, self.post_norm = norm_names
        self.attention, self.mlp = attention, mlp
        self.next_norm = next_norm if down is not None else None
        self.dtype = o.weight.dtype  # the norms' too (fuse_decode_norms checks): the operator takes one dtype

    def applies(self, x: torch.Tensor) -> bool:
        return not torch.is_grad_enabled() and x.dim() >= 2 and x.numel() // x.shape[-1] <= DECODE_ROWS \
            and x.dtype == self.dtype and not torch.is_autocast_enabled(x.device.type) \
            and (self.split is None or not self.split.active)

    def run(self, layer: nn.Module, x: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        y = layer.get_submodule(self.input_norm)(x)  # a _FusedNorm after the first layer: the carried norm
        self.o.deferred = True
        try:
            a = layer.get_submodule(self.attention)(hidden_states=y, **kwargs)
        finally:
            self.o.deferred = False
        a = a[0] if isinstance(a, tuple) else a
        y, h = _fused(a, x, self.o, layer.get_submodule(self.post_norm))
        mlp = layer.get_submodule(self.mlp)
        if self.down is None:
            m = mlp(y)
            return h + (m[0] if isinstance(m, tuple) else m)  # type: ignore[no-any-return]
        self.down.deferred = True
        try:
            m = mlp(y)
        finally:
            self.down.deferred = False
        if self.next_norm is None:  # nothing to norm next: the all-reduce and the add
            return _fused(m, h, self.down, layer.get_submodule(self.post_norm))[1]
        y2, out = _fused(m, h, self.down, self.next_norm)
        self.carry.put(out, y2)
        return out


def _fused(partial: torch.Tensor, residual: torch.Tensor, row: RowParallelLinear,
           norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    return row.reduce_rmsnorm(partial, residual, norm.weight, _eps(norm))  # type: ignore[arg-type]


class _FusedLayer(nn.Module):
    """The decode path in front of a decoder layer's own forward (mixed into a subclass of its class)."""

    _commops_decode: _Plan

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        plan = self._commops_decode
        if args or not plan.applies(hidden_states):
            return super().forward(hidden_states, *args, **kwargs)
        return plan.run(self, hidden_states, kwargs)


class _FusedNorm(nn.Module):
    """A norm that takes the fused norm of its input where the last layer made it."""

    _commops_carry: _Carry

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        y = self._commops_carry.take(x) if not args and not kwargs else None
        return y if y is not None else super().forward(x, *args, **kwargs)


_CLASSES: dict[tuple[type, type], type] = {}


def _subclass(module: nn.Module, mixin: type) -> None:
    """Give ``module`` a class of the same name that puts ``mixin``'s forward in front of its own."""
    cls = type(module)
    if issubclass(cls, mixin):
        return
    new = _CLASSES.get((cls, mixin))
    if new is None:
        new = _CLASSES[(cls, mixin)] = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__,
                                                                          "__qualname__": cls.__qualname__})
    module.__class__ = new


def fuse_decode_norms(model: Any, family: Any, split: Any) -> str:
    """Put the decode path on every decoder layer of tensor-parallel ``model`` (``split``: its
    sequence split, or None). No collective; no parameter changes. Returns what was done and
    why (for ``model.commops_parallel["decode_norms"]``)."""
    layers = family.layers(model)
    attention, o_name = family.attention, f"{family.attention}.o_proj"
    norm_names = (family.input_norm, family.post_norm)
    final = model.get_submodule(family.final_norm)
    for layer in layers:
        if not all(_fusable_norm(layer.get_submodule(n)) for n in norm_names) or \
                not isinstance(layer.get_submodule(o_name), RowParallelLinear):
            return (f"off: a layer lacks an RMSNorm with weight and epsilon at {norm_names} or a row-parallel "
                    f"{o_name}")
        dtypes = {layer.get_submodule(n).weight.dtype for n in (*norm_names, o_name)}
        if len(dtypes) > 1:
            return f"off: a layer's norms and projections have different dtypes ({sorted(map(str, dtypes))})"
    carry = _Carry()
    chained = _fusable_norm(final) and final.weight.dtype == layers[-1].get_submodule(o_name).weight.dtype
    for i, layer in enumerate(layers):
        down = layer.get_submodule(f"{family.mlp}.down_proj") if family.moe_block(layer) is None else None
        nxt = layers[i + 1].get_submodule(family.input_norm) if i + 1 < len(layers) else (final if chained else None)
        layer._commops_decode = _Plan(carry, split, layer.get_submodule(o_name),
                                      down if isinstance(down, RowParallelLinear) else None, norm_names, attention,
                                      family.mlp, nxt)
        _subclass(layer, _FusedLayer)
    for layer in layers[1:]:
        norm = layer.get_submodule(family.input_norm)
        norm._commops_carry = carry
        _subclass(norm, _FusedNorm)
    if chained:
        final._commops_carry = carry
        _subclass(final, _FusedNorm)
    return (f"on: forwards without autograd of at most {DECODE_ROWS} tokens fuse each all-reduce with the residual "
            "add and the next RMSNorm (fused_all_reduce_rmsnorm, strategy auto; overlap.last_choice says which kernel)")
