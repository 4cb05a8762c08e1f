"""``torch.compile`` of a parallelized Hugging Face model's forward and backward (Gloo, 2 ranks):
one graph, no break (torch 2.13; before it, one per expert-parallel block, which runs eagerly),
and the compiled steps' losses and gradients equal eager's.

A dense model over tensor parallelism (Llama, TP=2) and a MoE model over expert parallelism
(Qwen3-MoE, EP=2: the block's exchange and experts are the op ``moe_layer``). Each rank builds the
same model twice from one seed, one run eagerly and one compiled, and takes three AdamW steps on
the same batches with each. The decode path (each all-reduce fused with the residual add and the
next RMSNorm, over TP=2 for both families) compiled whole: one graph with the fused op in it,
eager's logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])

from overlap import parallelize  # noqa: E402
from tests._compiled import traced_ops  # noqa: E402


def _build(family: str, tp_only: bool = False) -> torch.nn.Module:
    """The family's model, parallelized: Llama over TP=2; Qwen3-MoE over EP=2 (``tp_only``: over
    TP=2, each rank holding every expert)."""
    torch.manual_seed(7)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
        return parallelize(transformers.LlamaForCausalLM(cfg), tp_group=dist.group.WORLD)
    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                                      mlp_only_layers=[1], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      attn_implementation="sdpa")
    if tp_only:
        return parallelize(transformers.Qwen3MoeForCausalLM(cfg), tp_group=dist.group.WORLD)
    return parallelize(transformers.Qwen3MoeForCausalLM(cfg), tp_group=dist.new_subgroups(1)[0],
                       ep_group=dist.group.WORLD)


def body_compiled(rank: int, world: int, family: str) -> list[str]:
    problems: list[str] = []
    torch._dynamo.reset()
    eager, compiled = _build(family), _build(family)
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 96, (2, 10), generator=gen) for _ in range(3)]

    def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    explained = torch._dynamo.explain(loss_of)(compiled, batches[0])
    # before torch 2.13 each expert-parallel block runs eagerly (its compiled backward was wrong
    # there): the breaks are those blocks' and no others
    reasons = [b.reason for b in explained.break_reasons]
    if family == "qwen3_moe" and _TORCH < (2, 13):
        if not reasons or any("_eager" not in r for r in reasons):
            problems.append(f"breaks other than the eager expert-parallel block: {[r[:200] for r in reasons]}")
    elif explained.graph_break_count or explained.graph_count != 1:
        problems.append(f"{explained.graph_count} graphs, {explained.graph_break_count} breaks: "
                        f"{[b.reason[:200] for b in explained.break_reasons]}")
    torch._dynamo.reset()
    step = torch.compile(loss_of)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, compiled)]
    for i, ids in enumerate(batches):
        losses = []
        for m, o, fn in ((eager, opts[0], loss_of), (compiled, opts[1], step)):
            o.zero_grad()
            loss = fn(m, ids)
            loss.backward()
            losses.append(loss.item())
            o.step()
        if abs(losses[0] - losses[1]) > 1e-5 * abs(losses[0]):
            problems.append(f"step {i}: eager loss {losses[0]}, compiled {losses[1]}")
        for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
            if not torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6):
                problems.append(f"step {i}: gradient of {n} differs by {(a.grad - b.grad).abs().max().item():.3g}")
                break
    torch._dynamo.reset()
    return problems


def _no_problems(worlds: Any, body: Any, family: str) -> None:
    reports = worlds(2).run(body, family, timeout=600)
    problems = [f"rank {r}: {p}" for r, rep in enumerate(reports) for p in rep]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_compiled_parallel_model_has_one_graph_and_eager_losses(worlds, family: str) -> None:  # noqa: ANN001
    _no_problems(worlds, body_compiled, family)


def body_decode_compiled(rank: int, world: int, family: str) -> list[str]:
    """The decode path (``overlap/models/_decode.py``: forwards without autograd of at most 256
    tokens, each all-reduce fused with the residual add and the next RMSNorm) compiled with
    ``fullgraph=True``: one graph holding the fused op, and the logits of eager's decode path,
    over two steps (the norm carried between layers is taken afresh each time)."""
    problems: list[str] = []
    torch._dynamo.reset()
    model = _build(family, tp_only=True)
    if not model.commops_parallel["decode_norms"].startswith("on"):
        problems.append(f"decode norms: {model.commops_parallel['decode_norms']}")
    gen = torch.Generator().manual_seed(11)
    steps = [torch.randint(0, 96, (2, 3), generator=gen) for _ in range(2)]

    def logits_of(m: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return m(input_ids=ids, use_cache=False).logits

    with torch.no_grad():
        explained = torch._dynamo.explain(logits_of)(model, steps[0])
        if explained.graph_break_count or explained.graph_count != 1:
            problems.append(f"{explained.graph_count} graphs, {explained.graph_break_count} breaks: "
                            f"{[b.reason[:200] for b in explained.break_reasons]}")
        elif "commops.all_reduce_rmsnorm" not in traced_ops(explained.graphs[0]):
            problems.append(f"no fused all-reduce + RMSNorm in the graph: {sorted(traced_ops(explained.graphs[0]))}")
        torch._dynamo.reset()
        step = torch.compile(logits_of, fullgraph=True, backend="aot_eager")
        for i, ids in enumerate(steps):
            want, got = logits_of(model, ids), step(model, ids)
            if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
                problems.append(f"step {i}: compiled logits differ by {(got - want).abs().max().item():.3g}")
    torch._dynamo.reset()
    return problems


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_compiled_decode_path_keeps_the_fused_norm_in_one_graph(worlds, family: str) -> None:  # noqa: ANN001
    _no_problems(worlds, body_decode_compiled, family)


def body_plan_compiled(rank: int, world: int, family: str, layout: str) -> list[str]:
    """A family sharded by its plans (``bench/model_zoo.py``'s tiny model), compiled with
    ``fullgraph=True``: one graph holding our ops, and a training step's loss and gradients equal
    to eager's."""
    from bench.model_zoo import tiny_model

    problems: list[str] = []
    alone = dist.new_subgroups(1)[0]

    def build() -> torch.nn.Module:
        tp, ep = (dist.group.WORLD, None) if layout == "tp" else (alone, dist.group.WORLD)
        model = tiny_model(family)
        if ep is None and hasattr(model, "set_experts_implementation"):
            # experts kept whole run transformers' own code: its CPU grouped_mm stand-in (5.17)
            # guards on a data-dependent size in its backward, so the graph takes its batched form
            model.set_experts_implementation("batched_mm")
        return parallelize(model, tp_group=tp, ep_group=ep).train()

    eager, compiled = build(), build()
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(3))

    def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    torch._dynamo.reset()
    explained = torch._dynamo.explain(loss_of)(compiled, ids)
    if explained.graph_break_count or explained.graph_count != 1:
        problems.append(f"{explained.graph_count} graphs, {explained.graph_break_count} breaks: "
                        f"{[b.reason[:200] for b in explained.break_reasons]}")
    ops = set().union(*(traced_ops(g) for g in explained.graphs))
    want = {"commops.gemm_all_reduce"} if layout == "tp" else {"commops.moe_layer"}
    if not want <= ops:
        problems.append(f"the graph lacks {sorted(want - ops)}: {sorted(o for o in ops if 'commops' in o)}")
    torch._dynamo.reset()
    step = torch.compile(loss_of, fullgraph=True, backend="aot_eager")
    a, b = loss_of(eager, ids), step(compiled, ids)
    a.backward()
    b.backward()
    if abs(a.item() - b.item()) > 1e-5 * abs(a.item()):
        problems.append(f"eager loss {a.item()}, compiled {b.item()}")
    for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
        if (p.grad is None) != (q.grad is None) or (p.grad is not None and not torch.allclose(p.grad, q.grad,
                                                                                             rtol=1e-4, atol=1e-6)):
            problems.append(f"gradient of {n} differs from eager's")
            break
    torch._dynamo.reset()
    return problems


# from plans: biases on the column layers (TP); MLA (TP); biased, clamped experts over EP
@pytest.mark.parametrize("family,layout", [("qwen2", "tp"), ("deepseek_v3", "tp"), ("gpt_oss", "ep")])
def test_compiled_model_from_plans_has_one_graph_and_eager_gradients(worlds, family: str,  # noqa: ANN001
                                                                     layout: str) -> None:
    reports = worlds(2).run(body_plan_compiled, family, layout, timeout=600)
    problems = [f"rank {r}: {p}" for r, rep in enumerate(reports) for p in rep]
    assert not problems, "\n".join(problems)
