"""``overlap.parallelize`` on Hugging Face models (Llama, Qwen3; random weights from small configs,
no download), on Gloo: the sharded model's logits, gradients, training losses and greedy tokens
against the unsharded model's, run on every rank from the same seed.

Each rank builds the same full model (fp32) and keeps an unsharded copy as the reference. Checks:
logits of a batch equal (fp32 rounding: the ranks' partial sums add in another order); after one
backward every parameter's gradient equals its slice of the reference's; 20 AdamW steps give the
reference's losses (within 1e-4 relative); ``generate()`` of 16 greedy tokens gives the same tokens
(the KV cache holds the local heads). Bad input is refused before any module changes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import collectives as C  # noqa: E402
from overlap import parallelize  # noqa: E402


def _config(family: str, tie: bool) -> object:
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4 if family == "llama" else 2, max_position_embeddings=64,
                  tie_word_embeddings=tie, attn_implementation="eager")
    if family == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen3Config(head_dim=16, **common)


def _model(family: str, tie: bool) -> torch.nn.Module:
    torch.manual_seed(1234)  # the same weights on every rank
    cfg = _config(family, tie)
    cls = transformers.LlamaForCausalLM if family == "llama" else transformers.Qwen3ForCausalLM
    return cls(cfg).float().eval()


def _slice(full: torch.Tensor, shard: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The part of the reference's ``full`` that a rank's ``shard`` holds (even split along the one
    dimension whose size differs)."""
    if full.shape == shard.shape:
        return full
    (dim,) = [d for d in range(full.dim()) if full.shape[d] != shard.shape[d]]
    return full.chunk(world, dim)[rank]


def body_parity(rank: int, world: int, family: str, tie: bool) -> list[str]:
    problems: list[str] = []
    g = dist.new_group(list(range(world)))
    ref = _model(family, tie)
    model = parallelize(copy.deepcopy(ref), tp_group=g)
    gen = torch.Generator().manual_seed(99)
    ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=gen)
    # logits, then one backward: every gradient against its slice of the reference's
    out, want = model(ids, labels=ids), ref(ids, labels=ids)
    if not torch.allclose(out.logits, want.logits, rtol=1e-5, atol=1e-5):
        problems.append(f"logits differ by {(out.logits - want.logits).abs().max().item():.3g}")
    out.loss.backward()
    want.loss.backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = ref_params[name]
        exp = _slice(full.grad, p.grad, rank, world)
        if p.grad is None or not torch.allclose(p.grad, exp, rtol=1e-4, atol=1e-6):
            err = "no gradient" if p.grad is None else f"{(p.grad - exp).abs().max().item():.3g}"
            problems.append(f"gradient of {name} {tuple(p.shape)} differs: {err}")
    sharded = sum(1 for n, p in model.named_parameters() if p.shape != ref_params[n].shape)
    if sharded < 7 * ref.config.num_hidden_layers:
        problems.append(f"only {sharded} parameters are sharded")
    # 20 optimizer steps on fresh batches: the same losses
    model.zero_grad()
    ref.zero_grad()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model.train()
    ref.train()
    for step in range(20):
        batch = torch.randint(0, ref.config.vocab_size, (2, 10), generator=gen)
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(batch, labels=batch).loss.backward()
            o.step()
        with torch.no_grad():
            a, b = model(batch, labels=batch).loss.item(), ref(batch, labels=batch).loss.item()
        if abs(a - b) > 1e-4 * abs(b):
            problems.append(f"step {step}: loss {a} vs {b}")
            break
    # greedy generation through the KV cache
    model.eval()
    ref.eval()
    prompt = torch.randint(0, ref.config.vocab_size, (2, 5), generator=gen)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got, exp_ids = model.generate(prompt, **kw), ref.generate(prompt, **kw)
    if not torch.equal(got, exp_ids):
        problems.append(f"generate: {got.tolist()} vs {exp_ids.tolist()}")
    C.destroy(g)
    return problems


@pytest.mark.parametrize("family,tie,size", [("llama", False, 2), ("qwen3", True, 2), ("llama", True, 4)])
def test_parallelized_model_matches_the_unsharded_one(worlds, family: str, tie: bool, size: int) -> None:  # noqa: ANN001
    reports = worlds(size).run(body_parity, family, tie, timeout=600)
    problems = [f"rank {r}: {p}" for r, rep in enumerate(reports) for p in rep]
    assert not problems, "\n".join(problems)


def body_refusals(rank: int, world: int) -> dict[str, str]:
    """Each bad call raises its typed error naming the argument, and leaves the model untouched."""
    from collectives.errors import InvalidArgumentError, UnsupportedError

    g = dist.new_group(list(range(world)))
    out: dict[str, str] = {}
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=60))
    cases = {
        "unknown family": (lambda: parallelize(gpt2, tp_group=g), UnsupportedError, ["gpt2", "llama", "qwen3"]),
        "heads not divisible": (lambda: parallelize(_model("llama", False), tp_group=g), InvalidArgumentError,
                                ["tp_group=", "attention heads (4)"]),
        "not a group": (lambda: parallelize(_model("llama", False), tp_group=[0, 1]), TypeError, ["tp_group="]),
        "expert parallelism on a dense model": (lambda: parallelize(_model("llama", False), ep_group=g),
                                                UnsupportedError, ["ep_group="]),
    }
    for name, (call, exc_type, words) in cases.items():
        try:
            call()
            out[name] = "did not raise"
        except exc_type as exc:
            missing = [w for w in words if w not in str(exc)]
            out[name] = f"message lacks {missing}: {exc}" if missing else ""
    model = _model("llama", False)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    try:
        parallelize(model, tp_group=g)
    except InvalidArgumentError:
        pass
    same = model.state_dict().keys() == before.keys() and all(torch.equal(model.state_dict()[n], t)
                                                              for n, t in before.items())
    out["model unchanged after a refusal"] = "" if same else "the model was changed"
    C.destroy(g)
    return out


def test_bad_input_is_refused_before_anything_changes(worlds) -> None:  # noqa: ANN001
    reports = worlds(3).run(body_refusals)  # 3 ranks: the test models' 4 heads do not split
    problems = [f"rank {r} [{case}]: {why}" for r, rep in enumerate(reports) for case, why in rep.items() if why]
    assert not problems, "\n".join(problems)
