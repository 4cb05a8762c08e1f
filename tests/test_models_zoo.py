"""``parallelize`` from the model's own plans (``overlap/models/plans.py``), family by family.

Each family is built tiny and random from its default config (``bench/model_zoo.py``'s rules), the
same on every rank, and sharded at TP=2 (and EP=2 where it has experts) on Gloo: the logits, one
training step's loss and every gradient slice, and 8 greedy tokens against the unsharded model's,
and the parameters really split. The default run keeps one family per kind of hard case; every
family of the installed transformers, beside transformers' own parallelism, runs under ``-m slow``
(``launch/model_zoo.py`` writes the README's table from the same checks).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from bench.model_zoo import check_family, families  # noqa: E402

# one family per kind of hard case the plans hold, with the layouts that show it
SUBSET = {
    "qwen2": (("tp",), "biases on the column-parallel q, k and v"),
    "gemma2": (("tp",), "a scaled embedding tied to the head, sliding windows, soft-capped logits, sandwich norms"),
    "phi3": (("tp",), "packed q/k/v and gate/up projections (gathered outputs, split inputs)"),
    "gpt_oss": (("ep",), "attention sinks, sliding windows; experts with biases and a clamped activation over EP"),
    "deepseek_v3": (("tp", "ep"), "MLA (low-rank q and kv), shared experts, grouped top-k with a bias, dense "
                    "first layers"),
    "qwen3_next": (("tp", "ep"), "a hybrid of linear-attention and attention layers, gated attention, per-head norms"),
    "llama4_text": (("tp",), "a row-parallel output the model adds into in place; experts kept whole under TP"),
    "jamba": (("tp", "ep"), "a hybrid of Mamba and attention layers, experts every other layer"),
    "doge": (("tp",), "a per-KV-head dynamic mask computed from every head's values (an override)"),
}


def body_zoo(rank: int, world: int, cases: list[tuple[str, str, str]]) -> list[dict]:
    return [check_family(kind, layout, impl).__dict__ for kind, layout, impl in cases]


def _cases(kinds: list[str], impls: tuple[str, ...]) -> list[tuple[str, str, str]]:
    plans = families()
    return [(k, lay, impl) for k in kinds for lay in ("tp", "ep") if plans.get(k, {}).get(lay) for impl in impls]


def test_representative_families_match_the_unsharded_model(worlds) -> None:  # noqa: ANN001
    plans = families()
    cases = [(k, lay, "ours") for k, (layouts, _) in sorted(SUBSET.items()) for lay in layouts
             if plans.get(k, {}).get(lay)]
    # older transformers lack some families or plans (5.17: no Jamba plan, GPT-OSS's EP alone)
    assert len({k for k, _, _ in cases}) >= 6, f"only {cases} of the subset have plans in this transformers"
    reports = worlds(2).run(body_zoo, cases, timeout=600)
    agreed = [[(r["family"], r["layout"], r["status"], r["reason"]) for r in rep] for rep in reports]
    assert agreed[0] == agreed[1], "the ranks disagree on a record"
    bad = [f"{r['family']} {r['layout']}: {r['status']} {r['reason']}" for r in reports[0] if r["status"] != "pass"]
    assert not bad, "\n".join(bad)


@pytest.mark.slow
def test_every_family_transformers_shards_ours_shards_too(worlds) -> None:  # noqa: ANN001
    cases = _cases(sorted(families()), ("ours", "transformers"))
    reports = worlds(2).run(body_zoo, cases, timeout=3000)[0]
    by = {(r["family"], r["layout"], r["impl"]): r for r in reports}
    missed = [f"{f} {lay}: ours {by[(f, lay, 'ours')]['status']} {by[(f, lay, 'ours')]['reason']}"
              for (f, lay, impl), r in by.items() if impl == "transformers" and r["status"] == "pass"
              and by[(f, lay, "ours")]["status"] != "pass"]
    assert not missed, "\n".join(missed)
    crashed = [f"{r['family']} {r['layout']}: {r['reason']}" for r in reports if r["impl"] == "ours"
               and r["status"] == "fail"]
    assert not crashed, "\n".join(crashed)


def test_distinct_experts_keeps_the_weighted_sum() -> None:
    """Repeated experts in a token's top-k (hash routing, padding rows) become distinct pairs with the
    same sum over experts: checked against a float64 scatter of the original pairs."""
    import torch

    from overlap.models._experts import distinct_experts

    gen = torch.Generator().manual_seed(7)
    for _ in range(100):
        experts = int(torch.randint(2, 9, (1,), generator=gen))
        k = int(torch.randint(1, experts + 1, (1,), generator=gen))
        idx = torch.randint(0, experts, (9, k), generator=gen)
        w = torch.rand(9, k, dtype=torch.float64, generator=gen)
        got_idx, got_w = distinct_experts(idx, w, experts)
        for row in range(9):
            assert len(set(got_idx[row].tolist())) == k, (idx[row], got_idx[row])
            want = torch.zeros(experts, dtype=torch.float64).index_add(0, idx[row], w[row])
            got = torch.zeros(experts, dtype=torch.float64).index_add(0, got_idx[row], got_w[row])
            assert torch.allclose(got, want), (idx[row], w[row], got_idx[row], got_w[row])
