"""Schedules as plain data: what a rank sends, receives, reduces and copies, step by step.

An algorithm first describes its work as a :class:`Schedule` for one rank, then the executor runs
it. Because a schedule is data, tests can check its structure (step counts, peers, bytes per peer)
without any communication, and the cost model can price it.

Buffers are named, flat, element-indexed views:

- ``"in"``: the input tensor (for in-place ops the same storage as ``"out"``),
- ``"out"``: the output tensor,
- ``"tmp"``: scratch of ``Schedule.scratch`` elements owned by the executor.

Within one step the executor first does the step's local copies, then posts every send and every
receive at once, waits for all of them, and finally folds received data into its destination
(a plain copy, or a reduction with the call's reduce op). A step never receives into a region it
sends from, so the order in which the transport completes sends and receives does not matter;
``Schedule.check()`` asserts that and the tests call it for every algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Region", "Send", "Recv", "Copy", "Step", "Schedule", "Layout", "balanced_chunks", "with_copies"]


@dataclass(frozen=True, slots=True)
class Region:
    """``count`` elements of buffer ``buf`` starting at element ``offset``."""

    buf: str
    offset: int
    count: int

    @property
    def end(self) -> int:
        return self.offset + self.count


@dataclass(frozen=True, slots=True)
class Send:
    """Send the concatenation of ``src`` regions to group rank ``peer``."""

    peer: int
    src: tuple[Region, ...]

    @property
    def count(self) -> int:
        return sum(r.count for r in self.src)


@dataclass(frozen=True, slots=True)
class Recv:
    """Receive from group rank ``peer`` into ``dst`` regions, copying or reducing (``reduce=True``).

    A plain copy into one region lands in place; a reduction, several regions, or ``staged=True``
    (needed when the step also sends from those regions) land in staging first and are folded in
    after every transfer of the step has completed.
    """

    peer: int
    dst: tuple[Region, ...]
    reduce: bool = False
    staged: bool = False

    @property
    def lands_in_place(self) -> bool:
        return not (self.reduce or self.staged or len(self.dst) > 1)

    @property
    def count(self) -> int:
        return sum(r.count for r in self.dst)


@dataclass(frozen=True, slots=True)
class Copy:
    """Local copy of ``src`` into ``dst`` (same count)."""

    src: Region
    dst: Region


@dataclass(frozen=True, slots=True)
class Step:
    copies: tuple[Copy, ...] = ()
    sends: tuple[Send, ...] = ()
    recvs: tuple[Recv, ...] = ()

    @property
    def is_comm(self) -> bool:
        return bool(self.sends or self.recvs)


@dataclass(frozen=True, slots=True)
class Layout:
    """What a schedule depends on: the op, the group shape and the element counts of this rank.

    ``count`` is the element count of the op's natural unit: the all-reduce/broadcast/reduce
    tensor, the reduce-scatter output, the all-gather input. For all-to-all, ``in_splits`` and
    ``out_splits`` are element counts per peer. ``root`` is a group rank.
    """

    op: str
    world: int
    rank: int
    count: int = 0
    root: int | None = None
    in_splits: tuple[int, ...] | None = None
    out_splits: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Schedule:
    """The steps one rank runs for one call, plus the scratch it needs (elements)."""

    layout: Layout
    steps: tuple[Step, ...]
    scratch: int = 0
    # Elements of staging the executor needs in the busiest step: received data that is reduced or
    # scattered into several regions lands there first, and sends of several regions are packed there.
    staging: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        need = 0
        for s in self.steps:
            n = sum(r.count for r in s.recvs if not r.lands_in_place)
            n += sum(t.count for t in s.sends if len(t.src) > 1)
            need = max(need, n)
        object.__setattr__(self, "staging", need)

    @property
    def comm_steps(self) -> tuple[Step, ...]:
        return tuple(s for s in self.steps if s.is_comm)

    def peers(self) -> set[int]:
        return {t.peer for s in self.steps for t in self._transfers(s)}

    @staticmethod
    def _transfers(step: Step) -> tuple[Send | Recv, ...]:
        return (*step.sends, *step.recvs)

    def elements_sent(self) -> int:
        return sum(t.count for s in self.steps for t in s.sends)

    def check(self) -> None:
        """Assert the invariants the executor relies on (internal; used by tests)."""
        lay = self.layout
        for i, step in enumerate(self.steps):
            for t in self._transfers(step):
                assert 0 <= t.peer < lay.world and t.peer != lay.rank, f"step {i}: bad peer {t.peer}"
                assert t.count > 0, f"step {i}: empty transfer with {t.peer}"
            # One message per peer and direction per step: matching never depends on post order.
            assert len({t.peer for t in step.sends}) == len(step.sends), f"step {i}: two sends to one peer"
            assert len({t.peer for t in step.recvs}) == len(step.recvs), f"step {i}: two receives from one peer"
            # Data landing in place is written while sends of the same step may still read.
            in_place = [r for rv in step.recvs if rv.lands_in_place for r in rv.dst]
            folded = [r for rv in step.recvs if not rv.lands_in_place for r in rv.dst]
            sent = [r for sd in step.sends for r in sd.src]
            for w in in_place:
                for r in sent:
                    assert not _overlap(w, r), f"step {i}: {w} lands while {r} is sent"
            for a_i, a in enumerate(in_place):
                for b in in_place[a_i + 1:] + folded:
                    assert not _overlap(a, b), f"step {i}: {a} and {b} are both received into"
            for c in step.copies:
                assert c.src.count == c.dst.count, f"step {i}: copy of unequal regions {c}"


def _overlap(a: Region, b: Region) -> bool:
    return a.buf == b.buf and a.offset < b.end and b.offset < a.end and a.count > 0 and b.count > 0


def balanced_chunks(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous (offset, count) pieces differing by at most one."""
    base, extra = divmod(count, parts)
    out = []
    offset = 0
    for i in range(parts):
        n = base + (1 if i < extra else 0)
        out.append((offset, n))
        offset += n
    return out


def with_copies(steps: list[Step], first: Copy | None, last: Copy | None) -> list[Step]:
    """Put ``first`` before the first step's transfers and ``last`` in a step of its own at the end."""
    steps = list(steps)
    if first is not None:
        if steps:
            steps[0] = Step(copies=(first, *steps[0].copies), sends=steps[0].sends, recvs=steps[0].recvs)
        else:
            steps = [Step(copies=(first,))]
    if last is not None:
        steps.append(Step(copies=(last,)))
    return steps
