"""On one CUDA GPU: the Triton grouped GEMM and its SwiGLU-fused form (``overlap/moe/_grouped_gemm.py``)
against float64 products of each expert's rows, and ``GroupedSwiGLU``'s fused inference path
against its torch path. Marker ``gpu``.

Expert sizes are uneven and include empty experts (first, middle, last), experts of fewer rows
than a tile, and widths that are not whole tiles; every row of the result is compared, so a row
the kernel did not write (left as the allocator's garbage) or wrote from the wrong expert fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from collectives.errors import InvalidArgumentError
from overlap import _kernel_tuning
from overlap.moe import _grouped_gemm as G
from overlap.moe._grouped_gemm import sm_carveout
from overlap.moe import GroupedSwiGLU

pytestmark = pytest.mark.gpu

CASES = [  # (counts per expert, K, N)
    ([0, 5, 0, 300, 128, 0], 192, 200),
    ([1], 64, 8),
    ([129, 127, 0, 1000], 128, 384),
    ([0, 0, 0, 17], 64, 264),
]


def _ref(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    parts = [xe.double() @ w[e].double() for e, xe in enumerate(x.split(counts))]
    return torch.cat(parts) if parts else x.new_zeros((0, w.shape[2]), dtype=torch.float64)


def _swiglu_ref(m: GroupedSwiGLU, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The experts' output in float64 per expert, the activation rounded once to ``x``'s dtype."""
    h = F.silu(_ref(x, m.w1.detach(), counts)) * _ref(x, m.w3.detach(), counts)
    return _ref(h.to(x.dtype), m.w2.detach(), counts)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)) if want.numel() else 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sms", [None, 3])
def test_grouped_products_match_each_experts_float64_product(dtype: torch.dtype, sms: int | None) -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    for counts, K, N in CASES:
        E, rows = len(counts), sum(counts)
        x = torch.randn(rows, K, generator=g, device="cuda").to(dtype)
        w1 = (torch.randn(E, K, N, generator=g, device="cuda") * K ** -0.5).to(dtype)
        w3 = (torch.randn(E, K, N, generator=g, device="cuda") * K ** -0.5).to(dtype)
        ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        assert G.supported(x, w1, w3) == "", G.supported(x, w1, w3)
        h1, h3 = _ref(x, w1, counts), _ref(x, w3, counts)
        got = G.grouped_mm(x, w1, ends, sms=sms)
        assert got.shape == (rows, N) and got.dtype == dtype
        assert _rel(got, h1) < 1e-2, (counts, K, N)
        act = G.grouped_swiglu(x, w1, w3, ends, sms=sms)
        assert _rel(act, F.silu(h1) * h3) < 1e-2, (counts, K, N)


@pytest.mark.parametrize("config", sorted(set(_kernel_tuning.CANDIDATES["gmm"]) |
                                          set(_kernel_tuning.CANDIDATES["gmm_swiglu"])))
def test_every_tuning_candidate_computes_the_same_products(config: tuple[int, int, int, int]) -> None:
    """launch/tune_kernels.py may write any candidate into the kernel table: each must be right."""
    g = torch.Generator(device="cuda").manual_seed(8)
    for counts, K, N in CASES:
        E, rows = len(counts), sum(counts)
        x = torch.randn(rows, K, generator=g, device="cuda").to(torch.bfloat16)
        w1 = (torch.randn(E, K, N, generator=g, device="cuda") * K ** -0.5).to(torch.bfloat16)
        w3 = (torch.randn(E, K, N, generator=g, device="cuda") * K ** -0.5).to(torch.bfloat16)
        ends = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        h1, h3 = _ref(x, w1, counts), _ref(x, w3, counts)
        assert _rel(G.grouped_mm(x, w1, ends, config=config), h1) < 1e-2, (config, counts, K, N)
        assert _rel(G.grouped_swiglu(x, w1, w3, ends, config=config), F.silu(h1) * h3) < 1e-2, (config, counts)


@pytest.mark.parametrize("gather", [False, True])
def test_segments_fill_their_rows_only_and_gathered_rows_read_the_table(gather: bool) -> None:
    """Two calls over the interleaved segments of two sources (each expert's rows: source 0's,
    then source 1's), the second source's rows read through an index into a table; rows of no
    segment keep their poison."""
    g = torch.Generator(device="cuda").manual_seed(13)
    K, N, T = 128, 200, 700
    per = [[0, 130, 7, 0, 64], [5, 0, 129, 1, 0]]  # [source][expert]
    E = len(per[0])
    starts, run = [[0] * E, [0] * E], 0
    for e in range(E):
        for s in range(2):
            starts[s][e] = run
            run += per[s][e]
        run += 3  # a gap after each expert: rows no call may write
    rows = run
    table = torch.randn(T, K, generator=g, device="cuda").bfloat16()
    index = torch.randint(0, T, (rows,), generator=g, device="cuda").to(torch.int32)
    x = table[index.long()] if not gather else table
    w1 = (torch.randn(E, K, N, generator=g, device="cuda") * K ** -0.5).bfloat16()
    w3 = (torch.randn(E, K, N, generator=g, device="cuda") * K ** -0.5).bfloat16()
    plain = torch.full((rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    act = torch.full((rows, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    for s in range(2):
        st = torch.tensor(starts[s], device="cuda", dtype=torch.int32)
        ct = torch.tensor(per[s], device="cuda", dtype=torch.int32)
        G.grouped_mm_segments(x, w1, st, ct, plain, index=index if gather else None)
        G.grouped_swiglu_segments(x, w1, w3, st, ct, act, index=index if gather else None)
    written = torch.zeros(rows, dtype=torch.bool)
    for s in range(2):
        for e in range(E):
            lo, hi = starts[s][e], starts[s][e] + per[s][e]
            written[lo:hi] = True
            a = table[index[lo:hi].long()].double()
            h1, h3 = a @ w1[e].double(), a @ w3[e].double()
            assert _rel(plain[lo:hi], h1) < 1e-2, (s, e)
            assert _rel(act[lo:hi], F.silu(h1) * h3) < 1e-2, (s, e)
    assert plain[~written.cuda()].isnan().all() and act[~written.cuda()].isnan().all()


def test_segment_arguments_are_checked_before_the_launch() -> None:
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 64, 16, device="cuda", dtype=torch.bfloat16)
    st = torch.tensor([0, 4], device="cuda", dtype=torch.int32)
    out = torch.empty(8, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match="starts"):
        G.grouped_mm_segments(x, w, st.long(), st, out)
    with pytest.raises(InvalidArgumentError, match="out"):
        G.grouped_mm_segments(x, w, st, st, out[:, :8])
    with pytest.raises(InvalidArgumentError, match="index"):
        G.grouped_mm_segments(x, w, st, st, out, index=st)


def test_the_grid_follows_torchs_sm_carveout() -> None:
    n = torch.cuda.get_device_properties(0).multi_processor_count
    assert G._sms(torch.device("cuda"), None) == n
    with sm_carveout(24):
        assert G._sms(torch.device("cuda"), None) == n - 24
        assert G._sms(torch.device("cuda"), 5) == 5
    assert G._sms(torch.device("cuda"), None) == n


def test_operands_the_kernel_was_not_measured_for_are_refused_with_a_reason() -> None:
    x = torch.randn(8, 100, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 100, 16, device="cuda", dtype=torch.bfloat16)
    assert "multiple of 64" in G.supported(x, w)
    x64 = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    assert "K = 24 (weight 1)" in G.supported(x64, torch.randn(2, 128, 24, device="cuda", dtype=torch.bfloat16),
                                              torch.randn(2, 24, 128, device="cuda", dtype=torch.bfloat16))
    assert "float32" in G.supported(x.float()[:, :64], w.float()[:, :64])
    assert "contiguous" in G.supported(torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)[:, :64], w[:, :64])
    assert "cpu" in G.supported(x.cpu(), w.cpu())


def test_grouped_swiglu_inference_path_matches_the_torch_path_and_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(G, "_GPU_BOUND_S", 0.0)  # this small call would otherwise go to torch's path
    torch.manual_seed(3)
    counts = [0, 333, 1, 0, 700, 64, 0, 250]
    m = GroupedSwiGLU(len(counts), 256, 384, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    want = _swiglu_ref(m, x, counts)
    with torch.no_grad():
        fused = m(x, counts)
        assert m.last_path is not None and m.last_path[0] == "fused", m.last_path
        m.fused = False
        plain = m(x, counts)
        assert m.last_path == ("torch", "fused=False")
    assert _rel(fused, want) < 2e-2 and _rel(plain, want) < 2e-2
    assert _rel(fused, plain.double()) < 2e-2
    # few rows per expert (a decode step): the down product runs in Triton as well
    few = [0, 3, 1, 0, 40, 9, 0, 25]
    xf = torch.randn(sum(few), 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        m.fused = True
        got = m(xf, few)
    assert m.last_path is not None and "down product too" in m.last_path[1], m.last_path
    assert _rel(got, _swiglu_ref(m, xf, few)) < 2e-2
    # with autograd the torch path runs (and its backward)
    y = m(x.requires_grad_(), counts)
    y.float().sum().backward()
    assert x.grad is not None and _rel(y.detach(), plain.double()) == 0.0
    assert m.last_path is not None and m.last_path[0] == "torch" and "autograd" in m.last_path[1]


def test_a_call_bound_by_its_host_keeps_torchs_path() -> None:
    m = GroupedSwiGLU(4, 256, 384, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        m(torch.randn(64, 256, device="cuda", dtype=torch.bfloat16), [16] * 4)
    assert m.last_path is not None and m.last_path[0] == "torch" and "host" in m.last_path[1], m.last_path


def test_padded_blocks_compute_each_experts_counted_rows_only() -> None:
    g = torch.Generator(device="cuda").manual_seed(11)
    E, cap, K, N = 5, 96, 128, 200
    counts = torch.tensor([0, 96, 1, 40, 95], device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(E, cap, K, generator=g, device="cuda").to(dtype)
        for e, c in enumerate(counts.tolist()):
            x[e, c:] = float("nan")  # rows past a count: nothing may read them into a counted row
        w1 = (torch.randn(E, K, N, generator=g, device="cuda") * K ** -0.5).to(dtype)
        w3 = (torch.randn(E, K, N, generator=g, device="cuda") * K ** -0.5).to(dtype)
        plain = G.grouped_mm_padded(x, w1, counts)
        act = G.grouped_swiglu_padded(x, w1, w3, counts)
        for e, c in enumerate(counts.tolist()):
            h1, h3 = x[e, :c].double() @ w1[e].double(), x[e, :c].double() @ w3[e].double()
            assert _rel(plain[e, :c], h1) < 1e-2, (dtype, e)
            assert _rel(act[e, :c], F.silu(h1) * h3) < 1e-2, (dtype, e)


def test_forward_padded_with_counts_matches_the_batched_path_and_replays_from_a_graph() -> None:
    torch.manual_seed(5)
    E, cap, H, FF = 6, 128, 256, 320
    m = GroupedSwiGLU(E, H, FF, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(E, cap, H, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([3, 0, 128, 77, 1, 64], device="cuda")
    with torch.no_grad():
        want = m.forward_padded(x)  # every row, batched GEMMs
        assert m.last_path is not None and m.last_path[0] == "torch"
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            m.forward_padded(x, counts)  # warm-up (compiles) outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                got = m.forward_padded(x, counts)
        torch.cuda.current_stream().wait_stream(stream)
        assert m.last_path is not None and m.last_path[0] == "fused" and "counted rows" in m.last_path[1], m.last_path
        for trial in range(3):  # new rows and counts in place, replayed
            x.copy_(torch.randn_like(x))
            counts.copy_(torch.randint(0, cap + 1, (E,), device="cuda"))
            graph.replay()
            torch.cuda.synchronize()
            want = m.forward_padded(x)
            for e, c in enumerate(counts.tolist()):
                assert _rel(got[e, :c], want[e, :c].double()) < 3e-2, (trial, e, c)


def test_blocks_the_kernels_cannot_take_go_to_the_batched_path_with_the_reason() -> None:
    m = GroupedSwiGLU(2, 128, 64, dtype=torch.bfloat16, device="cuda")
    wide = torch.randn(2, 8, 256, device="cuda", dtype=torch.bfloat16)
    x = wide[:, :, :128]  # rows of the right width, not contiguous
    counts = torch.tensor([3, 8], device="cuda")
    with torch.no_grad():
        got = m.forward_padded(x, counts)
        assert m.last_path is not None and m.last_path[0] == "torch" and "contiguous" in m.last_path[1], m.last_path
        want = m.forward_padded(x.contiguous())
    assert _rel(got, want.double()) < 1e-2


def test_fp16_experts_run_both_grouped_products_in_triton_instead_of_a_gemm_per_expert() -> None:
    torch.manual_seed(9)
    counts = [0, 200, 1, 130, 0, 77]
    m = GroupedSwiGLU(len(counts), 128, 192, dtype=torch.float16, device="cuda")
    x = torch.randn(sum(counts), 128, device="cuda", dtype=torch.float16)
    want = _swiglu_ref(m, x, counts)
    with torch.no_grad():
        got = m(x, counts)
        assert m.last_path is not None and m.last_path[0] == "fused" and "both in Triton" in m.last_path[1]
        m.fused = False
        loop = m(x, counts)
        assert m.last_path is not None and m.last_path[0] == "torch" and "per expert" in m.last_path[1]
    assert _rel(got, want) < 2e-2 and _rel(loop, want) < 2e-2
