"""``parallelize``'s decode path (``overlap/models/_decode.py``) on Gloo: each all-reduce of o and
down fused with the residual add and the next RMSNorm in forwards without autograd of at most
256 tokens, and the model's own code everywhere else.

Against the unsharded model (fp32, the same weights on every rank): the logits of a prefill and
of single-token steps through the KV cache, the count of fused calls (two per dense layer, one
per MoE layer), none in a forward that autograd records or of more than 256 tokens, and
``generate()``'s greedy tokens. ``tests/test_models_parallelize.py`` runs the full parity
(gradients, training, generation) with the path on.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import collectives as C  # noqa: E402
from overlap import last_choice, parallelize  # noqa: E402
from overlap import layers as _layers  # noqa: E402
from overlap.models import _decode  # noqa: E402
from tests.test_models_parallelize import _model  # noqa: E402


_REAL = _layers.fused_all_reduce_rmsnorm


def _counting(calls: list[tuple[int, ...]]) -> Any:
    def fused(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(x.shape))
        return _REAL(x, *args, **kwargs)
    return fused


def body_decode(rank: int, world: int, family: str, tp: int, ep: int, sp: bool) -> list[str]:
    problems: list[str] = []
    if ep:
        g = dist.new_subgroups(tp)[0]
        e = dist.new_subgroups_by_enumeration([list(range(q, world, tp)) for q in range(tp)])[0]
    else:
        g, e = dist.new_group(list(range(world))), None
    ref = _model(family, False)
    with torch.no_grad():  # norms of their own (a model built from a config has every norm's weight at 1)
        norms = [m for n, m in ref.named_modules() if n.endswith("norm") and hasattr(m, "weight")]
        for k, m in enumerate(norms):
            m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=torch.Generator().manual_seed(k)))
    model = parallelize(copy.deepcopy(ref), tp_group=g, ep_group=e, sequence_parallel=sp)
    off = parallelize(copy.deepcopy(ref), tp_group=g, ep_group=e, sequence_parallel=sp, strategy="sequential")
    if not model.commops_parallel["decode_norms"].startswith("on"):
        problems.append(f"decode norms: {model.commops_parallel['decode_norms']}")
    if not off.commops_parallel["decode_norms"].startswith("off: strategy='sequential'"):
        problems.append(f"strategy=sequential: {off.commops_parallel['decode_norms']}")
    layers = ref.config.num_hidden_layers
    dense = sum(1 for layer in model.model.layers if hasattr(layer.mlp, "down_proj"))  # a row-parallel down
    calls: list[tuple[int, ...]] = []
    _layers.fused_all_reduce_rmsnorm = _counting(calls)  # what the row layers reduce through
    hits: list[int] = []  # the norms that took a fused norm's output instead of norming again
    take = _decode._Carry.take

    def counted(self: Any, x: torch.Tensor) -> Any:
        y = take(self, x)
        if y is not None:
            hits.append(1)
        return y
    _decode._Carry.take = counted  # type: ignore[method-assign]
    try:
        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(0, ref.config.vocab_size, (2, 9), generator=gen)
        with torch.no_grad():
            cache = ref(ids[:, :5], use_cache=True).past_key_values
            mine = model(ids[:, :5], use_cache=True)
            if len(calls) != layers + dense:
                problems.append(f"prefill of 10 tokens: {len(calls)} fused calls, want {layers + dense}")
            if len(hits) != dense:  # each dense layer's down hands its norm to the next module
                problems.append(f"prefill: {len(hits)} norms taken from the fused calls, want {dense}")
            mcache = mine.past_key_values
            want = ref(ids[:, :5]).logits
            if not torch.allclose(mine.logits, want, rtol=1e-4, atol=1e-5):
                problems.append(f"prefill logits differ by {(mine.logits - want).abs().max():.3g}")
            for t in range(5, 9):  # one token per sequence per step, through the cache
                got = model(ids[:, t:t + 1], past_key_values=mcache, use_cache=True)
                exp = ref(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                mcache, cache = got.past_key_values, exp.past_key_values
                if not torch.allclose(got.logits, exp.logits, rtol=1e-4, atol=1e-5):
                    problems.append(f"step {t}: logits differ by {(got.logits - exp.logits).abs().max():.3g}")
            if len(calls) != 5 * (layers + dense):
                problems.append(f"after 4 steps: {len(calls)} fused calls, want {5 * (layers + dense)}")
            choice = last_choice(g)
            if choice is None or choice.op != "all_reduce_rmsnorm" or choice.strategy != "sequential":
                problems.append(f"last choice {choice}")
            before = len(calls)
            big = torch.randint(0, ref.config.vocab_size, (2, 129), generator=gen)  # 258 tokens
            if not torch.allclose(model(big).logits, ref(big).logits, rtol=1e-4, atol=1e-5) or len(calls) != before:
                problems.append(f"258 tokens: {len(calls) - before} fused calls, want 0")
        model(ids).logits.sum().backward()  # autograd records it: the model's own code
        if len(calls) != before:
            problems.append(f"a training forward made {len(calls) - before} fused calls")
        with torch.no_grad():
            prompt = ids[:, :4]
            kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
            if not torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw)):
                problems.append("generate() tokens differ")
    finally:
        _layers.fused_all_reduce_rmsnorm = _REAL
        _decode._Carry.take = take  # type: ignore[method-assign]
    if not ep:
        C.destroy(g)
    return problems


@pytest.mark.parametrize("family,tp,ep,sp,size", [("llama", 2, 0, False, 2), ("qwen3", 2, 0, True, 2),
                                                  ("qwen3_moe", 2, 2, False, 4)],
                         ids=["llama-tp2", "qwen3-tp2-sp", "qwen3_moe-tp2xep2"])
def test_decode_fuses_each_all_reduce_with_the_next_norm(worlds, family: str, tp: int, ep: int,  # noqa: ANN001
                                                         sp: bool, size: int) -> None:
    reports = worlds(size).run(body_decode, family, tp, ep, sp, timeout=600)
    problems = [f"rank {r}: {p}" for r, rep in enumerate(reports) for p in rep]
    assert not problems, "\n".join(problems)
