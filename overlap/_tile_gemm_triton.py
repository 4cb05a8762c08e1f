"""The Triton kernel of ``_tile_gemm.py`` (see its design note); imported only when it runs."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["tile_mm"]


@triton.jit
def _arrived(flag, need, err):  # type: ignore[no-untyped-def]
    """Spin until the 32-bit word at ``flag`` is >= ``need`` (compared cyclically) or ``err``
    (the peer memory's device error word, which its watchdog sets) is nonzero. Both are read by
    scalar atomics, whose one value every thread of the program sees: the threads leave together."""
    v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
    e = tl.atomic_add(err, 0, sem="relaxed", scope="sys")
    while ((v - need) < 0) & (e == 0):
        v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        e = tl.atomic_add(err, 0, sem="relaxed", scope="sys")


@triton.jit
def tile_mm(a_desc, b_desc, c_ptr, s_ptr, counters, meta, err, M, N, K, stride_c, first,  # type: ignore[no-untyped-def]
            GROUP_M: tl.constexpr, SIGNAL: tl.constexpr, META: tl.constexpr, ADD: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr, BK: tl.constexpr, SMS: tl.constexpr, FLAT: tl.constexpr, B_T: tl.constexpr):
    """``SMS`` programs walk the (BM, BN) tiles of ``A B`` group by group, starting at group
    ``first`` and wrapping round: a group is ``GROUP_M`` row tiles across every column, walked
    column by column (its rows' A and one column of B stay in L2). ``B_T``: ``b_desc`` describes
    B's transpose ``[N, K]`` (a linear layer's weight), each tile loaded and transposed.

    With ``META``, group g's row 0 is stored ``meta[g, 1]`` elements into ``c_ptr`` (``meta[g, 0]``
    0) or ``s_ptr`` (1), rows ``stride_c`` apart, else at its own row of ``c_ptr``; and each of its
    ``ADD`` sources s adds the rows at the address ``meta[g, 2 + 3 s]`` (0: none) once the flag at
    ``meta[g, 3 + 3 s]`` reaches ``meta[g, 4 + 3 s]``.
    With ``SIGNAL``, each finished tile adds one to its group's counter (``counters[g]``, int32)
    once its stores are visible to the whole system, so a copy engine waiting on the counter
    reads whole rows."""
    pid = tl.program_id(0)
    num_pm = tl.cdiv(M, BM)
    num_pn = tl.cdiv(N, BN)
    per_group = GROUP_M * num_pn
    total = num_pm * num_pn
    shift = first * per_group  # the walk's tile t is the natural order's tile (t + shift) % total
    for t in tl.range(pid, total, SMS, flatten=FLAT):
        nat = (t + shift) % total
        g = nat // per_group
        rows_g = tl.minimum(GROUP_M, num_pm - g * GROUP_M)
        local = nat - g * per_group
        pm = g * GROUP_M + local % rows_g
        pn = local // rows_g
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in range(tl.cdiv(K, BK)):
            if B_T:
                bt = b_desc.load([pn * BN, ki * BK]).T
            else:
                bt = b_desc.load([ki * BK, pn * BN])
            acc = tl.dot(a_desc.load([pm * BM, ki * BK]), bt, acc)
        om = pm * BM + tl.arange(0, BM)
        on = pn * BN + tl.arange(0, BN)
        mask = (om < M)[:, None] & (on < N)[None, :]
        if META:
            row = (om - g * GROUP_M * BM).to(tl.int64)[:, None] * stride_c + on[None, :]
            row_meta = meta + g * (2 + 3 * ADD)
            for s in tl.static_range(ADD):
                src = tl.load(row_meta + 2 + 3 * s)
                if src != 0:
                    _arrived(tl.load(row_meta + 3 + 3 * s).to(tl.pointer_type(tl.int32)),
                             tl.load(row_meta + 4 + 3 * s).to(tl.int32), err)
                    acc += tl.load(src.to(tl.pointer_type(c_ptr.dtype.element_ty)) + row, mask=mask,
                                   cache_modifier=".cg").to(tl.float32)
            row = row + tl.load(row_meta + 1)
            if tl.load(row_meta) == 0:
                ptr = c_ptr + row
            else:
                ptr = s_ptr + row
        else:
            ptr = c_ptr + om.to(tl.int64)[:, None] * stride_c + on[None, :]
        tl.store(ptr, acc.to(c_ptr.dtype.element_ty), mask=mask)
        if SIGNAL:
            tl.debug_barrier()  # every thread's stores of this tile are done before the release below
            tl.atomic_add(counters + g, 1, sem="release", scope="sys")
