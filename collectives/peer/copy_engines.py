"""``CopyEngines``: the copy engines of one ``PeerMemory``, for code that moves bytes between the
GPUs of one node without SMs, and the flags that order those copies.

Design note. A copy engine moves bytes by ``cudaMemcpyAsync`` into a peer's slot buffer (or out
of one) on a side stream; flags written and waited on by stream memory operations
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32``) order the copies with the peers' work.
Neither takes an SM, which is why the copy-engine collectives (``collectives/algos/copy_engine.py``)
and the overlapped GEMMs (``overlap/_copy_engine.py``) use them. They share these primitives:

* A **section** brackets a use on the current stream: ``open()`` and ``close()`` are barriers of
  every rank (every rank is inside; every rank has issued every signal to its peers), and
  ``close()`` zeroes this rank's copy-engine flags for the next user. ``section()`` is the same
  as a context manager that also orders the copy streams after the current stream's work and
  the current stream after theirs.
* **Copies**: ``push()`` into a peer's slot buffer, ``pull()`` out of a peer's, ``take()`` out of
  this rank's own, ``copy()`` between two device addresses; this rank's own slots are also read
  through ``PeerMemory.slot_view``.
* **Flags**: ring slots ``0 .. CE_RING - 1``, stages ``CE_PUSHED``, ``CE_REDUCED``, ``CE_PULLED``,
  one flag per (slot, stage, source rank). Values are use counts the host knows (``peer.cuh``
  and ``kernels.cu``, "copy-engine path"), so CUDA graphs replay the same values. ``signal()``
  sets one at a peer; ``wait()`` waits for this rank's.
* **The bound on stream waits.** A stream memory wait has no timeout of its own. The section
  watchdog (``_watchdog.py``) counts ``open()`` and ``close()`` and, when a section makes no
  progress for the peer-memory timeout, releases every wait of this rank and records the peer
  whose signals were the furthest behind (``PeerMemory.check()`` then raises). So ``wait()``
  waits by stream operations only inside a section; outside one (and on request) a bounded
  one-block kernel waits instead. A caller whose waits are all kernels synchronises with
  ``PeerMemory.barrier()``, which opens no section.

One ``CopyEngines`` per ``PeerMemory`` (``pm.copy_engines``): the count of open sections, which
picks how ``wait()`` waits, and the watchdog are per memory. Like the memory's other calls, it
is for one thread at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import UnsupportedError
from . import _launch
from ._layout import (CE_PULLED, CE_PUSHED, CE_REDUCED, CE_RING, CE_STAGES, FENCE_CLEAR, FENCE_CLOSE, FENCE_OPEN,
                      MAX_RANKS, STREAM_WAIT, ce_flag_offset)
from ._watchdog import SectionWatchdog

if TYPE_CHECKING:
    from .memory import PeerMemory

__all__ = ["CopyEngines", "CE_RING", "CE_STAGES", "CE_PUSHED", "CE_REDUCED", "CE_PULLED"]


class CopyEngines:
    """Copy-engine copies and flags over one ``PeerMemory``'s buffers (see the module's note).

    Streams are raw ``cudaStream_t`` handles (``torch.cuda.Stream.cuda_stream``, or
    ``PeerMemory.stream()`` for the current one); offsets are bytes into a slot buffer; addresses
    are device addresses. Every call only enqueues work on its stream.

    Args:
        pm: the memory whose slot buffers and flags these engines use.
        streams: the (push, pull) side streams (default: two new streams of ``pm``'s device).
        watchdog: start the section watchdog with the first section (default). Without it nothing
            bounds a section's stream waits: only for stand-ins whose waits cannot hang (tests).
    """

    def __init__(self, pm: PeerMemory, streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None, *,
                 watchdog: bool = True) -> None:
        self.pm = pm
        self._streams = streams if streams is not None else (torch.cuda.Stream(pm.device), torch.cuda.Stream(pm.device))
        self._watched = watchdog
        self._watchdog: SectionWatchdog | None = None  # started by the first open()
        self._sections = 0  # sections this host has opened and not closed

    @property
    def streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """Two side streams of this rank's device for copy-engine work (push, pull)."""
        return self._streams

    @property
    def sections(self) -> int:
        """Sections this host has opened and not closed (``wait()``'s default depends on it)."""
        return self._sections

    def prepare(self) -> None:
        """Build the kernels that ``open``, ``close`` and ``wait(kernel=True)`` launch (a CUDA-graph
        capture cannot build them)."""
        self.pm.kernel("ce_fence", None, False, 1)
        self.pm.kernel("ce_wait", None, False, 3)

    # -- sections --------------------------------------------------------------------------------
    def open(self) -> None:
        """Open a copy-engine section on the current stream (a barrier of every rank; collective)."""
        pm = self.pm
        pm.kernel("ce_fence", None, False, 1)(1, pm.stream(), FENCE_OPEN)
        self._sections += 1
        self._watch()

    def close(self) -> None:
        """Close it (a barrier; then this rank's copy-engine flags are zeroed; collective)."""
        pm = self.pm
        pm.kernel("ce_fence", None, False, 1)(1, pm.stream(), FENCE_CLEAR | FENCE_CLOSE)
        self._sections = max(0, self._sections - 1)

    @contextmanager
    def section(self) -> Iterator[None]:
        """A section on the current stream: ``open()``, the copy streams ordered after the work
        queued so far; on exit the current stream waits for both copy streams, then ``close()``.
        An exception inside leaves the section abandoned: no closing barrier, nothing counted open."""
        self.open()
        current = torch.cuda.current_stream(self.pm.device)
        start = torch.cuda.Event()
        start.record(current)
        for side in self._streams:
            side.wait_event(start)
        try:
            yield
            for side in self._streams:
                done = torch.cuda.Event()
                done.record(side)
                current.wait_event(done)
        except BaseException:
            self._sections = max(0, self._sections - 1)  # abandoned: no closing barrier, nothing open here
            raise
        self.close()

    # -- flags -----------------------------------------------------------------------------------
    def flag(self, peer: int, slot: int, stage: int) -> int:
        """Address of ``peer``'s copy-engine flag (slot, stage) for signals from this rank."""
        return self.pm.flag_pointers[peer] + ce_flag_offset(slot, stage, self.pm.rank)

    def signal(self, stream: int, peer: int, slot: int, stage: int, value: int) -> None:
        """On ``stream``, after its earlier work: set this rank's flag (slot, stage) at ``peer`` to ``value``."""
        _launch.write_value(stream, self.flag(peer, slot, stage), value)

    def wait(self, stream: int, slot: int, stage: int, value: int, *, kernel: bool | None = None,
             source: int | None = None) -> None:
        """On ``stream``: wait until every peer's flag (slot, stage) to this rank is >= value
        (``source``: peer ``source``'s alone).

        Inside ``open`` ... ``close`` the default is stream memory waits: no kernel, bounded by the
        section's watchdog. A copy stream waits this way, because a spinning block slows a GEMM
        running beside it (``_watchdog``'s note). With ``kernel=True``, and by default outside a
        section, a one-block kernel waits instead, bounded by itself. It sees the flag sooner,
        which suits the stream that runs the GEMMs, as nothing runs beside it there. On 2xH200,
        stream waits there made the copy-engine overlap 2-6% slower at 2048 and 4096 rows under
        graphs (2026-11-30). ``kernel=False`` outside a section is refused: nothing would bound it.
        """
        pm = self.pm
        if kernel is None:
            kernel = self._sections == 0
        elif not kernel and self._sections == 0:
            raise UnsupportedError("kernel", kernel, "asks for a stream wait outside a copy-engine section, where "
                                   "no watchdog bounds it", "open a section with open() first, or pass kernel=True")
        if source is not None and not (0 <= source < pm.world and source != pm.rank):
            raise UnsupportedError("source", source, f"is not a peer of rank {pm.rank} of {pm.world}",
                                   "pass another rank of the group, or None for every peer")
        if kernel:
            if source is None:
                pm.kernel("ce_wait", None, False, 3)(1, stream, slot, stage, value)
            else:
                pm.kernel("ce_wait_from", None, False, 4)(1, stream, slot, stage, value, source)
            return
        base = pm.flag_pointers[pm.rank] + ce_flag_offset(slot, stage, 0)
        for q in range(pm.world):
            if q != pm.rank and source in (None, q):
                _launch.wait_value(stream, base + 4 * q, value)

    # -- copies ----------------------------------------------------------------------------------
    def push(self, stream: int, peer: int, offset: int, src: int, nbytes: int) -> None:
        """On ``stream``: copy ``nbytes`` from the device address ``src`` to ``offset`` bytes into
        ``peer``'s slot buffer."""
        self._inside(offset, nbytes)
        _launch.copy_async(self.pm.slot_pointers[peer] + offset, src, nbytes, stream)

    def pull(self, stream: int, peer: int, offset: int, dst: int, nbytes: int) -> None:
        """On ``stream``: copy ``nbytes`` from ``offset`` bytes into ``peer``'s slot buffer to the
        device address ``dst``."""
        self._inside(offset, nbytes)
        _launch.copy_async(dst, self.pm.slot_pointers[peer] + offset, nbytes, stream)

    def take(self, stream: int, offset: int, dst: int, nbytes: int) -> None:
        """On ``stream``: copy ``nbytes`` from ``offset`` bytes into this rank's own slot buffer to
        the device address ``dst``."""
        self.pull(stream, self.pm.rank, offset, dst, nbytes)

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        """On ``stream``: copy ``nbytes`` from the device address ``src`` to ``dst``."""
        _launch.copy_async(dst, src, nbytes, stream)

    def _inside(self, offset: int, nbytes: int) -> None:
        if offset < 0 or offset + nbytes > self.pm.slot_bytes:
            raise UnsupportedError("offset", offset, f"with {nbytes} B runs outside the {self.pm.slot_bytes} B slot "
                                   "buffer", "plan pieces that fit COMMOPS_PEER_BYTES")

    # -- the section watchdog --------------------------------------------------------------------
    def stop(self) -> None:
        """Stop the section watchdog (``PeerMemory.close`` does, before the flags it may write are freed)."""
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def _watch(self) -> None:
        """Start the section watchdog (once): it bounds the stream waits of ``wait``."""
        if self._watchdog is None and self._watched:
            self._watchdog = SectionWatchdog(self.pm.error_record, self.pm.timeout_s, self._release_waits)
            self._watchdog.start()

    def _release_waits(self, stuck: bool) -> None:
        """The watchdog's release (on its thread): record which peers' copy-engine signals are
        behind (when a section was ``stuck``), then set every copy-engine flag of this rank far
        ahead and the device error word, on a stream of its own."""
        import cupy  # deferred: CuPy loads with the first kernel, never at import

        pm = self.pm
        rt = cupy.cuda.runtime
        record = pm.error_record
        words = CE_RING * CE_STAGES * MAX_RANKS
        flags = pm.flag_pointers[pm.rank] + ce_flag_offset(0, 0, 0)
        seen = np.zeros((CE_RING * CE_STAGES, MAX_RANKS), dtype=np.uint32)
        with cupy.cuda.Device(pm.device_index):
            stream = rt.streamCreateWithFlags(1)  # non-blocking: the stuck streams do not hold it
            try:
                rt.memcpyAsync(seen.ctypes.data, flags, words * 4, rt.memcpyDeviceToHost, stream)
                rt.streamSynchronize(stream)
                if stuck and not record[0]:
                    sums = {q: int(seen[:, q].astype(np.int64).sum()) for q in range(pm.world) if q != pm.rank}
                    behind = min(sums, key=lambda q: (sums[q], q)) if sums else -1
                    record[1], record[2], record[3] = STREAM_WAIT, -1, behind
                    record[0] = 1
                rt.memsetAsync(flags, 0x40, words * 4, stream)  # 0x40404040: ahead of every use count
                rt.memsetAsync(pm.device_error_address, 0x01, 4, stream)
                rt.streamSynchronize(stream)
            finally:
                rt.streamDestroy(stream)
