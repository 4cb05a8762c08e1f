"""The Triton kernel of ``_fp8_gemm.py`` (see its design note); imported only when it runs."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["fp8_gmm"]


@triton.jit
def _walk(t, ends, E, npn, BM: tl.constexpr):  # type: ignore[no-untyped-def]
    """Tile ``t`` of the walk over every expert's (m, n) tiles, expert e's rows ending at
    ``ends[e]``: (expert, its first row, its rows, m tile, n tile). ``E`` is a runtime value, so
    that one compiled kernel serves every expert count."""
    base = 0
    hit_e = -1
    hit_start = 0
    hit_rows = 0
    hit_base = 0
    start = 0
    for i in range(E):
        end = tl.load(ends + i)
        rows = end - start
        n_t = tl.cdiv(rows, BM) * npn
        hit = (t >= base) & (t < base + n_t) & (hit_e < 0)
        hit_e = tl.where(hit, i, hit_e)
        hit_start = tl.where(hit, start, hit_start)
        hit_rows = tl.where(hit, rows, hit_rows)
        hit_base = tl.where(hit, base, hit_base)
        base += n_t
        start = end
    local = t - hit_base
    return hit_e, hit_start, hit_rows, local // npn, local % npn


@triton.jit
def fp8_gmm(a_ptr, stride_a, as_ptr, stride_as, b_desc, b3_desc, bs_ptr, bs3_ptr, c_ptr, stride_c,  # type: ignore[no-untyped-def]
            cs_ptr, stride_cs, ends, N, K, E, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, SMS: tl.constexpr, SWIGLU: tl.constexpr):
    """``SMS`` programs walk every expert's (m, n) tiles. A tile's e4m3 rows of A (row stride
    ``stride_a``; one float32 scale per row per ``BK`` columns at ``as_ptr``) meet expert e's e4m3
    weights ``[N, K]`` (K contiguous, through ``b_desc``; one float32 scale per ``BN x BK`` block
    at ``bs_ptr``): each K block's product is scaled into a float32 accumulator. With SWIGLU the
    tile also takes ``b3`` and leaves as ``silu(acc) * acc3`` quantized to e4m3, its row's scale
    (largest / 448, one per row per ``BN`` columns) at ``cs_ptr``; otherwise as ``c_ptr``'s dtype."""
    pid = tl.program_id(0)
    npn = tl.cdiv(N, BN)
    nkb = K // BK
    total = 0
    start = 0
    for i in range(E):
        end = tl.load(ends + i)
        total += tl.cdiv(end - start, BM) * npn
        start = end
    for t in tl.range(pid, total, SMS, flatten=True):
        e, row0, rows, pm, pn = _walk(t, ends, E, npn, BM)
        om = pm * BM + tl.arange(0, BM)
        live = om < rows
        src = (row0 + om).to(tl.int64)
        ap = a_ptr + src[:, None] * stride_a + tl.arange(0, BK)[None, :]
        sp = as_ptr + src * stride_as
        bsp = bs_ptr + (e * npn + pn) * nkb
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if SWIGLU:
            acc3 = tl.zeros((BM, BN), dtype=tl.float32)
            bsp3 = bs3_ptr + (e * npn + pn) * nkb
        for ki in range(nkb):
            a = tl.load(ap + ki * BK, mask=live[:, None], other=0.0)
            sa = tl.load(sp + ki, mask=live, other=0.0)
            b = b_desc.load([e * N + pn * BN, ki * BK])
            # each K block's product promoted into float32 with its two scales (the tensor cores'
            # own FP8 accumulation keeps fewer bits than float32 over long K)
            acc += tl.dot(a, b.T) * (sa[:, None] * tl.load(bsp + ki))
            if SWIGLU:
                b3 = b3_desc.load([e * N + pn * BN, ki * BK])
                acc3 += tl.dot(a, b3.T) * (sa[:, None] * tl.load(bsp3 + ki))
        on = pn * BN + tl.arange(0, BN)
        mask = live[:, None] & (on < N)[None, :]
        ptr = c_ptr + (row0 + om).to(tl.int64)[:, None] * stride_c + on[None, :]
        if SWIGLU:
            h = acc * tl.sigmoid(acc) * acc3
            amax = tl.max(tl.abs(h), 1)
            scale = tl.where(amax > 0, amax * (1.0 / 448.0), 1.0)
            q = tl.math.div_rn(h, tl.broadcast_to(scale[:, None], h.shape))
            tl.store(ptr, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
            tl.store(cs_ptr + (row0 + om).to(tl.int64) * stride_cs + pn, scale, mask=live)
        else:
            tl.store(ptr, acc.to(c_ptr.dtype.element_ty), mask=mask)
