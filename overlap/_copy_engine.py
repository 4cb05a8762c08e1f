"""The ``copy_engine`` strategy: GEMM chunks whose results (or operands) travel between the GPUs
of one node by copy engines, so the collective takes no SMs from the GEMMs.

Design note. This is the decomposition AsyncTP and Flux use, over the peer buffers of
``collectives.peer`` (a ``PeerMemory``'s ``CopyEngines``: pushes by ``cudaMemcpyAsync`` into a
peer's slot buffer, flags written by stream memory operations; the copy streams wait by stream
memory operations too, which take no SM from the GEMMs and are bounded by the section's watchdog
(``collectives/peer/_watchdog.py``), the compute stream by a bounded one-block kernel).

* ``all_gather_gemm``: every rank pushes its shard, chunk by chunk, into every peer's slots on a
  copy stream, while its compute stream multiplies its own shard; then each peer's chunk is
  multiplied straight out of the slot where it landed.
* ``gemm_reduce_scatter``: every rank first computes the rows that belong to its peers, chunk by
  chunk (chunk j for every peer, then chunk j + 1), and pushes each partial result into that
  peer's slots as soon as it is computed; then it computes its own rows with ``addmm``, the
  peers' partial sums entering as the GEMM's C operand (the reduction costs no pass of its own).
* ``gemm_all_reduce``: the reduce-scatter above over row blocks, then every reduced chunk is
  pushed to the peers, which copy it into place on a second copy stream while the compute stream
  goes on with the next chunk.

Why copies, not a GEMM whose epilogue stores into the peer's memory: on 2xH200 a copy engine
beside a GEMM hid 55-100% of the transfer, and cuBLAS writing its result over NVLink only 13-77%
(``launch/probe_peer_epilogue.py``, ``bench/results/gpu_2xh200_peer_epilogue.json``).

Ring slots are reused when the peer has consumed them (the ``CE_PULLED`` flag); a block too large
for two ring slots of the peer buffer (``COMMOPS_PEER_BYTES``) runs in more chunks.

Issue order. Every wait a rank queues must depend only on signals that its peers queue earlier
in the same program order. A host call can block until this GPU is idle (on 2×H200 a
``torch.addmm`` in the loop below did, 2026-11-30), and a GPU whose queued wait needs a signal
that the blocked peer host has not issued yet never goes idle: both hosts hang. So the push that
reuses a ring slot (chunk j + ring) is issued right after the consumption of chunk j is
signalled, not with the first pushes, and the all-reduce's pull of chunk j right after its own
push of chunk j, not after the whole loop. (Issued all up front, a call whose ring wrapped hung
on the GPUs until the peer-memory timeout; the CPU stand-in, whose hosts never blocked, passed.) The whole call
sits in a copy-engine section (its ``open`` and ``close`` barriers), so nothing else uses the slots meanwhile.
Everything is ordered on streams: nothing on the path waits on the host. Every rank splits every
block into the same number of chunks (some possibly empty), so that flags and slots line up
across ranks. ``tests/test_overlap_copy_engine_sim.py`` runs this bookkeeping on CPU threads.
"""

from __future__ import annotations

from typing import Any

import torch

from collectives.errors import UnsupportedError
from collectives.peer import (CE_PULLED, CE_PUSHED, CE_RING, DTYPES, PeerMemory, has_peer_memory, peer_memory,
                              peer_unavailable)

__all__ = ["all_gather_gemm", "gemm_reduce_scatter", "gemm_all_reduce", "unavailable"]

_ALIGN = 256  # bytes: every slot region starts on a 256-byte boundary (vector loads, GEMM operands)


def unavailable(comm: Any, device: torch.device, dtype: torch.dtype) -> str:
    """Why the copy-engine strategy cannot run here, or ``""``."""
    if device.type != "cuda":
        return f"it moves data between GPUs of one node; these tensors are on {device.type}"
    if dtype not in DTYPES:
        return f"peer memory carries {sorted(map(str, DTYPES))}, not {dtype}"
    return peer_unavailable(comm)


def prepare(comm: Any) -> None:
    """Build what a CUDA-graph capture of this strategy needs but cannot build itself: the
    communicator's peer buffers (collective), the kernels it launches and the tensor over its
    slots. Called eagerly, before a capture may choose the strategy."""
    pm = peer_memory(comm)
    pm.copy_engines.prepare()  # the sections' barriers and the compute stream's waits
    pm.slot_view(0, (1,), torch.uint8)


def ready(comm: Any) -> bool:
    """Whether ``prepare`` has run for this communicator (its peer buffers are open)."""
    return has_peer_memory(comm)


def _split(n: int, chunks: int) -> list[tuple[int, int]]:
    """Exactly ``chunks`` [lo, hi) ranges over ``n`` (some empty when n < chunks)."""
    return [(n * j // chunks, n * (j + 1) // chunks) for j in range(chunks)]


def _region(rows: int, cols: int, es: int) -> int:
    return -(-rows * cols * es // _ALIGN) * _ALIGN


def _enough(chunks: int, rows: int, cols: int, es: int, world: int, budget: int) -> int:
    """``chunks``, raised until two ring slots of chunks fit in ``budget`` bytes (a message larger
    than the peer buffer runs in more, smaller chunks)."""
    fit = budget // (2 * world) // _ALIGN * _ALIGN // max(1, cols * es)
    if fit < 1:
        raise UnsupportedError("b", cols, f"rows of {cols * es} B do not fit {world} x 2 slots of {budget} B of peer "
                               "memory", "raise COMMOPS_PEER_BYTES")
    return max(chunks, -(-rows // fit))


def _ring(pm: PeerMemory, region: int, budget: int, most: int) -> int:
    ring = min(most, budget // (pm.world * region)) if region else most
    if ring < 1:
        raise UnsupportedError("chunks", region, f"needs {pm.world * region} B of peer slots per chunk, more than the "
                               f"{budget} B available", "use more chunks, or raise COMMOPS_PEER_BYTES")
    return ring


class _Streams:
    """The compute stream and the copy streams of one call, and the events between them."""

    def __init__(self, pm: PeerMemory) -> None:
        self.main = torch.cuda.current_stream(pm.device)
        self.push, self.pull = pm.copy_engines.streams
        self.ms, self.ps, self.ls = self.main.cuda_stream, self.push.cuda_stream, self.pull.cuda_stream
        # One event for every "after the compute stream's work so far": a wait takes the record
        # that is current when it is issued, so recording again later leaves earlier waits alone.
        self._mark = torch.cuda.Event()

    def after_main(self, side: torch.cuda.Stream) -> None:
        self._mark.record(self.main)
        side.wait_event(self._mark)

    def join(self, *sides: torch.cuda.Stream) -> None:
        for side in sides:
            ev = torch.cuda.Event()
            ev.record(side)
            self.main.wait_event(ev)


def all_gather_gemm(pm: PeerMemory, rows: torch.Tensor, b: torch.Tensor, chunks: int,
                    keep_gathered: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[w * m, N]`` = every rank's ``rows`` ``[m, K]`` in rank order, times ``b``; with
    ``keep_gathered`` also the gathered rows ``[w, m, K]``."""
    w, r, es = pm.world, pm.rank, rows.element_size()
    m, k = rows.shape
    n = b.shape[1]
    out = rows.new_empty((w, m, n))
    full = rows.new_empty((w, m, k)) if keep_gathered else None
    bounds = _split(m, _enough(chunks, m, k, es, w, pm.slot_bytes))
    region = _region(max(hi - lo for lo, hi in bounds), k, es)
    ring = _ring(pm, region, pm.slot_bytes, CE_RING)
    peers = [(r + d) % w for d in range(1, w)]
    ce = pm.copy_engines
    st = _Streams(pm)
    ce.open()
    st.after_main(st.push)
    base = rows.data_ptr()

    def push(j: int) -> None:
        lo, hi = bounds[j]
        s, u = j % ring, j // ring
        if u:
            ce.wait(st.ps, s, CE_PULLED, u)  # every peer has multiplied what it got in this slot last time
        for q in peers:
            if hi > lo:
                ce.push(st.ps, q, (s * w + r) * region, base + lo * k * es, (hi - lo) * k * es)
            ce.signal(st.ps, q, s, CE_PUSHED, u + 1)

    for j in range(min(ring, len(bounds))):
        push(j)
    torch.matmul(rows, b, out=out[r])
    if full is not None:
        full[r].copy_(rows)
    for j, (lo, hi) in enumerate(bounds):
        s, u = j % ring, j // ring
        ce.wait(st.ms, s, CE_PUSHED, u + 1, kernel=True)
        for q in peers:
            if hi > lo:
                got = pm.slot_view((s * w + q) * region, (hi - lo, k), rows.dtype)
                torch.matmul(got, b, out=out[q, lo:hi])
                if full is not None:
                    full[q, lo:hi].copy_(got)
            ce.signal(st.ms, q, s, CE_PULLED, u + 1)
        if j + ring < len(bounds):
            push(j + ring)  # issued only now: see "Issue order" in the module's note
    st.join(st.push)  # `rows` is read by the push stream: the caller may free it after this call
    ce.close()
    return out.view(w * m, n), full


def _reduce_scatter_phase(pm: PeerMemory, st: _Streams, rows: torch.Tensor, b: torch.Tensor, blocks: list[tuple[int, int]],
                          chunks: int, ring: int, slot0: int, region: int, out: torch.Tensor,
                          after_chunk: Any = None) -> list[torch.Tensor]:
    """Peers' blocks first (the first ``ring`` chunks; chunk j + ring after this rank's chunk j, see
    "Issue order"), each chunk pushed as soon as it is computed; then this rank's block with the
    peers' partial sums as addmm's C operand, into ``out`` (this block's rows).
    ``after_chunk(j, lo, hi)`` runs after chunk j of this rank's block is in ``out``. Returns the
    staging tensors, which must live until the push stream is joined."""
    w, r, es = pm.world, pm.rank, rows.element_size()
    n = b.shape[1]
    peers = [(r + d) % w for d in range(1, w)]
    ce = pm.copy_engines
    staging = []
    splits = {q: _split(blocks[q][1] - blocks[q][0], chunks) for q in peers}

    def send(j: int) -> None:
        # chunk j of every peer's block: a peer consumes a ring slot once every rank has filled
        # it, so filling it for one peer at a time would deadlock 3 ranks or more
        s, u = slot0 + j % ring, j // ring
        for q in peers:
            lo, hi = splits[q][j]
            part = torch.matmul(rows[blocks[q][0] + lo:blocks[q][0] + hi], b) if hi > lo else None
            st.after_main(st.push)
            if u and q == peers[0]:
                ce.wait(st.ps, s, CE_PULLED, u)  # every peer has consumed this slot's last use
            if part is not None:
                ce.push(st.ps, q, (s * w + r) * region, part.data_ptr(), (hi - lo) * n * es)
                staging.append(part)
            ce.signal(st.ps, q, s, CE_PUSHED, u + 1)

    for j in range(min(ring, chunks)):
        send(j)
    r_lo, r_hi = blocks[r]
    for j, (lo, hi) in enumerate(_split(r_hi - r_lo, chunks)):
        s, u = slot0 + j % ring, j // ring
        ce.wait(st.ms, s, CE_PUSHED, u + 1, kernel=True)
        if hi > lo:
            got = [pm.slot_view((s * w + q) * region, (hi - lo, n), rows.dtype) for q in peers]
            acc = got[0] if len(got) == 1 else torch.stack(got).sum(0)
            torch.addmm(acc, rows[r_lo + lo:r_lo + hi], b, out=out[lo:hi])
        for q in peers:
            ce.signal(st.ms, q, s, CE_PULLED, u + 1)
        if after_chunk is not None:
            after_chunk(j, lo, hi)
        if j + ring < chunks:
            send(j + ring)  # issued only now: see "Issue order" in the module's note
    return staging


def gemm_reduce_scatter(pm: PeerMemory, rows: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
    """This rank's ``[M / w, N]`` block of the sum over ranks of ``rows @ b`` (``rows`` ``[M, K]``)."""
    w, es = pm.world, rows.element_size()
    m = rows.shape[0] // w
    blocks = [(q * m, (q + 1) * m) for q in range(w)]
    out = rows.new_empty((m, b.shape[1]))
    chunks = _enough(chunks, m, b.shape[1], es, w, pm.slot_bytes)
    region = _region(max(hi - lo for lo, hi in _split(m, chunks)), b.shape[1], es)
    ring = _ring(pm, region, pm.slot_bytes, CE_RING)
    st = _Streams(pm)
    pm.copy_engines.open()
    staging = _reduce_scatter_phase(pm, st, rows, b, blocks, chunks, ring, 0, region, out)
    st.join(st.push)
    del staging
    pm.copy_engines.close()
    return out


def gemm_all_reduce(pm: PeerMemory, rows: torch.Tensor, b: torch.Tensor, chunks: int) -> torch.Tensor:
    """The sum over ranks of ``rows @ b`` (``rows`` ``[M, K]``), on every rank: reduce-scatter over
    row blocks as above, each reduced chunk pushed to the peers and copied into place there."""
    # (Chunks whose sizes fall linearly, so that the last chunk's all-gather, which nothing
    # hides, is the smallest, were tried on 2xH200 on 2026-11-30: under graphs, timed beside
    # equal chunks in one run, 1-8% slower at 2048x2048x8192, 4096x4096x8192 and
    # 8192x14336x8192, and no better at 16384x4096x8192 once both took their best chunk count.)
    w, r, es = pm.world, pm.rank, rows.element_size()
    total, n = rows.shape[0], b.shape[1]
    step = -(-total // w)
    blocks = [(min(total, q * step), min(total, (q + 1) * step)) for q in range(w)]
    out = rows.new_empty((total, n))
    half = pm.slot_bytes // 2 // _ALIGN * _ALIGN
    chunks = _enough(chunks, step, n, es, w, half)
    region = _region(max(hi - lo for lo, hi in _split(step, chunks)), n, es)
    ring = _ring(pm, region, half, CE_RING // 2)
    ag0 = CE_RING // 2  # ring slots of the all-gather phase, in the second half of the buffer
    peers = [(r + d) % w for d in range(1, w)]
    ce = pm.copy_engines
    st = _Streams(pm)
    r_lo = blocks[r][0]
    splits = {q: _split(blocks[q][1] - blocks[q][0], chunks) for q in peers}

    def share(j: int, lo: int, hi: int) -> None:
        # this reduced chunk to every peer (push stream), after the addmm that made it
        s, u = ag0 + j % ring, j // ring
        st.after_main(st.push)
        if u:
            ce.wait(st.ps, s, CE_PULLED, u)
        for q in peers:
            if hi > lo:
                ce.push(st.ps, q, half + ((s - ag0) * w + r) * region, out[r_lo + lo].data_ptr(), (hi - lo) * n * es)
            ce.signal(st.ps, q, s, CE_PUSHED, u + 1)
        # the peers' reduced chunk j, copied into place by the pull stream when it arrives
        ce.wait(st.ls, s, CE_PUSHED, u + 1)
        for q in peers:
            p_lo, p_hi = splits[q][j]
            if p_hi > p_lo:
                ce.take(st.ls, half + ((s - ag0) * w + q) * region, out[blocks[q][0] + p_lo].data_ptr(),
                        (p_hi - p_lo) * n * es)
            ce.signal(st.ls, q, s, CE_PULLED, u + 1)

    ce.open()
    st.after_main(st.pull)
    staging = _reduce_scatter_phase(pm, st, rows, b, blocks, chunks, ring, 0, region, out[r_lo:blocks[r][1]], share)
    st.join(st.push, st.pull)
    del staging
    ce.close()
    return out
