"""The Triton kernel of ``_grouped_gemm.py`` (see its design note); imported only when it runs."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["gmm"]


@triton.jit
def _span(e, ends, starts, CAP: tl.constexpr, SEG: tl.constexpr):  # type: ignore[no-untyped-def]
    """Expert ``e``'s first row and its rows: compact (its rows end at ``ends[e]``), padded
    (``CAP``: its block starts at ``e * CAP``; ``ends`` holds each expert's count, int64) or
    segments (``SEG``: its rows start at ``starts[e]``; ``ends`` holds its count)."""
    if CAP:
        return e * CAP, tl.minimum(tl.load(ends + e).to(tl.int32), CAP)
    elif SEG:
        return tl.load(starts + e), tl.load(ends + e)
    else:
        start = tl.load(ends + e - 1, mask=e > 0, other=0)
        return start, tl.load(ends + e) - start


@triton.jit
def _tile(t, ends, starts, E: tl.constexpr, CAP: tl.constexpr, SEG: tl.constexpr, npn,  # type: ignore[no-untyped-def]
          BM: tl.constexpr):
    """Tile ``t`` of the walk over every expert's (m, n) tiles: (expert, its first row, its rows,
    m tile, n tile)."""
    base = 0
    hit_e = -1
    hit_start = 0
    hit_rows = 0
    hit_base = 0
    for i in range(E):
        start, rows = _span(i, ends, starts, CAP, SEG)
        n_t = tl.cdiv(rows, BM) * npn
        hit = (t >= base) & (t < base + n_t) & (hit_e < 0)
        hit_e = tl.where(hit, i, hit_e)
        hit_start = tl.where(hit, start, hit_start)
        hit_rows = tl.where(hit, rows, hit_rows)
        hit_base = tl.where(hit, base, hit_base)
        base += n_t
    local = t - hit_base
    return hit_e, hit_start, hit_rows, local // npn, local % npn


@triton.jit
def gmm(a_desc, a_ptr, index, stride_a, b_desc, b3_desc, c_ptr, ends, starts, N, K,  # type: ignore[no-untyped-def]
        stride_c, E: tl.constexpr, CAP: tl.constexpr, SEG: tl.constexpr, GATHER: tl.constexpr, BM: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, SMS: tl.constexpr, SWIGLU: tl.constexpr):
    """``SMS`` programs walk the tiles; each tile accumulates ``A B`` (and ``A B3`` with SWIGLU, then
    stores ``silu(AB) * AB3``) in float32 and stores its expert's rows only. With ``GATHER`` row i
    of A is row ``index[i]`` of ``a_ptr`` (plain loads; TMA otherwise)."""
    pid = tl.program_id(0)
    npn = tl.cdiv(N, BN)
    total = 0
    for i in range(E):
        _, rows = _span(i, ends, starts, CAP, SEG)
        total += tl.cdiv(rows, BM) * npn
    for t in tl.range(pid, total, SMS, flatten=True):
        e, row0, rows, pm, pn = _tile(t, ends, starts, E, CAP, SEG, npn, BM)
        om = pm * BM + tl.arange(0, BM)
        if GATHER:
            src = tl.load(index + row0 + om, mask=om < rows, other=0).to(tl.int64)
            ap = a_ptr + src[:, None] * stride_a + tl.arange(0, BK)[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if SWIGLU:
            acc3 = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(K // BK):
            if GATHER:
                a = tl.load(ap + ki * BK, mask=(om < rows)[:, None], other=0.0)
            else:
                a = a_desc.load([row0 + pm * BM, ki * BK])
            acc = tl.dot(a, b_desc.load([e * K + ki * BK, pn * BN]), acc)
            if SWIGLU:
                acc3 = tl.dot(a, b3_desc.load([e * K + ki * BK, pn * BN]), acc3)
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * acc3
        on = pn * BN + tl.arange(0, BN)
        mask = (om < rows)[:, None] & (on < N)[None, :]
        ptr = c_ptr + (row0 + om).to(tl.int64)[:, None] * stride_c + on[None, :]
        tl.store(ptr, acc.to(c_ptr.dtype.element_ty), mask=mask)
