"""The peer transport's buffer and the launch of each of its row kernels (``overlap/moe/rows.cu``).

Design note. ``RowKernels`` owns one dispatcher's peer buffer (``PeerMemory``) and turns tensors
and regions of the buffer into the pointers, sizes and stream each row kernel takes: one method
per launch (``_post``, ``_layout``, ``_gather``, ``_partial``, ``_sum``), plus the barriers
between them. Each call (a dispatch or a combine) uses one half of the buffer, the halves
alternating; a call writes its half only after a barrier (``_fence``) of the previous call,
which every peer enters after it has finished reading that half two calls ago. The barriers
are bounded (``timeout_s``); after one gives up the kernels do nothing and the next call raises
``CollectiveTimeout`` naming the peer. What the exchanges do with these launches is
``peer_rows.py``'s; the pipelines are ``pipeline.py``'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from collectives.errors import InvalidArgumentError
from collectives.peer import PeerMemory, _launch
from collectives.peer.memory import PACK_BYTES

from .peer_plan import BAD_RANGE, BAD_REPEAT, DeviceLayout, Region, buffer_bytes, errors_at, layout_bytes, totals_at
from .routing import bad_routing

__all__ = ["RowKernels", "LAYOUT_TILE", "MAX_GRID"]

# The row kernels: compiled after collectives/peer/peer.cuh, against the same struct Ctx (PeerMemory.kernel).
ROWS_SOURCE = Path(__file__).with_name("rows.cu")
_WARPS_PER_BLOCK = 16  # 512 threads (rows.cu's __launch_bounds__)
_THREADS = 32 * _WARPS_PER_BLOCK
MAX_GRID = 256
# the dense kernels split an item's row over up to this many warps when items are few (decode)
_ROW_SLICES = 8
LAYOUT_TILE = 512  # tokens per block of rows_ids and rows_layout (rows.cu)


class RowKernels:
    """One dispatcher's peer buffer (two halves of ``layout_bytes``) and the launches of its row
    kernels. Built once, collective; ``close()`` is collective.

    Args:
        comm: the expert-parallel communicator (the GPUs of one node).
        max_tokens: the most tokens one dispatch takes on any rank.
        top_k: the k of every routing.
        row_bytes: bytes of one row (hidden x element size).
        num_experts: ``E`` (the device-side layout checks the ids against it).
        timeout_s: how long a barrier waits for a peer (``PeerMemory``'s).
        memory: use this ``PeerMemory`` instead of building one (at least ``buffer_bytes``).
        pipeline_transfers: "auto", "sm" or "copy_engine" (``pipelined_dense``); "copy_engine"
            sizes the buffer for that pipeline too.
    """

    def __init__(self, comm: Any, max_tokens: int, top_k: int, row_bytes: int, num_experts: int,
                 timeout_s: float | None = None, memory: Any = None, pipeline_transfers: str = "auto") -> None:
        self.max_tokens, self.top_k, self.row_bytes = max_tokens, top_k, row_bytes
        self.world, self.rank = comm.size, comm.rank
        self.e_loc = num_experts // comm.size
        self.half = layout_bytes(comm.size, max_tokens, top_k, row_bytes)[2]
        self.slot_bytes_needed = buffer_bytes(comm.size, max_tokens, top_k, row_bytes,
                                              copy_engine=pipeline_transfers == "copy_engine")
        if memory is None:
            # the row kernels compiled before PeerMemory's construction lines the ranks up on the
            # host: a cold compile takes seconds, which a first dispatch's peers would otherwise
            # wait out inside a bounded barrier on the GPU (a memory given: compiled on first use)
            _launch.compile_module(torch.cuda.current_device(), "rows_post", ROWS_SOURCE)
        self.pm = memory if memory is not None else PeerMemory(comm, slot_bytes=self.slot_bytes_needed,
                                                               timeout_s=timeout_s)
        self.calls = 0  # the same on every rank: every rank makes the same calls
        # how a pipelined forward moves its rows: "auto" (SM kernels: _pipeline_mode), "sm" or
        # "copy_engine" (the buffer must have been sized for it); last_pipeline says what the last
        # one did and why
        self.pipeline_transfers = pipeline_transfers
        self.last_pipeline: tuple[str, str] | None = None
        self._side: torch.cuda.Stream | None = None  # the pipelined section's stream
        self._pinned: torch.Tensor | None = None  # the pipeline by source's counts, on the host
        # a list: pipelined_sources appends (step, CUDA event on the caller's stream) after each of
        # its steps, for a timeline of one call (events cost the stream nothing measurable)
        self.trace: list[tuple[str, Any]] | None = None

    def _next_half(self) -> int:
        off = (self.calls % 2) * self.half
        self.calls += 1
        return off

    def _fence(self) -> None:
        self.pm.barrier()  # a barrier of every rank on the current stream (bounded)

    def _grid(self, n: int) -> int:
        return max(1, min(MAX_GRID, -(-n // _WARPS_PER_BLOCK)))

    def _vec(self, *ptrs: int, row_bytes: int | None = None) -> bool:
        """Whether rows of ``row_bytes`` (default: the tokens') at these addresses take 16-byte packs."""
        nbytes = self.row_bytes if row_bytes is None else row_bytes
        return nbytes % PACK_BYTES == 0 and all(p % PACK_BYTES == 0 for p in ptrs)

    def _check_tokens(self, n: int) -> None:
        if n > self.max_tokens:
            raise InvalidArgumentError("x", n, f"has {n} tokens; the peer transport was built for max_tokens="
                                       f"{self.max_tokens}", f"pass max_tokens>={n} to MoEDispatcher")

    def _check_rows(self, x: torch.Tensor, packed: bool = False) -> None:
        """``packed``: rows of raw bytes in 4-byte words (the FP8 dispatch's), no wider than the tokens'."""
        self._check_tokens(x.shape[0])
        nbytes = x.shape[1] * x.element_size()
        if packed:
            if x.dtype != torch.float32 or nbytes > self.row_bytes:
                raise InvalidArgumentError("packed", x, f"is not rows of 4-byte words of at most {self.row_bytes} B "
                                           "(the tokens' rows the peer transport was built for)",
                                           "pack rows no wider than the tokens (fp8.packed_width)")
        elif nbytes != self.row_bytes:
            raise InvalidArgumentError("x", x, f"has rows of {x.shape[1] * x.element_size()} B; the peer transport was "
                                       f"built for {self.row_bytes} B", "pass dtype= to MoEDispatcher and keep it")

    def _check_weights(self, rows: torch.Tensor, weights: torch.Tensor, tokens: int) -> int:
        hidden = self.row_bytes // rows.element_size()
        if rows.dim() != 2 or rows.shape[1] != hidden:
            raise InvalidArgumentError("expert_out", rows, f"is not [rows, {hidden}] {rows.dtype} (the rows the peer "
                                       f"transport was built for: {self.row_bytes} B)", "pass rows in recv_x's layout")
        if tuple(weights.shape) != (tokens, self.top_k):
            raise InvalidArgumentError("topk_weights", weights, f"is not [{tokens}, {self.top_k}] (the dispatch's "
                                       "tokens and k)", "pass the weights of the dispatched tokens")
        return hidden

    def _region(self, off: int, t_max: int) -> Region:
        wb, ib, _ = layout_bytes(self.world, t_max, self.top_k, self.row_bytes)
        return Region(off, off + wb, off + ib, t_max)

    def _new_info(self, n: int, device: torch.device, zeroed: bool = True) -> torch.Tensor:
        """``[n, size]`` int32: per (source, local expert) counts, tokens and sends per rank, two
        error words, then the rows per local expert as int64 (``rows_layout``)."""
        size = totals_at(self.world, self.e_loc) + 2 * self.e_loc
        return (torch.zeros if zeroed else torch.empty)((n, size), dtype=torch.int32, device=device)

    def _post(self, g: Region, x: torch.Tensor, topk_idx: torch.Tensor, info: torch.Tensor | None = None) -> None:
        """This rank's tokens (X) and token count and ids (I) into its region ``g`` (``x``
        contiguous), and ``info`` zeroed: one kernel (``rows_post``)."""
        T, k = topk_idx.shape
        ids = topk_idx if topk_idx.dtype == torch.int64 else topk_idx.to(torch.int64)
        ids = ids.contiguous()
        nbytes = x.numel() * x.element_size()
        n_info = 0 if info is None else info.numel()
        blocks = max(1, min(2 * MAX_GRID, -(-nbytes // (16 * _THREADS))))  # a pack per thread
        self.pm.kernel("rows_post", None, False, 9, source=ROWS_SOURCE)(
            blocks, self.pm.stream(), g.x, g.ids, x.data_ptr(), nbytes, ids.data_ptr(), T * k, T,
            0 if info is None else info.data_ptr(), n_info)

    def _post_weights(self, g: Region, weights: torch.Tensor) -> None:
        """This rank's ``[tokens, k]`` weights, as fp32, into its region's W (where peers read them)."""
        if weights.numel():
            self.pm.slot_view(g.w, (weights.numel(),), torch.float32).copy_(weights.reshape(-1))

    def _layout(self, g: Region, info: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """After the barrier: every rank's ids, and the ranks of the tokens per local expert (``info``
        gets the counts; its last two words must be zero)."""
        W, e_loc, k = self.world, self.e_loc, self.top_k
        ids_all = torch.empty(W * g.t_max * k, dtype=torch.int32, device=info.device)
        ranks = torch.empty(W * g.t_max * e_loc, dtype=torch.int32, device=info.device)
        n_tiles = -(-g.t_max // LAYOUT_TILE)
        tiles = torch.empty(W * n_tiles * e_loc, dtype=torch.int32, device=info.device)  # each tile's pairs per expert
        stream = self.pm.stream()
        ke = self._geo()
        self.pm.kernel("rows_ids", None, False, 6, source=ROWS_SOURCE)(W * n_tiles, stream, g.ids, g.t_max, ke, info.data_ptr(),
                                                     ids_all.data_ptr(), tiles.data_ptr())
        self.pm.kernel("rows_layout", None, False, 6, source=ROWS_SOURCE)(W * e_loc * n_tiles, stream, g.t_max, ke, ranks.data_ptr(),
                                                        info.data_ptr(), ids_all.data_ptr(), tiles.data_ptr())
        return ids_all, ranks

    def _lay_out(self, x: torch.Tensor, topk_idx: torch.Tensor, packed: bool = False
                 ) -> tuple[Region, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A dispatch's first half: this rank's tokens (``packed``: as ``_check_rows``) and ids
        posted, the barrier, every rank's ids ranked per local expert. Returns the region,
        ``info`` and the two tables."""
        self._check_rows(x, packed)
        g = self._region(self._next_half(), self.max_tokens)
        info = self._new_info(1, x.device, zeroed=False)[0]
        self._post(g, x, topk_idx, info)
        self._fence()
        ids_all, ranks = self._layout(g, info)
        return g, info, ids_all, ranks

    def _refuse_bad(self, counts: np.ndarray, topk_idx: torch.Tensor) -> None:
        self.check()
        bad = counts[errors_at(self.world, self.e_loc):][:2]
        if bad.any():
            s = int(bad[BAD_RANGE] or bad[BAD_REPEAT]) - 1
            raise bad_routing("topk_idx" if s == self.rank else f"topk_idx of rank {s}", topk_idx,
                             self.world * self.e_loc, repeated=not bad[BAD_RANGE])

    def _geo(self, cap: int = 0, only: int | None = None, by_source: bool = False) -> int:
        """The kernels' layout word (rows.cu): k, the local experts, a source filter (``only``:
        source rank ``only``'s tokens alone, for the kernels that take one), the compact layout's
        order (``by_source``: each source's rows together, grouped by expert) and ``cap`` (0: compact)."""
        return (self.top_k | (self.e_loc << 8) | ((0 if only is None else only + 1) << 24) | (int(by_source) << 31)
                | (cap << 32))

    def _gather(self, g: Region, layout: DeviceLayout, x: torch.Tensor, bases: tuple[int, ...] | None = None
                ) -> torch.Tensor:
        """``recv_x``: compact (``layout.cap`` 0, its rows counted on the host) or padded; rank s's
        tokens read at ``g.x`` in its buffer (``bases``: in this one, see ``PeerMemory.kernel``)."""
        if layout.cap:
            total = self.e_loc * layout.cap
        else:
            assert layout.counts is not None  # the compact layout's counts are on the host
            total = int(layout.counts[:self.world * self.e_loc].sum())
        recv = x.new_empty((total, x.shape[1]))
        if total:
            vec = self._vec(recv.data_ptr(), row_bytes=x.shape[1] * x.element_size())
            kern = self.pm.kernel("rows_gather_dense", x.dtype, vec, 8, bases, source=ROWS_SOURCE)
            kern(self._grid(self.world * g.t_max * _ROW_SLICES), self.pm.stream(), g.x,
                 layout.ranks.data_ptr(), layout.info.data_ptr(), layout.ids_all.data_ptr(), recv.data_ptr(), g.t_max,
                 x.shape[1], self._geo(layout.cap))
        return recv

    def _combine(self, g: Region, layout: DeviceLayout, rows: torch.Tensor, weights: torch.Tensor,
                 out: torch.Tensor) -> None:
        """Weights into W, barrier, partial rows into P, barrier, each token's sum into ``out``."""
        self._post_weights(g, weights)
        self._fence()
        self._partial(g.x, g.w, g.t_max, layout, rows)
        self._fence()
        self._sum(g.x, g.t_max, layout, out)

    def _partial(self, p_off: int, w_off: int, t_max: int, layout: DeviceLayout, rows: torch.Tensor,
                 bases: tuple[int, ...] | None = None, only: int | None = None, by_source: bool = False,
                 first_row: int = 0) -> None:
        """P rows (this rank's buffer at ``p_off``) from the expert rows; the weights read at ``w_off``
        (``only``: source rank ``only``'s tokens alone; ``by_source``: the rows in that layout;
        ``first_row``: ``rows`` holds the layout's rows from that one on)."""
        if rows.shape[0]:
            ptr = rows.data_ptr() - first_row * rows.shape[1] * rows.element_size()
            kern = self.pm.kernel("rows_partial_dense", rows.dtype, self._vec(ptr), 9, bases, source=ROWS_SOURCE)
            kern(self._grid(self.world * t_max * _ROW_SLICES), self.pm.stream(), p_off, w_off,
                 layout.ranks.data_ptr(), layout.info.data_ptr(), layout.ids_all.data_ptr(), ptr, t_max,
                 rows.shape[1], self._geo(layout.cap, only, by_source))

    def _sum(self, p_off: int, t_max: int, layout: DeviceLayout, out: torch.Tensor,
             bases: tuple[int, ...] | None = None) -> None:
        """``out`` = each token's sum of the P rows (at ``p_off``) of the ranks it went to."""
        if layout.tokens:
            kern = self.pm.kernel("rows_sum_dense", out.dtype, self._vec(out.data_ptr()), 7, bases, source=ROWS_SOURCE)
            kern(self._grid(layout.tokens * _ROW_SLICES), self.pm.stream(), p_off,
                 layout.ids_all.data_ptr(), out.data_ptr(), t_max, out.shape[1], self._geo(layout.cap), layout.tokens)

    def check(self) -> None:
        """Raise ``CollectiveTimeout`` if a barrier of this transport gave up waiting for a peer."""
        self.pm.check()

    def close(self) -> None:
        """Release the peer buffer (collective)."""
        self.pm.close()
