"""A ``transformers`` MoE block (Qwen3-MoE, Mixtral) run over expert parallelism with commops' dispatcher.

``ExpertParallelMoE(block, ep_group)`` keeps the block's own router module (its top-k, its
normalisation: the model's routing exactly) and this rank's experts as a ``GroupedSwiGLU``
(rank r: experts ``r*E/W ... (r+1)*E/W - 1``, taken from the block's fused ``gate_up_proj`` and
``down_proj``), and sends the rows through ``MoEDispatcher``.

The ranks of ``ep_group`` hold the same activations (the model is split over them, as over the
tensor-parallel group; data parallelism is outside). So that no token is computed twice, each rank
takes ``1/W`` of the tokens into the exchange (padded to a multiple of ``W``), and the ranks'
outputs are all-gathered back; in the backward pass each rank's gradient of the gathered output
is its own slice, and the gradient of the input is the all-gather of the slices' gradients. The
router is replicated and sees only this rank's tokens, so its gradient is summed over the group.

Rejected: every rank routing every token and its local experts computing all the rows they own,
then an all-reduce of the outputs (``transformers``' own expert parallelism): it needs no
exchange of rows, but each rank routes and gathers the whole batch, and the all-reduce moves the
whole output; here each rank routes a W-th and the exchange moves only the rows that travel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from collectives import functional as F
from collectives.errors import UnsupportedError

from ..moe import GroupedSwiGLU, MoEDispatcher, register_block, routed_block
from ._decode import _subclass
from ._sequence import summed_over

__all__ = ["ExpertParallelMoE", "experts_over_dispatcher", "experts_count", "distinct_experts"]

# torch 2.11's compiled autograd gave this block's input a wrong gradient (its experts' and router's
# were right; measured against eager on Gloo, tests/test_compile_models.py, 0.02 off in the
# embedding's); 2.13's is right. Before 2.13 the block runs eagerly inside compiled code: one graph
# break per block, and correct gradients.
_EAGER_BLOCK = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def _call(fn: Any, x: torch.Tensor) -> torch.Tensor:
    return fn(x)  # type: ignore[no-any-return]


# (decorated only where it is used: ``torch.compiler.disable`` imports dynamo, 2 s per process)
_eager = torch.compiler.disable(_call) if _EAGER_BLOCK else _call


class _TakeRows(torch.autograd.Function):
    """Forward: this rank's block of rows of a replicated ``[W*n, ...]``; backward: the all-gather."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group, world, rank = group, dist.get_world_size(group), dist.get_rank(group)
        n = x.shape[0] // world
        return x[rank * n:(rank + 1) * n].contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return _gather_rows(g.contiguous(), ctx.group), None


class _GatherRows(torch.autograd.Function):
    """Forward: the ranks' ``[n, ...]`` blocks all-gathered in rank order; backward: this rank's block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank, ctx.n = dist.get_rank(group), x.shape[0]
        return _gather_rows(x.contiguous(), group)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        return g[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n].contiguous(), None


def _gather_rows(x: torch.Tensor, group: Any) -> torch.Tensor:
    # the functional all-gather (a new tensor), not the in-place verb into an empty one: under
    # torch 2.11's compiled autograd the in-place form's result in this backward came out wrong
    return F.all_gather_tensor(x, 0, group)


class ExpertParallelMoE(nn.Module):
    """The block's routing and experts, the experts split over ``ep_group`` (see the module docstring).

    Args:
        block: a ``transformers`` sparse MoE block with ``gate`` (a top-k router returning
            ``(logits, weights, indices)``) and ``experts`` (``gate_up_proj [E, 2I, H]``,
            ``down_proj [E, H, I]``, SiLU), the same on every rank.
        ep_group: the expert-parallel group; its size divides ``E``.
        fp8: the tokens cross as e4m3 and the experts run in e4m3 (``GroupedSwiGLU(..., fp8=True)``;
            hidden and the experts' width multiples of 128).
        transport: the dispatcher's transport, a registered name or an options object
            (``MoEDispatcher``'s ``transport``: "nccl", or ``PeerOptions(max_tokens=..., top_k=...)``
            on the GPUs of one node, ``max_tokens`` the most tokens one rank sends: ``ceil(tokens / W)``).
    """

    def __init__(self, block: Any, ep_group: Any, transport: Any = "nccl", fp8: bool = False) -> None:
        super().__init__()
        experts = block.experts
        act = getattr(getattr(experts, "act_fn", None), "__class__", type(None)).__name__
        if act not in ("SiLU", "SiLUActivation"):
            raise UnsupportedError("model", f"experts with activation {act}", "is not SwiGLU (SiLU-gated)",
                                   "use a family whose experts are SwiGLU, or leave ep_group=None")
        self.group = ep_group
        world, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
        num_experts, two_ffn, hidden = experts.gate_up_proj.shape
        ffn, local = two_ffn // 2, num_experts // world
        self.hidden, self.top_k = hidden, block.gate.top_k
        self.gate: Any = block.gate  # the model's router, replicated
        for p in self.gate.parameters():
            p.register_hook(summed_over(ep_group))
        w = experts.gate_up_proj.detach()[rank * local:(rank + 1) * local]
        down = experts.down_proj.detach()[rank * local:(rank + 1) * local]
        self.fp8 = fp8
        self.experts = GroupedSwiGLU(local, hidden, ffn, dtype=w.dtype, device=w.device, fp8=fp8)
        with torch.no_grad():
            self.experts.w1.copy_(w[:, :ffn].transpose(1, 2))   # gate: [local, H, I]
            self.experts.w3.copy_(w[:, ffn:].transpose(1, 2))   # up
            self.experts.w2.copy_(down.transpose(1, 2))          # down: [local, I, H]
        self.dispatcher = MoEDispatcher(num_experts, hidden, ep_group, dtype=w.dtype, device=w.device,
                                        top_k=self.top_k, transport=transport)
        self.first_expert = rank * local
        self.op_name = register_block(self)

    def _block(self, flat: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Dispatch, this rank's experts and combine of routed tokens (``routed_block``'s contract);
        with ``fp8`` the rows cross as e4m3 into FP8 experts (``MoEDispatcher.forward(..., fp8=True)``)."""
        if self.fp8:
            return self.dispatcher.forward(flat, idx, w, self.experts, fp8=True)
        return self.dispatcher.forward_pipelined(flat, idx, w, self.experts, chunks=1)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if _EAGER_BLOCK:
            return _eager(self._forward, hidden_states)
        return self._forward(hidden_states)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, self.hidden)
        world = dist.get_world_size(self.group)
        tokens = flat.shape[0]
        pad = -tokens % world
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, self.hidden)])
        mine = _TakeRows.apply(flat, self.group)
        _, weights, idx = self.gate(mine)
        out = routed_block(self, mine, idx, weights.to(mine.dtype))
        full = _GatherRows.apply(out, self.group)
        return full[:tokens].reshape(shape)

    def extra_repr(self) -> str:
        n = self.experts.w1.shape[0]
        return f"experts {self.first_expert}..{self.first_expert + n - 1} here, top_k={self.top_k}"


class _ExpertParams:
    """What ``register_block``'s ``experts`` must give: the parameters the exchange's experts use."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def parameters(self) -> Any:
        return self.module.parameters()


class _ExpertsOverDispatcher(nn.Module):
    """Mixed in front of a ``transformers`` experts module's own class by :func:`experts_over_dispatcher`.

    ``forward(hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])``,
    the contract every ``transformers`` experts module fills (the block's router has run on every
    rank alike): this rank's ``1/W`` of the tokens (padded to a multiple of ``W`` with rows of
    weight 0) go through ``MoEDispatcher`` to their experts' ranks, where the class's own forward
    computes them (each received row with its one local expert and weight 1; the combine applies
    the routing weights), and the ranks' outputs are all-gathered back (``_TakeRows`` /
    ``_GatherRows``: the router's gradient reaches every rank whole through the weights' gather)."""

    _commops_ep: Any

    @property
    def experts(self) -> _ExpertParams:
        return _ExpertParams(self)

    def _local(self, rows: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        counts = torch.tensor(tokens_per_expert, device=rows.device)
        ids = torch.repeat_interleave(torch.arange(len(tokens_per_expert), device=rows.device), counts)
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        return super().forward(rows, ids[:, None], ones)  # type: ignore[no-any-return]

    def _block(self, flat: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._commops_ep.dispatcher.forward_pipelined(flat, idx, w, self._local, chunks=1)  # type: ignore[no-any-return]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        if args or kwargs:
            raise UnsupportedError("model", f"{type(self).__name__} called with {len(args)} more arguments and "
                                   f"keywords {sorted(kwargs)}", "is not an experts module of the (hidden_states, "
                                   "top_k_index, top_k_weights) contract", "leave ep_group=None for this model")
        ep = self._commops_ep
        shape, world = hidden_states.shape, ep.world
        flat = hidden_states.reshape(-1, shape[-1])
        idx = top_k_index.reshape(flat.shape[0], -1)
        w = top_k_weights.reshape(flat.shape[0], -1).to(flat.dtype)
        tokens = flat.shape[0]
        pad = -tokens % world
        if pad:  # rows of weight 0 (their experts made distinct below)
            flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
            idx = torch.cat([idx, idx.new_zeros(pad, idx.shape[1])])
            w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
        idx, w = distinct_experts(idx, w, ep.dispatcher.num_experts)
        n = flat.shape[0] // world
        mine = _TakeRows.apply(flat, ep.group)
        mine_w = _TakeRows.apply(w, ep.group)
        mine_idx = idx[ep.rank * n:(ep.rank + 1) * n].contiguous()
        out = routed_block(self, mine, mine_idx, mine_w)
        return _GatherRows.apply(out, ep.group)[:tokens].reshape(shape)  # type: ignore[no-any-return]


def distinct_experts(idx: torch.Tensor, w: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, w)`` with every token's ``k`` experts distinct, as ``MoEDispatcher`` takes them, and
    the same weighted sum: a token routed to one expert more than once (hash routing; the padding
    rows of ``[0, 0, ...]``) keeps that expert once with the pairs' weights summed, and its other
    slots go to experts it does not use, with weight 0. ``[tokens, k]`` each; ``k <= num_experts``."""
    s, order = idx.sort(dim=1)
    ws = w.gather(1, order)
    dup = torch.zeros_like(s, dtype=torch.bool)
    dup[:, 1:] = s[:, 1:] == s[:, :-1]
    run = (~dup).long().cumsum(1) - 1                      # which run of equal experts each slot is in
    totals = torch.zeros_like(ws).scatter_add(1, run, ws)  # each run's summed weight, at the run's number
    merged = torch.where(dup, torch.zeros_like(ws), totals.gather(1, run))
    used = torch.zeros(s.shape[0], num_experts, dtype=torch.bool, device=s.device).scatter(1, s, True)
    free = (~used).to(torch.int8).argsort(dim=1, descending=True, stable=True)[:, :s.shape[1]]
    nth = (dup.long().cumsum(1) - 1).clamp(min=0)          # the slot's place among its token's repeats
    return torch.where(dup, free.gather(1, nth), s), merged


class _EpState:
    def __init__(self, group: Any, dispatcher: MoEDispatcher, first: int, local: int) -> None:
        self.group, self.dispatcher, self.first_expert, self.local = group, dispatcher, first, local
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)


def experts_count(experts: nn.Module) -> int:
    """The experts of a ``transformers`` experts module: its ``num_experts``, else its first parameter's rows."""
    n = getattr(experts, "num_experts", None)
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    first = next(experts.parameters(), None)
    return int(first.shape[0]) if first is not None else 0


def experts_over_dispatcher(experts: nn.Module, ep_group: Any, transport: Any = "nccl") -> nn.Module:
    """Put ``experts`` (a ``transformers`` experts module, the same on every rank) over expert parallelism in place.

    Rank r keeps experts ``r*E/W ... (r+1)*E/W - 1``: every parameter of ``experts`` is ``[E, ...]``
    and keeps those rows, under its own name; ``num_experts`` becomes ``E/W``; the module keeps its
    class's expert code (a subclass of it, made here, with ``_ExpertsOverDispatcher``'s forward in
    front), so any activation, bias or clamp the model's experts have runs unchanged. Collective
    over ``ep_group`` only in its forward. Returns ``experts``."""
    world, rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    total = experts_count(experts)
    params = dict(experts.named_parameters(recurse=False))
    hidden = next((int(p.shape[-1]) for n, p in params.items() if p.dim() == 3), 0)
    local = total // world
    with torch.no_grad():
        for name, p in params.items():
            shard = nn.Parameter(p.detach()[rank * local:(rank + 1) * local].clone(), requires_grad=p.requires_grad)
            setattr(experts, name, shard)
    if hasattr(experts, "num_experts"):
        experts.num_experts = local
    sample = next(iter(params.values()))
    width = getattr(experts, "hidden_size", None) or getattr(experts, "hidden_dim", None) or hidden
    dispatcher = MoEDispatcher(total, int(width), ep_group, dtype=sample.dtype, device=sample.device,
                               transport=transport)
    experts._commops_ep = _EpState(ep_group, dispatcher, rank * local, local)
    _subclass(experts, _ExpertsOverDispatcher)
    experts.op_name = register_block(experts)  # what routed_block finds the exchange by
    return experts

