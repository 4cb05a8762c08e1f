"""The ``tile_signal`` strategy: GEMM + reduce-scatter and GEMM + all-reduce as one tile-signalled
GEMM (``_tile_gemm.py``) whose finished row groups copy engines move while it runs.

Design note. ``copy_engine`` (``_copy_engine.py``) cuts the GEMM into cuBLAS calls per chunk;
here the GEMM is one persistent kernel and a chunk is a group of rows in its walk:

* The walk starts at the next rank's block and ends with this rank's own, ``chunks`` groups a
  block. A peer's group, once its tile counter is full, is pushed into that peer's slots by the
  push stream (a stream memory wait on the counter, then the copy), and the peer told by flag.
* This rank's own groups add the peers' partial sums in the kernel: a tile of own group j waits
  in the kernel for the flags of chunk j's slot (the peers' pushes), then loads those rows as
  its C operand. No chunk waits for the GEMM to end, and no pass of its own reduces.
* ``gemm_all_reduce`` then hands each reduced own group to the peers (push stream) and copies
  theirs into place as they arrive (a third stream), while the kernel computes the next group.
  Only the last group's all-gather follows the kernel.

Deadlock freedom. Every wait depends only on work issued before it on another stream or rank:
the push stream waits on counters and on the peers' consumption of a ring slot; consumption is
signalled from the pull stream (after own group j's counter), never from a stream that itself
waits on a peer; the all-gather copies run on a stream of their own. A kernel tile waiting for
chunk j holds a program whose earlier tiles are done, so every group before j completes, as
long as every program of the persistent grid is resident: ranks whose kernels share one GPU at
once (MPS) are not supported; time-sliced, as the GPU tests share one, they are. At 3
ranks or more a call reuses no ring slot (it runs fewer, larger groups, or refuses): the push
stream serves its peers one block after another, so a push waiting for one peer's consumption
can wait, around the ranks, on itself (3 ranks sharing one H200 hung so, 2026-12-03, with two
ring slots for eight groups). All of it is issued before anything blocks the host (allocations
first), inside a copy-engine section whose watchdog bounds every wait (the kernel's waits give
up when it sets the error word).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch

from collectives.errors import UnsupportedError
from collectives.peer import CE_PULLED, CE_PUSHED, CE_RING, PeerMemory, _launch, peer_unavailable
from collectives.peer._layout import ce_flag_offset

from . import _copy_engine
from . import _tile_gemm as T
from ._copy_engine import _ALIGN, _region

__all__ = ["unavailable", "fits", "refusal", "has_layout", "layout", "gemm_reduce_scatter", "gemm_all_reduce"]

def unavailable(comm: Any, device: torch.device, dtype: torch.dtype) -> str:
    """Why the strategy cannot run here, or ``""`` (shapes are checked by each call)."""
    if device.type != "cuda":
        return f"it is a CUDA kernel with copy engines; these tensors are on {device.type}"
    if dtype not in T.DTYPES:
        return f"the tile-signalled GEMM multiplies {[str(d) for d in T.DTYPES]}, not {dtype}"
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return peer_unavailable(comm)


def fits(rows: int, world: int) -> bool:
    """Whether ``rows`` split over ``world`` ranks in whole tiles, as every block must."""
    return rows > 0 and rows % (world * T.TILE_ROWS) == 0


@dataclass
class _Layout:
    """One (operator, shape, chunks) on one peer memory: groups, ring and the kernel's meta."""
    m: int            # rows of a rank's block
    per_block: int    # groups a block
    group_rows: int
    region: int       # bytes of one group's rows in a slot
    ring: int
    tiles: list[int]  # each group's full counter
    meta: torch.Tensor
    counters: torch.Tensor


_LAYOUTS: WeakKeyDictionary[Any, dict[tuple[Any, ...], _Layout]] = WeakKeyDictionary()  # per peer memory


def _key(op: str, rows: torch.Tensor, b: torch.Tensor, chunks: int) -> tuple[Any, ...]:
    # K and b's orientation too: the kernel is compiled for them (Triton specialises on K's divisibility)
    return (op, rows.shape[0], b.shape[0], b.shape[1], b.is_contiguous(), rows.dtype, chunks)


def has_layout(pm: PeerMemory, op: str, rows: torch.Tensor, b: torch.Tensor, chunks: int) -> bool:
    """Whether ``op`` ("rs" or "ar") at this shape has its layout on ``pm``: a capture can run it."""
    held = _LAYOUTS.get(pm)
    return held is not None and _key(op, rows, _operand(b), chunks) in held


def _groups(world: int, slot_bytes: int, op: str, total: int, n: int, es: int, chunks: int) -> tuple[int, int, int, int]:
    """(groups a block, rows a group, bytes of a group's region, ring slots); ``UnsupportedError``
    for a shape the strategy cannot take (before anything is sent)."""
    if not fits(total, world):
        raise UnsupportedError("strategy", "tile_signal", f"needs rows in whole tiles of {T.TILE_ROWS} per rank; "
                               f"{total} rows over {world} ranks are not", "use 'copy_engine' at this shape")
    if n < 1:
        raise UnsupportedError("strategy", "tile_signal", "has no columns to compute (N = 0)", "use 'sequential'")
    tiles_b = total // world // T.TILE_ROWS
    budget = slot_bytes if op == "rs" else slot_bytes // 2 // _ALIGN * _ALIGN
    most = CE_RING if op == "rs" else CE_RING // 2
    per = _divisor(tiles_b, -(-tiles_b // max(1, min(chunks, tiles_b))))  # groups line up with the blocks
    while True:
        per_block, group_rows = tiles_b // per, per * T.TILE_ROWS
        region = _region(group_rows, n, es)
        ring = min(most, budget // (world * region))
        # At 3 ranks or more no ring slot is reused within a call ("Deadlock freedom"): fewer groups
        if world == 2 or ring >= per_block or per == tiles_b:
            break
        per = _divisor(tiles_b, per + 1)
    if ring < 1 or (world > 2 and ring < per_block):
        raise UnsupportedError("chunks", chunks, f"groups of {group_rows} rows need {world * region} B of peer slots "
                               f"each{'' if world == 2 else f', {per_block} of them at once at {world} ranks'}, more "
                               f"than the {budget} B available",
                               "raise COMMOPS_PEER_BYTES (or pass more chunks at 2 ranks)")
    return per_block, group_rows, region, ring


def refusal(pm: PeerMemory, op: str, rows: torch.Tensor, b: torch.Tensor, chunks: int) -> str:
    """Why ``op`` cannot take this shape on ``pm`` (``layout`` would raise it), or ``""``."""
    why = T.supported(rows if rows.is_contiguous() else rows.contiguous(), _operand(b))  # as _run passes them
    if why:
        return why
    try:
        _groups(pm.world, pm.slot_bytes, op, rows.shape[0], b.shape[1], rows.element_size(), chunks)
    except UnsupportedError as exc:
        return str(exc)
    return ""


def layout(pm: PeerMemory, op: str, rows: torch.Tensor, b: torch.Tensor, chunks: int) -> _Layout:
    """``op``'s layout at this shape on ``pm``, built (and its kernel compiled) on first use: eagerly,
    never while capturing. Raises ``UnsupportedError`` for a shape the strategy cannot take."""
    w, r, es = pm.world, pm.rank, rows.element_size()
    total, n = rows.shape[0], b.shape[1]
    held = _LAYOUTS.setdefault(pm, {})
    key = _key(op, rows, b, chunks)
    lay = held.get(key)
    if lay is not None:
        return lay
    if _capturing():
        raise UnsupportedError("strategy", "tile_signal", f"has no layout for {total}x{b.shape[0]}x{n} yet, and "
                               "building one (a copy to the GPU, a compile) cannot be captured",
                               "call the operator once at this shape before capturing")
    why = T.supported(rows, b)
    if why:
        raise UnsupportedError("strategy", "tile_signal", f"cannot take these operands: {why}", "use 'copy_engine'")
    per_block, group_rows, region, ring = _groups(w, pm.slot_bytes, op, total, n, es, chunks)
    m = total // w
    peers = [(r + d) % w for d in range(1, w)]
    rows_meta = []
    for g in range(w * per_block):
        q, j = divmod(g, per_block)
        if q != r:
            # rs: the partial rows wait in staging, peers in walk order; ar: in place in `out`
            off = (((q - r - 1) % w) * m if op == "rs" else q * m) + j * group_rows
            rows_meta.append([1 if op == "rs" else 0, off * n] + [0, 0, 0] * len(peers))
            continue
        s, u = j % ring, j // ring
        srcs = []
        for p in peers:  # peer p's partial sums of chunk j, in this rank's slot s
            srcs += [pm.slot_pointers[r] + (s * w + p) * region, pm.flag_pointers[r] + ce_flag_offset(s, CE_PUSHED, p),
                     u + 1]
        rows_meta.append([0, ((0 if op == "rs" else r * m) + j * group_rows) * n] + srcs)
    lay = _Layout(m, per_block, group_rows, region, ring, T.tiles(total, n, group_rows),
                  torch.tensor(rows_meta, dtype=torch.int64, device=rows.device),
                  T.counters_for(total, group_rows, rows.device))
    # Compile this specialisation now, outside the section: a cold compile takes seconds that the
    # peers would spend in the kernel's waits. The same launch without sources waits for nothing.
    idle = lay.meta.clone()
    idle[:, 2::3] = 0
    scratch = rows.new_empty((total, n))
    T.tile_mm(rows, b, scratch, counters=lay.counters, group_rows=group_rows, first=((r + 1) % w) * per_block,
              meta=idle, staging=scratch, err=pm._err_dev)
    _synchronize(rows.device)
    held[key] = lay
    return lay


def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _synchronize(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


def _divisor(n: int, at_least: int) -> int:
    """The smallest divisor of ``n`` that is at least ``at_least``."""
    d = max(1, at_least)
    while n % d:
        d += 1
    return d


class _Streams(_copy_engine._Streams):
    """``copy_engine``'s compute and copy streams (push: pushes; pull: consumption signals) and a
    third, per device, for the all-gather's copies into place."""

    _gathers: dict[int, torch.cuda.Stream] = {}

    def __init__(self, pm: PeerMemory) -> None:
        super().__init__(pm)
        gather = self._gathers.get(pm.device_index)
        if gather is None:
            gather = self._gathers[pm.device_index] = torch.cuda.Stream(pm.device)
        self.gather, self.gs = gather, gather.cuda_stream

    def fork(self) -> None:
        for side in (self.push, self.pull, self.gather):
            self.after_main(side)

    def join(self) -> None:  # type: ignore[override]
        super().join(self.push, self.pull, self.gather)


def _counter(lay: _Layout, g: int) -> int:
    return lay.counters.data_ptr() + 4 * g


def _run(pm: PeerMemory, op: str, rows: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
    w, r, es = pm.world, pm.rank, rows.element_size()
    n = b.shape[1]
    lay = layout(pm, op, rows, _operand(b), chunks)
    m, c, gr = lay.m, lay.per_block, lay.group_rows
    out = rows.new_empty((m if op == "rs" else w * m, n))
    staging = rows.new_empty(((w - 1) * m, n)) if op == "rs" else out
    peers = [(r + d) % w for d in range(1, w)]
    nbytes = gr * n * es
    ce = pm.copy_engines
    st = _Streams(pm)
    ce.open()
    lay.counters.zero_()
    st.fork()  # the side streams after the zeroed counters and the operands
    T.tile_mm(rows, b, out, counters=lay.counters, group_rows=gr, first=((r + 1) % w) * c, meta=lay.meta,
              staging=staging, err=pm._err_dev)

    def partial(q: int, j: int) -> int:  # where peer q's partial rows of chunk j wait
        return staging.data_ptr() + ((((q - r - 1) % w) * m if op == "rs" else q * m) + j * gr) * n * es

    for q in peers:  # the walk's order: the next rank's block first
        for j in range(c):
            s, u = j % lay.ring, j // lay.ring
            _launch.wait_value(st.ps, _counter(lay, q * c + j), lay.tiles[q * c + j])
            if u:
                ce.wait(st.ps, s, CE_PULLED, u, kernel=False, source=q)  # q has added this slot's last use
            ce.push(st.ps, q, (s * w + r) * lay.region, partial(q, j), nbytes)
            ce.signal(st.ps, q, s, CE_PUSHED, u + 1)
    for j in range(c):  # own group j added the peers' chunk j: their slot s is free again
        s, u = j % lay.ring, j // lay.ring
        _launch.wait_value(st.ls, _counter(lay, r * c + j), lay.tiles[r * c + j])
        for q in peers:
            ce.signal(st.ls, q, s, CE_PULLED, u + 1)
    if op == "ar":
        _gather(pm, st, lay, out, peers, nbytes)
    st.join()
    ce.close()
    return out


def _gather(pm: PeerMemory, st: _Streams, lay: _Layout, out: torch.Tensor, peers: list[int], nbytes: int) -> None:
    """Each reduced own group to every peer as soon as its counter is full (push stream), and the
    peers' reduced groups copied into place as they land (gather stream)."""
    w, r, es, n = pm.world, pm.rank, out.element_size(), out.shape[1]
    m, c, gr = lay.m, lay.per_block, lay.group_rows
    half, ag0 = pm.slot_bytes // 2 // _ALIGN * _ALIGN, CE_RING // 2
    ce = pm.copy_engines
    for j in range(c):
        s, u = ag0 + j % lay.ring, j // lay.ring
        _launch.wait_value(st.ps, _counter(lay, r * c + j), lay.tiles[r * c + j])
        for q in peers:
            if u:
                ce.wait(st.ps, s, CE_PULLED, u, kernel=False, source=q)
            ce.push(st.ps, q, half + ((s - ag0) * w + r) * lay.region, out.data_ptr() + (r * m + j * gr) * n * es,
                     nbytes)
            ce.signal(st.ps, q, s, CE_PUSHED, u + 1)
    for j in range(c):
        s, u = ag0 + j % lay.ring, j // lay.ring
        for q in peers:
            ce.wait(st.gs, s, CE_PUSHED, u + 1, kernel=False, source=q)
            ce.take(st.gs, half + ((s - ag0) * w + q) * lay.region, out.data_ptr() + (q * m + j * gr) * n * es,
                    nbytes)
            ce.signal(st.gs, q, s, CE_PULLED, u + 1)


def gemm_reduce_scatter(pm: PeerMemory, rows: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
    """This rank's ``[M / w, N]`` block of the sum over ranks of ``rows @ b``."""
    return _run(pm, "rs", rows.contiguous(), _operand(b), chunks)


def gemm_all_reduce(pm: PeerMemory, rows: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
    """The sum over ranks of ``rows @ b``, on every rank."""
    return _run(pm, "ar", rows.contiguous(), _operand(b), chunks)


def _operand(b: torch.Tensor) -> torch.Tensor:
    """``b`` as the kernel reads it: contiguous, or the transpose of a contiguous weight."""
    return b if b.is_contiguous() or b.t().is_contiguous() else b.contiguous()
