"""Copy engine over peer memory: the bytes cross NVLink by cudaMemcpyAsync, SMs only reduce.

A reduce-scatter by copy-engine pushes into the peers' slots, a reduction on SMs, then an
all-gather by copy-engine pulls of the peers' reduced shards, pipelined in chunks through a ring
of slots on a second stream (``collectives/peer/kernels.cu``, "copy-engine path"). Each rank
moves the least bytes an all-reduce can, without taking SMs from concurrent kernels: the choice
for large messages, where SM-driven stores peak below the copy engines (``launch/tune_peer.py``
measures both). Reduce-scatter and all-gather are the two halves: copy-engine pushes into the
peers' slots, then an SM reduction into the output (reduce-scatter) or copy-engine copies out of
the slots (all-gather, no SMs at all; ``by_shard``). At two ranks the all-reduce is one shot on
the copy engines instead (``by_shard`` too). Every copy and flag goes through the memory's
``CopyEngines`` (``collectives/peer/copy_engines.py``), and each call is one of its sections.
Runs on the GPUs of one node (``collectives/peer``).
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..peer.copy_engines import CE_PULLED, CE_PUSHED, CE_REDUCED, CE_RING
from ..peer.memory import PACK_BYTES, PeerMemory
from ._peer import PER_CALL, PeerAlgorithm, Unplanned

__all__ = ["CopyEngine", "all_reduce", "by_shard", "ce_pieces", "RAMP_HEAD", "RAMP_TAIL"]


# The ramped pieces' sizes, as divisors of a chunk (ce_pieces). Only the last piece's sum follows
# the link's last byte, so the tail shrinks; every piece boundary costs the copy engines a few
# microseconds, so the head has one half chunk. Measured on 2xH200 (2026-12-01), 1 GiB / 512 MiB
# all-reduce, busbw over NCCL's in the same rounds (11 rounds, graph / eager): head 1/8, 1/4, 1/2
# and the mirrored tail 1.0975 / 1.0985 at 1 GiB, 1.107 / 1.104 at 512 MiB; head 1/2, tail 1/2,
# 1/4, 1/8 1.1076 / 1.1047 and 1.123 / 1.115; no head 1.105 / 1.103 and 1.118 / 1.107; 256 MiB
# chunks (two ring slots) 1.02-1.03 and 0.95-0.96.
RAMP_HEAD = (2,)
RAMP_TAIL = (2, 4, 8)


def ce_pieces(m: int, chunk: int, pack: int, ramp: bool = False) -> list[tuple[int, int]]:
    """(first element, elements) of each copy-engine chunk of ``m`` elements, at most ``chunk``
    (a multiple of ``pack``) each. With ``ramp``, where at least one full chunk lies between,
    the first pieces are ``chunk / RAMP_HEAD`` and the last shrink to ``chunk / RAMP_TAIL[-1]``:
    the last sum then waits only for a small last copy."""
    def sizes(divisors: tuple[int, ...]) -> list[int]:
        return [max(pack, chunk // d // pack * pack) for d in divisors]

    head, tail = sizes(RAMP_HEAD), sizes(RAMP_TAIL)
    if not ramp or m < sum(head) + sum(tail) + chunk:
        head = tail = []
    out, lo, end = [], 0, m - sum(tail)
    for n in head:
        out.append((lo, n))
        lo += n
    while lo < end:
        n = min(chunk, end - lo)
        out.append((lo, n))
        lo += n
    for n in tail:
        out.append((lo, n))
        lo += n
    return out


class CopyEngine(PeerAlgorithm):
    name = "copy_engine"
    ops = frozenset({"all_reduce", "reduce_scatter", "all_gather"})
    summary = "peer memory, copy-engine pushes and pulls with an SM reduction, pipelined (GPUs of one node)"
    prepares = False  # every call is many copies and flags: nothing to keep as one launch

    def plan(self, pm: PeerMemory, tensor: torch.Tensor) -> Unplanned:
        return PER_CALL  # the chunks follow the settings on the memory, read on every call

    def all_reduce_per_call(self, pm: PeerMemory, tensor: torch.Tensor, vec: bool) -> None:
        all_reduce(pm, tensor, vec)

    def reduce_scatter(self, pm: PeerMemory, output: torch.Tensor, input: torch.Tensor, average: bool = False) -> None:
        """``output`` ([m]) = this rank's shard of the sum of every rank's ``input`` ([world * m]),
        pushed by copy engines and summed on SMs."""
        by_shard(pm, "reduce_scatter", output, input, output.numel())
        if average:
            output.detach().div_(pm.world)

    def all_gather(self, pm: PeerMemory, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` ([world * m]) = every rank's ``input`` ([m]) in rank order, by copy engines alone."""
        by_shard(pm, "all_gather", output, input, input.numel())


def all_reduce(pm: PeerMemory, t: torch.Tensor, vec: bool) -> None:
    """In-place sum of ``t`` over the group: copy engines move the shards, SMs only reduce;
    chunks cycle through a ring of slots.

    See kernels.cu ("copy-engine path") for the protocol. ``vec`` also needs whole packs per
    chunk and shard, which the chunk size below keeps.

    With two ranks, one shot instead (``by_shard``): each rank's whole tensor crosses the link
    once, as in the two-shot schedule, but nothing waits for the peer's reduction, so the only
    fill and drain is one chunk's copy and one chunk's sum.
    """
    if pm.world == 2:
        by_shard(pm, "all_reduce", t, t, t.numel())
        return
    w, r, es = pm.world, pm.rank, t.element_size()
    pack = PACK_BYTES // es
    n = t.numel()
    want = max(pm.ce_chunk_bytes, -(-n * es // pm.ce_max_chunks))
    fits = pm.slot_bytes * w // (2 * (w + 1))  # the largest chunk with two ring slots
    chunk_bytes = max(pm.ce_chunk_bytes, min(want, fits))
    chunk = max(w * pack, chunk_bytes // es // (w * pack) * (w * pack))
    s_max = chunk // w
    ring = min(CE_RING, pm.slot_bytes // es // ((w + 1) * s_max))
    if ring < 2:
        raise UnsupportedError("ce_chunk_bytes", pm.ce_chunk_bytes,
                               f"leaves fewer than 2 ring slots in {pm.slot_bytes} B of slots",
                               "use a smaller chunk or a larger COMMOPS_PEER_BYTES")
    ce = pm.copy_engines
    main = pm.stream()
    push_s, pull_s = ce.streams
    ps, ls = push_s.cuda_stream, pull_s.cuda_stream
    base = t.data_ptr()
    reduce = pm.kernel("ce_reduce", t.dtype, vec, 8)
    peers = [(r + d) % w for d in range(1, w)]
    k = -(-n // chunk)

    def geometry(j: int) -> tuple[int, int, int]:
        nj = min(chunk, n - j * chunk)
        shard = -(-(-(-nj // w)) // pack) * pack
        return nj, shard, (j % ring) * (w + 1) * s_max

    def length(nj: int, shard: int, q: int) -> int:
        return max(0, min(shard, nj - q * shard))

    # Pull stream: wait until the peers reduced chunk i, pull their shards, tell them. Push
    # stream: push chunk j once the peers reduced chunk j - ring (their slot is free again),
    # which the pull stream's wait for chunk j - ring has established (an event, no kernel).
    # The copy streams' waits are stream memory waits (inside the section: CopyEngines.wait).
    reduced = [torch.cuda.Event() for _ in range(ring)]
    blocks = pm.blocks(s_max * es)
    with ce.section():
        for j in range(k):
            nj, shard, off = geometry(j)
            if j >= ring:
                push_s.wait_event(reduced[j % ring])
            for q in peers:
                m = length(nj, shard, q)
                if m:
                    ce.push(ps, q, (off + r * s_max) * es, base + (j * chunk + q * shard) * es, m * es)
            for q in peers:
                ce.signal(ps, q, j % ring, CE_PUSHED, j // ring + 1)
            reduce(blocks, main, base + j * chunk * es, base + j * chunk * es, off, shard, nj, j, ring, s_max)
            u = j // ring
            ce.wait(ls, j % ring, CE_REDUCED, u + 1)
            reduced[j % ring].record(pull_s)
            for q in peers:
                m = length(nj, shard, q)
                if m:
                    ce.pull(ls, q, (off + w * s_max) * es, base + (j * chunk + q * shard) * es, m * es)
            for q in peers:
                ce.signal(ls, q, j % ring, CE_PULLED, u + 1)


def by_shard(pm: PeerMemory, kind: str, output: torch.Tensor, input: torch.Tensor, m: int) -> None:
    """Reduce-scatter, all-gather or one-shot all-reduce (``input`` is ``output``, ``m`` all of
    it: every peer is sent all of it and sums what it gets) with every byte between GPUs moved
    by the copy engines.

    Shards of ``m`` elements are cut into chunks that cycle through a ring of slots; each
    slot holds one chunk per source rank. Push stream: chunk j's part for each peer into that
    peer's slot j % R (once the peers are done with that slot's previous use), then flag
    PUSHED. Reduce-scatter: a kernel on the caller's stream waits for PUSHED, sums my part of
    chunk j from ``input`` and the slot into ``output`` and flags REDUCED (the slot is free).
    All-gather: the pull stream waits for PUSHED, copies the peers' parts of chunk j out of
    my slot into ``output`` and flags PULLED. Flags hold the slot's use count within the
    call (see kernels.cu, "copy-engine path"); the call is bracketed by two barriers.
    """
    pm.validate(output)
    pm.validate(input)
    w, r, es = pm.world, pm.rank, output.element_size()
    pack = PACK_BYTES // es
    fits = pm.slot_bytes // es // (2 * w)  # a chunk per source in each of two ring slots
    in_place = kind == "all_reduce"
    least = pm.ce_all_reduce_chunk_bytes if in_place else pm.ce_chunk_bytes
    want = max(least // es, -(-m // pm.ce_max_chunks))
    chunk = max(pack, min(want, fits) // pack * pack)
    ring = min(CE_RING, pm.slot_bytes // es // (w * chunk))
    if ring < 2:
        raise UnsupportedError("COMMOPS_PEER_BYTES", pm.slot_bytes, "leaves fewer than 2 ring slots for "
                               "the copy-engine path", "use a larger COMMOPS_PEER_BYTES")
    ce = pm.copy_engines
    main = pm.stream()
    ps, ls = (side.cuda_stream for side in ce.streams)
    src, dst = input.data_ptr(), output.data_ptr()
    vec = src % PACK_BYTES == 0 and dst % PACK_BYTES == 0 and m % pack == 0
    summed = kind != "all_gather"
    reduce = pm.kernel("ce_reduce_rs", output.dtype, vec, 7) if summed else None
    blocks = pm.blocks(chunk * es)
    peers = [(r + d) % w for d in range(1, w)]
    free = CE_REDUCED if summed else CE_PULLED
    caller, push_stream = torch.cuda.current_stream(pm.device), ce.streams[0]
    # (Pushes taking turns on both copy streams, so that a chunk's wait for its slot cannot
    # hold the next chunk's copy back, were tried on 2xH200 on 2026-11-30 and measured 1-2%
    # slower at 256 MB - 1 GB, in all-reduce and reduce-scatter alike.)
    with ce.section():  # the copy streams' waits: stream memory waits (CopyEngines.wait)
        if kind == "all_gather" and m:
            ce.copy(ls, dst + r * m * es, src, m * es)  # my own shard, beside the pushes
        for j, (lo, nj) in enumerate(ce_pieces(m, chunk, pack, ramp=in_place)):
            s, u = j % ring, j // ring
            off = s * w * chunk  # elements into the slot buffer: source q's part at off + q * chunk
            if u:
                ce.wait(ps, s, free, u)  # every peer is done with this slot's previous use
            for q in peers:
                at = q * m + lo if kind == "reduce_scatter" else lo
                ce.push(ps, q, (off + r * chunk) * es, src + at * es, nj * es)
            for q in peers:
                ce.signal(ps, q, s, CE_PUSHED, u + 1)
            if reduce is not None:
                if in_place:  # the sum overwrites what the copies read: after them
                    sent = torch.cuda.Event()
                    sent.record(push_stream)
                    caller.wait_event(sent)
                at = r * m + lo if kind == "reduce_scatter" else lo
                reduce(blocks, main, src + at * es, dst + lo * es, off, chunk, nj, j, ring)
            else:
                ce.wait(ls, s, CE_PUSHED, u + 1)
                for q in peers:
                    ce.take(ls, (off + q * chunk) * es, dst + (q * m + lo) * es, nj * es)
                for q in peers:
                    ce.signal(ls, q, s, CE_PULLED, u + 1)
