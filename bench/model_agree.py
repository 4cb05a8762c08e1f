"""Whether the variants of ``bench/model_step.py`` compute the same model, in the bench dtype.

- ``greedy_tokens``: tokens decoded greedily from one prompt through a static cache, with the margin
  between the top two logits at each step (where variants part, a near tie that rounding flips
  is the likely cause; a wide margin is a bug).
- ``loss_curve``: a short training run, AdamW on the same batch every step (so the loss falls),
  from the same checkpoint: each step's loss.
- ``compare``: each variant's tokens and losses against an anchor's.

The training run changes the weights: it comes after everything else a variant measures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

__all__ = ["AgreeRecord", "greedy_tokens", "loss_curve", "compare", "full_tensor"]


@dataclass
class AgreeRecord:
    family: str
    variant: str
    anchor: str                     # the variant compared with (transformers, else ours/sequential)
    dtype: str
    tokens: list[list[int]] | None  # the greedy tokens, per sequence of the prompt
    tokens_equal: bool | None       # every token the anchor's
    first_diff: int | None          # the first step at which any sequence's token differs
    margin_at_diff: float | None    # the anchor's top-1 minus top-2 logit there
    losses: list[float] | None
    max_loss_rel_diff: float | None  # over the steps, |loss - anchor's| / |anchor's|
    loss_rtol: float
    losses_agree: bool | None
    error: str | None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def full_tensor(t: Any) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def greedy_tokens(model: Any, prompt: torch.Tensor, n: int) -> tuple[list[list[int]], list[list[float]]]:
    """``n`` tokens after ``prompt [batch, len]``, greedily, and the top-two margin at each step."""
    from transformers import StaticCache  # deferred: the models extra

    length = prompt.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=length + n)
    model.eval()
    tokens, margins = [], []
    with torch.no_grad():
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(length, device=prompt.device)).logits[:, -1]
        for i in range(n):
            top = full_tensor(logits).float().topk(2, dim=-1)
            tok = top.indices[:, :1].contiguous()
            tokens.append(tok)
            margins.append(top.values[:, 0] - top.values[:, 1])
            if i + 1 < n:
                pos = torch.tensor([length + i], device=prompt.device)
                logits = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos).logits[:, -1]
    return torch.cat(tokens, 1).tolist(), torch.stack(margins, 1).tolist()


def loss_curve(model: Any, ids: torch.Tensor, steps: int, lr: float) -> list[float]:
    """The loss at each of ``steps`` AdamW steps on ``ids`` (labels the ids themselves)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, foreach=False)  # elementwise: a shard steps as its whole would
    model.train()
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(float(full_tensor(loss.detach())))
    opt.zero_grad(set_to_none=True)
    return losses


def compare(family: str, dtype: torch.dtype, results: dict[str, dict[str, Any]], anchor: str,
            loss_rtol: float) -> list[AgreeRecord]:
    """One record per variant of ``results`` (variant -> {"tokens", "margins", "losses", "error"},
    any of them missing), compared with ``anchor``'s."""
    base = results.get(anchor, {})
    out = []
    for v, got in results.items():
        rec = AgreeRecord(family, v, anchor, str(dtype).removeprefix("torch."), got.get("tokens"), None, None, None,
                          got.get("losses"), None, loss_rtol, None, got.get("error"))
        if rec.tokens is not None and base.get("tokens") is not None:
            steps = [i for i in range(len(rec.tokens[0]))
                     if any(a[i] != b[i] for a, b in zip(rec.tokens, base["tokens"], strict=True))]
            rec.tokens_equal = not steps
            if steps:
                i = rec.first_diff = steps[0]
                rec.margin_at_diff = min(m[i] for a, b, m in zip(rec.tokens, base["tokens"], base["margins"], strict=True)
                                         if a[i] != b[i])
        if rec.losses is not None and base.get("losses") is not None:
            rec.max_loss_rel_diff = max(abs(a - b) / max(abs(b), 1e-30)
                                        for a, b in zip(rec.losses, base["losses"], strict=True))
            rec.losses_agree = rec.max_loss_rel_diff <= loss_rtol
        out.append(rec)
    return out
