"""``launch/bench_model.py`` end to end: the three variants of a dense and a MoE model checked against
the unsharded fp32 model, timed, and compared with each other (greedy tokens, a short training
run's losses: ``bench/model_agree.py``, whose comparison is also tested alone here). CPU: 2 Gloo ranks (transformers' own TP and EP over Gloo, next
to ours). GPU (marker ``gpu``): world 1 over NCCL, eager and CUDA-graph steps; a smoke test of
the benchmark's GPU path: at world 1 the three variants are one program, so their agreement and
ratios say nothing of the parallelism (the 2-rank Gloo test and the parity tests do)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import collectives as C

from tests._checks import NO_MULTICAST

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"ours/auto", "ours/sequential", "transformers"}


def _run(tmp_path: Path, ranks: int, *flags: str, env: dict[str, str] | None = None) -> dict:
    out = tmp_path / "res"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                          "launch/bench_model.py", "--preset", "tiny", "-n", "1", "-r", "2", "--out", str(out), *flags],
                         cwd=ROOT, env={**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": "1", **(env or {})},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "# logits off the unsharded fp32 model: 0  (OK)" in res.stdout, res.stdout[-3000:]
    assert (out / "plot.png").stat().st_size > 0 and (out / "results.csv").read_text().count("\n") > 1
    return json.loads((out / "results.json").read_text())


def _every_variant_ran(records: list[dict], graph: bool, families: tuple[str, ...] = ("llama", "qwen3_moe")) -> None:
    for family in families:
        for step in ("train", "prefill", "decode") if not graph else ("train", "decode"):
            rows = [r for r in records if (r["family"], r["step"], r["graph"]) == (family, step, graph)]
            assert {r["variant"] for r in rows} == VARIANTS, (family, step, rows)
            for r in rows:
                assert r["wrong"] == 0 and r["max_rel_err"] < 1e-4, r
                assert r["time_us"] is not None and r["time_us"] > 0 and r["tokens_per_s"] > 0, r
                assert r["vs_transformers"] > 0 and r["vs_sequential"] > 0, r


def _variants_agree(agreement: list[dict]) -> None:
    """float32: every variant's greedy tokens and training losses are transformers' own."""
    for family in ("llama", "qwen3_moe"):
        rows = [a for a in agreement if a["family"] == family]
        assert {a["variant"] for a in rows} == VARIANTS and all(a["anchor"] == "transformers" for a in rows), rows
        for a in rows:
            assert a["error"] is None and a["tokens_equal"] and a["losses_agree"], a
            assert len(a["tokens"][0]) == 4 and len(a["losses"]) == 3, a
            assert a["losses"][-1] < a["losses"][0] - 0.1, a  # the run trains: the comparison is not of a constant


def test_bench_model_on_gloo(tmp_path: Path) -> None:
    rec = _run(tmp_path, 2, "--backend", "gloo", env={"CUDA_VISIBLE_DEVICES": ""})  # CPUs, even on a GPU machine
    assert rec["meta"]["world"] == 2 and "transformers" in rec["meta"]
    _every_variant_ran(rec["records"], graph=False)
    _variants_agree(rec["agreement"])
    assert {r["seq"] for r in rec["records"] if r["step"] == "prefill"} == {48}
    layouts = {r["family"]: r["layout"] for r in rec["records"]}
    assert layouts["llama"] == "tp=2" and layouts["qwen3_moe"].endswith("ep=2"), layouts


@pytest.mark.gpu
def test_bench_model_on_one_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rec = _run(tmp_path, 1)
    assert "nccl" in rec["meta"]["backend"] and rec["meta"]["nccl"], rec["meta"]
    _every_variant_ran(rec["records"], graph=False)
    graphs = [r for r in rec["records"] if r["graph"]]
    assert graphs, "no CUDA-graph records"
    for r in graphs:  # captured, or the reason it could not be, never left out
        assert (r["time_us"] or 0) > 0 or r["error"], r
    dense = [r for r in graphs if r["family"] == "llama"]
    assert all(r["time_us"] for r in dense), dense


@pytest.mark.gpu
def test_bench_model_takes_any_planned_family_on_one_gpu(tmp_path: Path) -> None:
    """DeepSeek-V3-, GPT-OSS- and Qwen2-like models (sized by the tiny rules and the preset): the
    families of the plan path, through the same three variants."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    families = ("deepseek_v3", "gpt_oss", "qwen2")
    rec = _run(tmp_path, 1, "--model", ",".join(families))
    _every_variant_ran(rec["records"], graph=False, families=families)
    for r in (r for r in rec["records"] if r["graph"]):
        assert (r["time_us"] or 0) > 0 or r["error"], r


def test_small_model_sizes_a_planned_family_from_its_preset() -> None:
    from bench.model_step import PRESETS, is_moe, small_model

    p = PRESETS["tiny"]
    m = small_model("gpt_oss", "tiny", torch.float32, torch.device("cpu"), positions=256)
    c = m.config
    assert (c.hidden_size, c.num_local_experts, c.num_experts_per_tok) == (p["hidden"], p["experts"], p["top_k"])
    assert c.intermediate_size == p["moe_ffn"] and c.max_position_embeddings == 256  # GPT-OSS: the experts' width
    assert is_moe("gpt_oss") and not is_moe("qwen2") and is_moe("mixtral") and not is_moe("llama")
    with pytest.raises(C.InvalidArgumentError, match="tensor-parallel plan"):
        small_model("not_a_model_type", "tiny", torch.float32, torch.device("cpu"))


def test_agreement_names_where_variants_part() -> None:
    from bench.model_agree import compare

    anchor = {"tokens": [[5, 6, 7], [1, 2, 3]], "margins": [[0.5, 0.4, 0.3], [2.0, 0.01, 1.0]],
              "losses": [10.0, 8.0, 6.0]}
    results = {"transformers": anchor,
               "ours/auto": {"tokens": [[5, 6, 7], [1, 9, 3]], "losses": [10.0, 8.05, 6.0]},  # seq 1 parts at step 1
               "ours/sequential": {"tokens": [[5, 6, 7], [1, 2, 3]], "losses": [10.0, 8.0, 6.3]},
               "broken": {"error": "tokens: RuntimeError: x"}}
    got = {a.variant: a for a in compare("llama", torch.bfloat16, results, "transformers", 2e-2)}
    assert got["transformers"].tokens_equal and got["transformers"].max_loss_rel_diff == 0
    auto = got["ours/auto"]
    assert auto.tokens_equal is False and auto.first_diff == 1 and auto.margin_at_diff == 0.01
    assert auto.losses_agree and abs(auto.max_loss_rel_diff - 0.05 / 8) < 1e-12
    seq = got["ours/sequential"]
    assert seq.tokens_equal and seq.losses_agree is False and abs(seq.max_loss_rel_diff - 0.05) < 1e-12
    assert got["broken"].tokens_equal is None and got["broken"].losses_agree is None and got["broken"].error


def test_a_static_cache_is_rewound_through_its_current_counters() -> None:
    """A static layer's first write on a GPU replaces its write position (``cumulative_length``)
    with a tensor on the cache's device; a prefill or decode step repeated from a stale handle to
    the old one wrote past the cache (a device-side assert on an H200). ``_rewind`` looks the
    counters up each time: swapped for new tensors here, as that first write does, they are reset."""
    from transformers import StaticCache

    from bench.model_step import _rewind, small_model

    model = small_model("llama", "tiny", torch.float32, torch.device("cpu"))
    cache = StaticCache(config=model.config, max_cache_len=24)
    ids = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(8))
    layers = [layer for layer in cache.layers if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]
    if not layers:
        pytest.skip("this transformers' static layers write at cache_position: nothing to rewind")
    for layer in layers:
        assert int(layer.cumulative_length) == 8
        layer.cumulative_length = layer.cumulative_length.clone()  # what the first write on a GPU does
    _rewind(cache, 3)
    assert all(int(layer.cumulative_length) == 3 for layer in layers)
