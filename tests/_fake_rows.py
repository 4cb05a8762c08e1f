"""A stand-in for the peer MoE transport's memory and kernels on CPU threads.

Every rank is a thread; its slot buffer is a CPU byte tensor every rank can read, ``ce_open`` is
a barrier of the threads, and each kernel of ``overlap/moe/rows.cu`` that
the peer transport (``overlap/moe/peer_kernels.py``, ``pipeline.py``,
``peer_rows.py``) launches is done here, at once, by plain loops over the same
addresses (the launch's pointers are host addresses on CPU), as its comment in rows.cu
specifies. What this checks is the Python side: regions, offsets, the order of calls and
barriers, the autograd wiring; the kernels themselves are checked on GPUs
(``tests/gpu_overlap_check.py``).
"""

from __future__ import annotations

import copy
import ctypes
import threading
from typing import Any

import torch

IDS_HEADER = 16


def _layout_tile() -> int:
    """Tokens per block of rows_ids / rows_layout: the host code's constant (a test may shrink it
    so that a few tokens span several tiles)."""
    from overlap.moe import peer_kernels

    return peer_kernels.LAYOUT_TILE


_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def _at(ptr: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements of ``dtype`` at host address ``ptr`` (shared, writable)."""
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


class Hub:
    def __init__(self, world: int, slot_bytes: int) -> None:
        self.world = world
        self.slots = [torch.zeros(slot_bytes, dtype=torch.uint8) for _ in range(world)]
        self.barrier = threading.Barrier(world, timeout=30)
        self.fences = [0] * world
        self.flags: list[dict[tuple[int, int, int], int]] = [{} for _ in range(world)]  # copy-engine flags
        self.flagged = threading.Condition()


class FakeMemory:
    """What ``PeerRows`` uses of a ``PeerMemory``."""

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.rank, self.world = hub, rank, hub.world
        self.slot_bytes = hub.slots[0].numel()
        self.device = torch.device("cpu")
        self.device_index = 0
        self.closed = False
        self.copy_engines = FakeCopyEngines(self)

    def slot_view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        es = torch.empty((), dtype=dtype).element_size()
        n = 1
        for d in shape:
            n *= d
        assert offset % es == 0 and 0 <= offset and offset + n * es <= self.slot_bytes, (offset, shape)
        return self.hub.slots[self.rank][offset:offset + n * es].view(dtype).view(shape)

    def barrier(self, clear: bool = False) -> None:
        self.hub.fences[self.rank] += 1
        self.hub.barrier.wait()
        if clear:
            with self.hub.flagged:
                self.hub.flags[self.rank].clear()

    def ce_open(self) -> None:
        raise AssertionError("the MoE transport opens no copy-engine section: its barriers are barrier()")

    def ce_close(self) -> None:
        raise AssertionError("the MoE transport closes no copy-engine section: its barriers are barrier()")

    # -- copy engines: a copy is done when issued (every rank is a thread issuing in its order)
    @property
    def slot_pointers(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.hub.slots)

    def check(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def _slot(self, q: int, offset: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        es = torch.empty((), dtype=dtype).element_size()
        assert 0 <= offset and offset + n * es <= self.slot_bytes, (q, offset, n)
        return self.hub.slots[q][offset:offset + n * es].view(dtype)

    def stream(self) -> None:
        return None

    def kernel(self, kind: str, dtype: torch.dtype | None, vec: bool, nargs: int = 4,
               bases: tuple[int, ...] | None = None, source: Any = None) -> Any:
        assert source is not None and source.name == "rows.cu", (kind, source)  # the MoE kernels' own source
        target = self
        if bases is not None:  # "rank q's buffer" is this rank's, moved by bases[q] bytes
            target = copy.copy(self)
            target._slot = lambda q, offset, n, dtype: FakeMemory._slot(self, self.rank, offset + bases[q], n, dtype)
        fn = getattr(target, "_k_" + kind)
        return lambda grid, stream, *args: fn(dtype, *args)

    # -- the kernels (kernels.cu, "rows: indexed row copies and weighted row sums") --------------
    def _k_rows_gather(self, dtype: torch.dtype, src_p: int, ptr_p: int, dst_p: int, out_p: int, n: int, row: int,
                       off: int) -> None:
        ptr = _at(ptr_p, n + 1, torch.int64)
        src = _at(src_p, 2 * n, torch.int64).view(n, 2)
        dst = _at(dst_p, int(ptr[n]), torch.int64)
        out = _at(out_p, (int(dst.max()) + 1) * row, dtype).view(-1, row)
        es = out.element_size()
        for i in range(n):
            s, r = src[i].tolist()
            for d in dst[ptr[i]:ptr[i + 1]].tolist():
                out[d] = self._slot(s, off + r * row * es, row, dtype)

    def _k_rows_partial(self, dtype: torch.dtype, item_p: int, ptr_p: int, ent_p: int, rows_p: int, n: int, row: int,
                        p_off: int, w_off: int) -> None:
        ptr = _at(ptr_p, n + 1, torch.int64)
        item = _at(item_p, 2 * n, torch.int64).view(n, 2)
        ent = _at(ent_p, 2 * int(ptr[n]), torch.int64).view(-1, 2)
        rows = _at(rows_p, (int(ent[:, 0].max()) + 1) * row, dtype).view(-1, row)
        es = rows.element_size()
        for i in range(n):
            s, prow = item[i].tolist()
            acc = torch.zeros(row, dtype=torch.float32)
            for r, pair in ent[ptr[i]:ptr[i + 1]].tolist():
                acc += self._slot(s, w_off + pair * 4, 1, torch.float32)[0] * rows[r].float()
            self._slot(self.rank, p_off + prow * row * es, row, dtype).copy_(acc.to(dtype))

    def _k_rows_sum(self, dtype: torch.dtype, ptr_p: int, ent_p: int, out_p: int, n: int, row: int,
                    p_off: int) -> None:
        ptr = _at(ptr_p, n + 1, torch.int64)
        ent = _at(ent_p, 2 * int(ptr[n]), torch.int64).view(-1, 2)
        out = _at(out_p, n * row, dtype).view(n, row)
        es = out.element_size()
        for t in range(n):
            acc = torch.zeros(row, dtype=torch.float32)
            for q, prow in ent[ptr[t]:ptr[t + 1]].tolist():
                acc += self._slot(q, p_off + prow * row * es, row, dtype).float()
            out[t] = acc.to(dtype)

    # -- the kernels (kernels.cu, "rows, laid out on the device") ----------------------------------
    def _geometry(self, ke: int) -> tuple[int, int]:
        return ke & 0xFF, (ke >> 8) & 0xFFFF

    def _k_rows_post(self, _: Any, x_off: int, i_off: int, x_p: int, x_bytes: int, ids_p: int, n_ids: int, T: int,
                     info_p: int, n_info: int) -> None:
        self._slot(self.rank, x_off, x_bytes, torch.uint8).copy_(_at(x_p, x_bytes, torch.uint8))
        head = self._slot(self.rank, i_off, IDS_HEADER + n_ids, torch.int32)
        head[IDS_HEADER:] = _at(ids_p, n_ids, torch.int64).to(torch.int32)
        head[0] = T
        _at(info_p, n_info, torch.int32).zero_()

    def _k_rows_ids(self, _: Any, i_off: int, t_max: int, ke: int, info_p: int, ids_p: int, tiles_p: int) -> None:
        k, e_loc = self._geometry(ke)
        tile_n = _layout_tile()
        W, n_tiles = self.world, -(-t_max // tile_n)
        info = _at(info_p, W * e_loc + 2 * W + 2, torch.int32)
        ids_all = _at(ids_p, W * t_max * k, torch.int32).view(W, t_max, k)
        tiles = _at(tiles_p, W * n_tiles * e_loc, torch.int32).view(W, n_tiles, e_loc)
        own = self._slot(self.rank, i_off, IDS_HEADER, torch.int32)
        n_own = int(own[0])
        mine = self._slot(self.rank, i_off, IDS_HEADER + n_own * k, torch.int32)[IDS_HEADER:]
        for q in range(W):
            n = int(self._slot(q, i_off, 1, torch.int32)[0])
            ids = self._slot(q, i_off, IDS_HEADER + n * k, torch.int32)[IDS_HEADER:].view(n, k)
            ids_all[q, :n] = ids
            if ((ids < 0) | (ids >= W * e_loc)).any() and int(info[W * e_loc + 2 * W]) == 0:
                info[W * e_loc + 2 * W] = q + 1
            if any(len(set(row)) < k for row in ids.tolist()) and int(info[W * e_loc + 2 * W + 1]) == 0:
                info[W * e_loc + 2 * W + 1] = q + 1
            info[W * e_loc + q] = n
            info[W * e_loc + W + q] = int((torch.div(mine, e_loc, rounding_mode="floor") == q).sum())
            for tile in range(n_tiles):  # each tile's pairs per local expert of this rank
                part = ids[tile * tile_n:(tile + 1) * tile_n]
                for e in range(e_loc):
                    tiles[q, tile, e] = int((part == self.rank * e_loc + e).sum())

    def _k_rows_layout(self, _: Any, t_max: int, ke: int, r_p: int, info_p: int, ids_p: int, tiles_p: int) -> None:
        k, e_loc = self._geometry(ke)
        tile_n = _layout_tile()
        W, n_tiles = self.world, -(-t_max // tile_n)
        info = _at(info_p, W * e_loc + 2 * W + 2, torch.int32)
        ids_all = _at(ids_p, W * t_max * k, torch.int32).view(W, t_max, k)
        R = _at(r_p, W * t_max * e_loc, torch.int32).view(W, t_max, e_loc)
        tiles = _at(tiles_p, W * n_tiles * e_loc, torch.int32).view(W, n_tiles, e_loc)
        for s in range(W):
            n = int(info[W * e_loc + s])
            for e in range(e_loc):
                target = self.rank * e_loc + e
                for tile in range(max(1, -(-n // tile_n))):  # as the kernel's blocks: from the tiles before
                    run = int(tiles[s, :tile, e].sum())
                    for t in range(tile * tile_n, min(n, (tile + 1) * tile_n)):
                        if target in ids_all[s, t].tolist():
                            R[s, t, e] = run
                            run += 1
                        else:
                            R[s, t, e] = -1
                info[s * e_loc + e] = run
                at = (W * e_loc + 2 * W + 2 + 1) // 2 * 2  # the int64 rows per local expert (kernels.cu)
                totals = _at(info_p + 4 * at, e_loc, torch.int64)
                totals[e] += run

    def _pairs_here(self, info: torch.Tensor, ids_all: torch.Tensor, R: torch.Tensor, e_loc: int, cap: int = 0,
                    by_source: bool = False) -> Any:
        """(s, t, [(j, recv_x row)]) for every (source, token) with pairs on this rank (``cap``:
        the padded layout; ``by_source``: the compact layout by source, this rank's first, then expert)."""
        W = self.world
        cnt = info[:W * e_loc].view(W, e_loc)
        base, run = {}, 0
        order = [(e, (self.rank + i) % W) for i in range(W) for e in range(e_loc)] if by_source and not cap else \
            [(e, s) for e in range(e_loc) for s in range(W)]
        for e, s in order:
            if cap and s == 0:
                run = e * cap
            base[(e, s)] = run
            run += int(cnt[s, e])
        for s in range(W):
            for t in range(int(info[W * e_loc + s])):
                here = []
                for j, ex in enumerate(ids_all[s, t].tolist()):
                    e = ex - self.rank * e_loc
                    if 0 <= e < e_loc:
                        here.append((j, base[(e, s)] + int(R[s, t, e])))
                if here:
                    yield s, t, here

    def _tables(self, r_p: int, info_p: int, ids_p: int, t_max: int, ke: int) -> tuple[Any, ...]:
        k, e_loc = self._geometry(ke)
        W = self.world
        return (k, e_loc, _at(info_p, W * e_loc + 2 * W + 2, torch.int32),
                _at(ids_p, W * t_max * k, torch.int32).view(W, t_max, k),
                _at(r_p, W * t_max * e_loc, torch.int32).view(W, t_max, e_loc))

    def _k_rows_gather_dense(self, dtype: torch.dtype, x_off: int, r_p: int, info_p: int, ids_p: int, out_p: int,
                             t_max: int, row: int, ke: int) -> None:
        k, e_loc, info, ids_all, R = self._tables(r_p, info_p, ids_p, t_max, ke)
        cap = ke >> 32
        total = e_loc * cap if cap else int(info[:self.world * e_loc].sum())
        out = _at(out_p, total * row, dtype).view(total, row)
        for s, t, here in self._pairs_here(info, ids_all, R, e_loc, cap):
            x = self._slot(s, x_off + t * row * out.element_size(), row, dtype)
            for _, d in here:
                out[d] = x

    def _k_rows_partial_dense(self, dtype: torch.dtype, p_off: int, w_off: int, r_p: int, info_p: int, ids_p: int,
                              rows_p: int, t_max: int, row: int, ke: int) -> None:
        k, e_loc, info, ids_all, R = self._tables(r_p, info_p, ids_p, t_max, ke)
        cap = ke >> 32
        total = e_loc * cap if cap else int(info[:self.world * e_loc].sum())
        rows = _at(rows_p, total * row, dtype).view(total, row)
        es = rows.element_size()
        only = ((ke >> 24) & 0x7F) - 1  # a source filter: source `only`'s tokens alone
        for s, t, here in self._pairs_here(info, ids_all, R, e_loc, cap, bool(ke >> 31 & 1)):
            if only >= 0 and s != only:
                continue
            w = self._slot(s, w_off + t * k * 4, k, torch.float32)
            acc = torch.zeros(row, dtype=torch.float32)
            for j, d in here:
                acc += w[j] * rows[d].float()
            self._slot(self.rank, p_off + (s * t_max + t) * row * es, row, dtype).copy_(acc.to(dtype))

    def _k_rows_index_dense(self, _: Any, r_p: int, info_p: int, ids_p: int, index_p: int, t_max: int,
                            ke: int, seg_p: int) -> None:
        k, e_loc, info, ids_all, R = self._tables(r_p, info_p, ids_p, t_max, ke)
        W = self.world
        index = _at(index_p, int(info[:W * e_loc].sum()), torch.int32)
        for s, t, here in self._pairs_here(info, ids_all, R, e_loc, 0, bool(ke >> 31 & 1)):
            for _, d in here:
                index[d] = s * t_max + t
        if seg_p:  # [first row, rows, end within the source, first row after the own rows] per (s, e)
            seg = _at(seg_p, 4 * W * e_loc, torch.int32).view(4, W, e_loc)
            cnt = info[:W * e_loc].view(W, e_loc).tolist()
            at = 0
            for s in [(self.rank + i) % W for i in range(W)]:  # the by-source layout: own rows first
                for e in range(e_loc):
                    seg[0, s, e] = at
                    at += cnt[s][e]
            seg[1] = torch.tensor(cnt, dtype=torch.int32)
            seg[2] = seg[1].cumsum(1)
            seg[3] = seg[0] - sum(cnt[self.rank])

    def _k_rows_sum_dense(self, dtype: torch.dtype, p_off: int, ids_p: int, out_p: int, t_max: int, row: int, ke: int,
                          n: int) -> None:
        k, e_loc = self._geometry(ke)
        ids_all = _at(ids_p, self.world * t_max * k, torch.int32).view(self.world, t_max, k)
        out = _at(out_p, n * row, dtype).view(n, row)
        es = out.element_size()
        for t in range(n):
            ranks = sorted({x // e_loc for x in ids_all[self.rank, t].tolist()})
            acc = torch.zeros(row, dtype=torch.float32)
            for q in ranks:
                acc += self._slot(q, p_off + (self.rank * t_max + t) * row * es, row, dtype).float()
            out[t] = acc.to(dtype)

    def _k_rows_grad_dense(self, dtype: torch.dtype, x_off: int, w_off: int, d_off: int, r_p: int, info_p: int,
                           ids_p: int, rows_p: int, grad_p: int, t_max: int, row: int, ke: int, dots: int) -> None:
        k, e_loc, info, ids_all, R = self._tables(r_p, info_p, ids_p, t_max, ke)
        cap = ke >> 32
        total = e_loc * cap if cap else int(info[:self.world * e_loc].sum())
        rows = _at(rows_p, total * row, dtype).view(total, row)
        grad = _at(grad_p, total * row, dtype).view(total, row)
        es = rows.element_size()
        D = self._slot(self.rank, d_off, self.world * t_max * k, torch.float32).view(self.world, t_max, k)
        for s, t, here in self._pairs_here(info, ids_all, R, e_loc, cap):
            g = self._slot(s, x_off + t * row * es, row, dtype).float()
            w = self._slot(s, w_off + t * k * 4, k, torch.float32)
            for j, d in here:
                grad[d] = (w[j] * g).to(dtype)
                if dots:
                    D[s, t, j] = float((g * rows[d].float()).sum())

    def _k_rows_dots_dense(self, _: Any, d_off: int, ids_p: int, gw_p: int, t_max: int, ke: int, n: int) -> None:
        k, e_loc = self._geometry(ke)
        ids_all = _at(ids_p, self.world * t_max * k, torch.int32).view(self.world, t_max, k)
        gw = _at(gw_p, n * k, torch.float32).view(n, k)
        for t in range(n):
            for j, ex in enumerate(ids_all[self.rank, t].tolist()):
                q = ex // e_loc
                gw[t, j] = self._slot(q, d_off, self.world * t_max * k, torch.float32).view(
                    self.world, t_max, k)[self.rank, t, j]


def run_ranks(world: int, slot_bytes: int, fn: Any) -> list[Any]:
    """``fn(memory, rank)`` on one thread per rank; re-raises the first error."""
    hub = Hub(world, slot_bytes)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(FakeMemory(hub, rank), rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


class FakeCopyEngines:
    """What the MoE transport uses of a ``CopyEngines``: a copy is done when issued (every rank
    is a thread issuing in its order)."""

    def __init__(self, pm: FakeMemory) -> None:
        self.pm = pm

    @property
    def streams(self) -> tuple[None, None]:
        return None, None

    def push(self, stream: Any, peer: int, offset: int, src: int, nbytes: int) -> None:
        assert 0 <= offset and offset + nbytes <= self.pm.slot_bytes, (peer, offset, nbytes)
        self.pm.hub.slots[peer][offset:offset + nbytes].copy_(_at(src, nbytes, torch.uint8))

    def signal(self, stream: Any, peer: int, slot: int, stage: int, value: int) -> None:
        with self.pm.hub.flagged:
            self.pm.hub.flags[peer][(slot, stage, self.pm.rank)] = value
            self.pm.hub.flagged.notify_all()

    def wait(self, stream: Any, slot: int, stage: int, value: int, *, kernel: bool | None = None,
                source: int | None = None) -> None:
        mine = self.pm.hub.flags[self.pm.rank]
        peers = [q for q in range(self.pm.world) if q != self.pm.rank and source in (None, q)]
        with self.pm.hub.flagged:
            if not self.pm.hub.flagged.wait_for(lambda: all(mine.get((slot, stage, q), 0) >= value for q in peers), 30):
                raise TimeoutError(f"rank {self.pm.rank}: copy-engine flag ({slot}, {stage}) never reached {value}")
