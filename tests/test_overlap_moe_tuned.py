"""``forward_pipelined(chunks="auto")`` and the tuned table it follows (``launch/bench_moe.py --tune``).

The table's choices are checked against records whose speedups the test sets, and the lookup
against a dispatcher's shape; the pipelines a choice runs are checked against float64 MoEs on
GPUs (``tests/gpu_moe_sources_check.py``) and, over Gloo, in ``tests/test_overlap_moe.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from bench.moe_bench import MoERecord, tuned_moe_table
from overlap import ops
from overlap.moe import MOE_TUNE_MIN_SPEEDUP, GroupedSwiGLU, MoEDispatcher, reference_moe
from overlap.moe.tuned import TunedLayer, _from_moe_table

H, FF = 16, 24


def _record(chunks: int | str, speedup: float, *, tokens: int = 8192, wrong: int = 0, pipeline: str = "sm",
            transport: str = "peer") -> MoERecord:
    seq = 1000.0
    return MoERecord("layer", tokens, H, FF, 8, 2, 2, "bfloat16", "cuda:0", 1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0,
                     seq, seq / speedup, chunks, 0.0, wrong, transport=transport, pipeline=pipeline,
                     speedup_paired=speedup)


def _entries(table: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {e["tokens"]: e for e in table["entries"]}


def test_the_table_keeps_the_fastest_correct_pipeline_past_the_margin() -> None:
    records = [_record(2, 0.9), _record("sources", 1.31, pipeline="copy_engine"),
               _record(4, 1.6, wrong=3),                      # fastest, but wrong: never chosen
               _record(2, MOE_TUNE_MIN_SPEEDUP - 0.03, tokens=128),  # a tie within the margin
               _record(4, 0.7, tokens=128),
               _record("auto", 2.0, tokens=128)]  # what a table picked: not a candidate
    table = tuned_moe_table(records, {"world": 2, "date": "2026-12-01T00:00:00", "device": "X"})
    assert table["meta"] == {"world": 2, "date": "2026-12-01T00:00:00", "device": "X"}
    by = _entries(table)
    assert set(by) == {8192, 128}
    big, small = by[8192], by[128]
    assert (big["chunks"], big["pipeline"]) == ("sources", "copy_engine") and "1.31x" in big["note"]
    assert (big["transport"], big["dtype"], big["device_type"], big["hidden"], big["ffn_hidden"], big["experts"],
            big["top_k"]) == ("peer", "bfloat16", "cuda", H, FF, 8, 2)
    assert small["chunks"] == 1 and "pipeline" not in small and f"{MOE_TUNE_MIN_SPEEDUP - 0.03:.2f}x" in small["note"]


def test_adding_to_a_table_keeps_other_operators_and_other_layers() -> None:
    old = tuned_moe_table([_record(2, 1.2), _record(2, 1.4, tokens=512)], {"world": 2})
    old["entries"].append({"op": "matmul_reduce_scatter", "M": 4096, "strategy": "copy_engine"})
    new = tuned_moe_table([_record("sources", 1.5, pipeline="copy_engine")], {"world": 2, "date": "d"}, into=old)
    by_op = [e["op"] for e in new["entries"]]
    assert by_op.count("matmul_reduce_scatter") == 1 and by_op.count("moe_forward") == 2
    by = _entries({"entries": [e for e in new["entries"] if e["op"] == "moe_forward"]})
    assert by[8192]["chunks"] == "sources" and by[512]["chunks"] == 2  # replaced, kept
    with pytest.raises(ValueError, match="4 ranks"):
        tuned_moe_table([_record(2, 1.2)], {"world": 2}, into={"meta": {"world": 4}, "entries": []})


def _disp(**kw: Any) -> TunedLayer:
    base = {"world": 2, "transport": "peer", "max_tokens": 8192, "hidden": H, "num_experts": 8,
            "pipeline_transfers": "copy_engine"}
    return TunedLayer(**{**base, **kw})


def _table(chunks: int | str, pipeline: str = "copy_engine", world: int = 2) -> dict[str, Any]:
    return {"meta": {"world": world}, "entries": [{
        "op": "moe_forward", "transport": "peer", "pieces": 1, "dtype": "bfloat16", "device_type": "cpu",
        "tokens": 8192, "hidden": H, "ffn_hidden": FF, "experts": 8, "top_k": 2, "chunks": chunks,
        "pipeline": pipeline, "note": "measured"}]}


def test_auto_follows_the_table_only_at_the_measured_layer() -> None:
    x = torch.empty(3, H, dtype=torch.bfloat16)
    mlp = GroupedSwiGLU(4, H, FF, dtype=torch.bfloat16)
    assert _from_moe_table(_table("sources"), _disp(), x, 2, mlp) == ("sources", "tuned table: measured")
    assert _from_moe_table(_table(2), _disp(), x, 2, mlp) == (2, "tuned table: measured")
    # a token-chunk pipeline measured over the SM kernels is what pipeline_transfers="auto" runs
    assert _from_moe_table(_table(2, "sm"), _disp(pipeline_transfers="auto"), x, 2, mlp)[0] == 2
    misses = {
        "over copy_engine": _from_moe_table(_table(2), _disp(pipeline_transfers="sm"), x, 2, mlp),
        "4 ranks": _from_moe_table(_table(2, world=4), _disp(), x, 2, mlp),
        "max_tokens 4096": _from_moe_table(_table(2), _disp(max_tokens=4096), x, 2, mlp),
        "top-3": _from_moe_table(_table(2), _disp(), x, 3, mlp),
        "float32": _from_moe_table(_table(2), _disp(), x.float(), 2, mlp),
        "ffn 32": _from_moe_table(_table(2), _disp(), x, 2, GroupedSwiGLU(4, H, 32, dtype=torch.bfloat16)),
        "not function": _from_moe_table(_table(2), _disp(), x, 2, lambda rows, per: rows),
    }
    for text, (chunks, why) in misses.items():
        assert chunks == 1 and why.startswith("one chunk"), (text, why)
        assert text in why, (text, why)


def _auto_over_gloo(rank: int, world: int) -> list[tuple[int | str, str]]:
    E, k = 2 * world, 2
    g = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(7, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(7)])
    w = torch.rand(7, k, generator=g, dtype=torch.float64)
    disp = MoEDispatcher(E, H, dtype=torch.float64)
    torch.manual_seed(1)  # the same experts on every rank
    whole = GroupedSwiGLU(E, H, FF, dtype=torch.float64)
    mine = GroupedSwiGLU(E // world, H, FF, dtype=torch.float64)
    with torch.no_grad():
        for name in ("w1", "w2", "w3"):
            getattr(mine, name).copy_(getattr(whole, name)[rank * (E // world):(rank + 1) * (E // world)])

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:  # the SwiGLU by its definition
        return (F.silu(rows @ whole.w1[e]) * (rows @ whole.w3[e])) @ whole.w2[e]

    want = reference_moe(x, idx, w, expert)
    ran = []
    ops.set_tuned({"meta": {"world": world}, "entries": [{**_table(2)["entries"][0], "transport": "nccl",
                                                          "dtype": "float64", "experts": E}]})
    try:
        for grad in (False, True):
            with torch.set_grad_enabled(grad):
                out = disp.forward_pipelined(x, idx, w, mine, chunks="auto")
            assert torch.allclose(out, want, rtol=1e-10, atol=1e-10), (grad, (out - want).abs().max())
            assert disp.last_chunks is not None
            ran.append(disp.last_chunks)
    finally:
        ops.set_tuned(None)
    return ran


def test_auto_runs_one_chunk_over_nccl_and_with_autograd(worlds) -> None:  # noqa: ANN001
    for ran in worlds(2).run(_auto_over_gloo):
        (n0, why0), (n1, why1) = ran
        assert n0 == 1 and "transport 'peer' only" in why0, why0
        assert n1 == 1 and "autograd" in why1, why1
