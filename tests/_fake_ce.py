"""A stand-in for the GPUs under the copy-engine collectives, on CPU.

Every rank's host code runs for real (``collectives/algos/copy_engine.py``'s ``by_shard`` and
``all_reduce``, on a ``FakeRank`` in place of the ``PeerMemory``, with a real ``CopyEngines``
over it) and, as on a GPU, only enqueues work: copies, flag writes, kernels, event records and
waits, each on its stream. ``Machine.run`` then executes the queues of every rank's streams in
a random order, taking at each step the head of any queue whose condition holds (a kernel's
bounded wait on peer flags, a barrier, an event), until all are empty; if no head can run, the
protocol is deadlocked. Memory is host memory: the slot buffers, the flag
areas and the tensors are CPU tensors addressed by their ``data_ptr()``, and each kernel of
``collectives/peer/kernels.cu`` that these paths launch is done here in plain torch, as its
comment there specifies. What this checks is the protocol (ring slots, flag values, stream
order, barriers) and the offsets, at world sizes the GPU machines do not have; the kernels
themselves are checked on GPUs (``tests/gpu_peer_check.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import random
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from collectives.algos import copy_engine as algo
from collectives.peer import _launch, _layout as L
from collectives.peer.copy_engines import CopyEngines

_Op = tuple[Callable[[], bool], Callable[[], None]]  # (ready, run)


def _at(ptr: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """``n`` elements of ``dtype`` at host address ``ptr`` (shared, writable)."""
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if nbytes <= 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype=dtype)


class Stream:
    def __init__(self, machine: Machine, ident: int) -> None:
        self.machine, self.cuda_stream = machine, ident
        self.ops: deque[_Op] = deque()

    def wait_event(self, event: Event) -> None:
        marker = event.last
        self.ops.append(((lambda: marker is None or marker[0]), lambda: None))


class Event:
    def __init__(self) -> None:
        self.last: list[bool] | None = None

    def record(self, stream: Stream) -> None:
        done = [False]
        self.last = done
        stream.ops.append(((lambda: True), lambda: done.__setitem__(0, True)))


class FakeRank:
    """What the copy-engine collectives use of a ``PeerMemory`` (its public names), for one rank
    of a ``Machine``; its ``copy_engines`` is a real ``CopyEngines`` on the machine's streams."""

    def __init__(self, machine: Machine, rank: int) -> None:
        self.machine, self.rank, self.world = machine, rank, machine.world
        self.slot_bytes = machine.slot_bytes
        self.device = torch.device("cpu")
        self.device_index = rank
        self.max_blocks, self.block_bytes = 8, 1 << 10
        self.ce_chunk_bytes, self.ce_max_chunks = machine.chunk_bytes, 16
        self.ce_all_reduce_chunk_bytes = machine.chunk_bytes
        self.slot_pointers = tuple(s.data_ptr() for s in machine.slots)
        self.flag_pointers = tuple(f.data_ptr() for f in machine.flags)
        self.main = Stream(machine, 100 * rank)
        # no watchdog: it bounds stream waits on GPUs; here a wait that never holds is a deadlock
        self.copy_engines = CopyEngines(cast(Any, self), cast(Any, (Stream(machine, 100 * rank + 1),
                                                                    Stream(machine, 100 * rank + 2))), watchdog=False)
        self.fences = 0

    # the copy-engine collectives, run on this stand-in
    def by_shard(self, kind: str, output: torch.Tensor, input: torch.Tensor, m: int) -> None:
        algo.by_shard(cast(Any, self), kind, output, input, m)

    def all_reduce(self, t: torch.Tensor, vec: bool) -> None:
        algo.all_reduce(cast(Any, self), t, vec)

    # what they use of the PeerMemory
    def blocks(self, nbytes: int) -> int:
        return max(1, min(self.max_blocks, -(-nbytes // self.block_bytes)))

    def stream(self) -> int:
        return _launch.current_stream(self.device_index)  # type: ignore[no-any-return]

    def validate(self, t: torch.Tensor) -> None:
        pass

    def kernel(self, kind: str, dtype: torch.dtype | None, vec: bool, nargs: int = 4) -> Callable[..., None]:
        return lambda blocks, stream, *args: self.machine.stream(stream).ops.append(
            getattr(self.machine, "_k_" + kind)(self, *args))

    def my_flag(self, slot: int, stage: int, src: int) -> int:
        """My copy-engine flag (slot, stage) as signalled by rank ``src``."""
        return int(_at(self.flag_pointers[self.rank] + self.flag_offset(slot, stage, src), 1, torch.int32)[0])

    @staticmethod
    def flag_offset(slot: int, stage: int, src: int) -> int:
        return L.ce_flag_offset(slot, stage, src)


class Machine:
    """``world`` ranks' memory, streams and kernels; see the module docstring."""

    def __init__(self, world: int, slot_bytes: int, chunk_bytes: int) -> None:
        self.world, self.slot_bytes, self.chunk_bytes = world, slot_bytes, chunk_bytes
        self.slots = [torch.full((slot_bytes,), 0xAB, dtype=torch.uint8) for _ in range(world)]
        self.flags = [torch.zeros(L.FLAG_BYTES // 4, dtype=torch.int32) for _ in range(world)]
        self.ranks = [FakeRank(self, r) for r in range(world)]
        self._streams = {s.cuda_stream: s for r in self.ranks for s in (r.main, *r.copy_engines.streams)}
        self._arrived: list[int] = [0] * world  # fences each rank has reached
        self.active = 0
        self.most_uses = 0  # the highest use count signalled for a ring slot (>= 2: the ring wrapped)

    def stream(self, ident: int) -> Stream:
        return self._streams[ident]

    # -- the host side: run each rank's call with the fakes in place --------------------------
    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        saved = (_launch.copy_async, _launch.write_value, _launch.current_stream, torch.cuda.current_stream,
                 torch.cuda.Event, _launch.wait_value)

        def copy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
            def run() -> None:
                _at(dst, nbytes, torch.uint8).copy_(_at(src, nbytes, torch.uint8).clone())
            self.stream(stream).ops.append(((lambda: True), run))

        def write_value(stream: int, addr: int, value: int) -> None:
            self.most_uses = max(self.most_uses, value)

            def run() -> None:
                _at(addr, 1, torch.int32).fill_(value)
            self.stream(stream).ops.append(((lambda: True), run))

        def wait_value(stream: int, addr: int, value: int) -> None:
            def ready() -> bool:  # cuStreamWaitValue32's GEQ: (int32)(*addr - value) >= 0
                d = (int(_at(addr, 1, torch.int32)[0]) - value) & 0xFFFFFFFF
                return d < 1 << 31
            self.stream(stream).ops.append((ready, lambda: None))

        _launch.copy_async, _launch.write_value, _launch.wait_value = copy_async, write_value, wait_value
        _launch.current_stream = lambda index: self.ranks[index].main.cuda_stream
        setattr(torch.cuda, "current_stream", lambda device=None: self.ranks[self.active].main)
        setattr(torch.cuda, "Event", Event)
        try:
            yield
        finally:
            _launch.copy_async, _launch.write_value, _launch.current_stream = saved[:3]
            _launch.wait_value = saved[5]
            setattr(torch.cuda, "current_stream", saved[3])
            setattr(torch.cuda, "Event", saved[4])

    def call(self, fn: Callable[[FakeRank], None]) -> None:
        """Every rank's host code, rank by rank (none of it waits for the device)."""
        with self.patched():
            for r in self.ranks:
                self.active = r.rank
                fn(r)

    # -- the device side -----------------------------------------------------------------------
    def run(self, seed: int) -> None:
        rng = random.Random(seed)
        queues = list(self._streams.values())
        while True:
            live = [s for s in queues if s.ops]
            if not live:
                return
            ready = [s for s in live if s.ops[0][0]()]
            if not ready:
                raise AssertionError(f"deadlock: {len(live)} streams wait ({[s.cuda_stream for s in live]})")
            s = rng.choice(ready)
            s.ops.popleft()[1]()

    def _peers_at_least(self, me: FakeRank, slot: int, stage: int, value: int) -> bool:
        return all(me.my_flag(slot, stage, q) >= value for q in range(self.world) if q != me.rank)

    def _signal(self, me: FakeRank, slot: int, stage: int, value: int) -> None:
        for q in range(self.world):
            if q != me.rank:
                _at(me.flag_pointers[q] + me.flag_offset(slot, stage, me.rank), 1, torch.int32).fill_(value)

    def _k_ce_fence(self, me: FakeRank, mode: int) -> _Op:
        me.fences += 1
        k = me.fences
        reached = [False]

        def ready() -> bool:
            if not reached[0]:
                reached[0] = True
                self._arrived[me.rank] = k
            return all(a >= k for a in self._arrived)

        def run() -> None:
            if mode & L.FENCE_CLEAR:
                start = L.BLOCK_FLAG_WORDS
                self.flags[me.rank][start:start + L.CE_RING * L.CE_STAGES * L.MAX_RANKS] = 0
        return ready, run

    def _k_ce_wait(self, me: FakeRank, slot: int, stage: int, value: int) -> _Op:
        return (lambda: self._peers_at_least(me, slot, stage, value)), (lambda: None)

    def _k_ce_wait_from(self, me: FakeRank, slot: int, stage: int, value: int, q: int) -> _Op:
        return (lambda: me.my_flag(slot, stage, q) >= value), (lambda: None)

    def _k_ce_reduce_rs(self, me: FakeRank, src: int, dst: int, slot_off: int, C: int, nj: int, j: int,
                        R: int) -> _Op:
        s, u = j % R, j // R
        mine = self.slots[me.rank].data_ptr()

        def run() -> None:
            acc = torch.zeros(nj, dtype=torch.float32)
            for q in range(self.world):
                acc += _at(src, nj, torch.float32) if q == me.rank else _at(mine + (slot_off + q * C) * 4, nj,
                                                                             torch.float32)
            _at(dst, nj, torch.float32).copy_(acc)
            self._signal(me, s, L.CE_REDUCED, u + 1)
        return (lambda: self._peers_at_least(me, s, L.CE_PUSHED, u + 1)), run

    def _k_ce_reduce(self, me: FakeRank, src: int, dst: int, slot_off: int, S: int, nj: int, j: int, R: int,
                     S_max: int) -> _Op:
        s, u = j % R, j // R
        r, w = me.rank, self.world
        mine = self.slots[r].data_ptr()

        def ready() -> bool:
            return self._peers_at_least(me, s, L.CE_PUSHED, u + 1) and \
                (u == 0 or self._peers_at_least(me, s, L.CE_PULLED, u))

        def run() -> None:
            n = max(0, min(S, nj - r * S))
            acc = torch.zeros(n, dtype=torch.float32)
            for q in range(w):
                acc += _at(src + r * S * 4, n, torch.float32) if q == r else _at(mine + (slot_off + q * S_max) * 4, n,
                                                                                  torch.float32)
            _at(mine + (slot_off + w * S_max) * 4, n, torch.float32).copy_(acc)
            _at(dst + r * S * 4, n, torch.float32).copy_(acc)
            self._signal(me, s, L.CE_REDUCED, u + 1)
        return ready, run
