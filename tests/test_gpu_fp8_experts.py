"""On one CUDA GPU: the FP8 experts' Triton kernels (``overlap/moe/_fp8_gemm.py``) against the
float64 bounds of ``tests/test_overlap_moe_fp8_experts.py``, at the default and every tuning
candidate's configuration, and ``GroupedSwiGLU.forward_fp8`` against its torch definition.
Marker ``gpu``."""

from __future__ import annotations

import pytest
import torch

from overlap import _kernel_tuning
from overlap.moe import GroupedSwiGLU
from overlap.moe import _fp8_gemm as G
from overlap.moe.fp8 import quantize_rows
from tests.test_overlap_moe_fp8_experts import CASES, _check_products

pytestmark = pytest.mark.gpu

CONFIGS = [None, *sorted(set(_kernel_tuning.CANDIDATES["fp8_swiglu"]) | set(_kernel_tuning.CANDIDATES["fp8_mm"]))]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("counts,H,F_", CASES + [([0, 300, 17, 129, 0], 512, 256)])
def test_the_kernels_stay_within_the_stated_bound(counts: list[int], H: int, F_: int, config: tuple | None) -> None:
    assert G.supported(torch.empty(1, H, dtype=torch.float8_e4m3fn, device="cuda")) == ""
    ratios = _check_products(
        counts, H, F_,
        lambda xq, xs, w1, w3, ends, c: G.grouped_swiglu_fp8(xq, xs, w1, w3, ends, config=config),
        lambda hq, hs, w2, ends, c: G.grouped_mm_fp8(hq, hs, w2, ends, torch.float32, config=config), device="cuda")
    assert all(r <= 1.0 for r in ratios), ratios
    assert max(ratios) > 1e-3, ratios


def test_forward_fp8_runs_the_kernels_and_matches_its_definition() -> None:
    torch.manual_seed(5)
    counts = [40, 0, 300, 1, 77, 130]
    m = GroupedSwiGLU(len(counts), 1024, 512, dtype=torch.bfloat16, device="cuda", fp8=True)
    x = torch.randn(sum(counts), 1024, device="cuda", dtype=torch.bfloat16)
    packed = quantize_rows(x)
    with torch.no_grad():
        got = m.forward_fp8(packed, counts)
        assert m.last_path[0] == "fp8", m.last_path
        w1, w3, w2 = m.fp8_weights()
        xq, xs = G.split_rows(packed, 1024)
        hq, hs = G.grouped_swiglu_fp8_reference(xq, xs, w1, w3, counts)
        want = G.grouped_mm_fp8_reference(hq, hs, w2, counts, torch.float32)
    rel = float((got.float() - want).norm() / want.norm())
    assert rel < 1e-2, rel  # bf16 out, and now and then an activation one e4m3 step the other way
