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
from ._sequence import summed_over

__all__ = ["ExpertParallelMoE"]

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
        transport: the dispatcher's transport, a registered name or an options object
            (``MoEDispatcher``'s ``transport``: "nccl", or ``PeerOptions(max_tokens=..., top_k=...)``
            on the GPUs of one node, ``max_tokens`` the most tokens one rank sends: ``ceil(tokens / W)``).
    """

    def __init__(self, block: Any, ep_group: Any, transport: Any = "nccl") -> None:
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
        self.experts = GroupedSwiGLU(local, hidden, ffn, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            self.experts.w1.copy_(w[:, :ffn].transpose(1, 2))   # gate: [local, H, I]
            self.experts.w3.copy_(w[:, ffn:].transpose(1, 2))   # up
            self.experts.w2.copy_(down.transpose(1, 2))          # down: [local, I, H]
        self.dispatcher = MoEDispatcher(num_experts, hidden, ep_group, dtype=w.dtype, device=w.device,
                                        top_k=self.top_k, transport=transport)
        self.first_expert = rank * local
        self.op_name = register_block(self)

    def _block(self, flat: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Dispatch, this rank's experts and combine of routed tokens (``routed_block``'s contract)."""
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
