"""Typed errors raised by commops.

Every error raised before communication names the argument, the value it had and how to fix it,
so that a user reading one line of a rank's log knows what to change. All of them derive from
:class:`CommopsError`, and each is also what torch.distributed raises for the same fault, so that
code written against torch's exceptions keeps working: an argument error is a ``ValueError`` and a
``RuntimeError`` (torch raises either, depending on whether Python or the backend's C++ checks
the argument), a wrong type also a ``TypeError``, and what no algorithm or backend runs also a
``NotImplementedError`` (what torch raises for, say, a sparse tensor its backend cannot move).
"""

from __future__ import annotations

from torch.distributed import DistBackendError as _DistBackendError

__all__ = [
    "CommopsError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "UnsupportedError",
    "NotInitializedError",
    "LaunchError",
    "CollectiveTimeout",
    "CollectiveMismatch",
    "RankLeft",
    "InvalidSettingError",
    "UnsafePathError",
    "SettingsMismatch",
    "RankFailed",
    "GroupAborted",
]


class CommopsError(Exception):
    """Base class of every error commops raises on purpose."""


class InvalidArgumentError(CommopsError, ValueError, RuntimeError):
    """An argument has a value the collective cannot accept; raised before anything is sent."""

    def __init__(self, argument: str, value: object, problem: str, fix: str) -> None:
        self.argument = argument
        self.value = value
        self.problem = problem
        self.fix = fix
        super().__init__(f"{argument}={_short(value)}: {problem}. Fix: {fix}")


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong Python type (a list where a tensor belongs, say)."""


class UnsupportedError(InvalidArgumentError, NotImplementedError):
    """The chosen algorithm or backend cannot run this op, dtype or device; names those that can."""


class InvalidSettingError(InvalidArgumentError):
    """An environment variable commops reads (``collectives/_env.py``) has a value it cannot parse;
    names the variable, the value and the spellings it accepts. Raised where the setting is first read."""


class UnsafePathError(CommopsError, PermissionError):
    """A file or directory commops would load code from could be changed by another user (its
    owner, its mode, a symbolic link), or holds other bytes than its name says; nothing was loaded
    from it. Names the path, what is wrong with it and the fix."""

    def __init__(self, what: str, path: object, problem: str, fix: str) -> None:
        self.what = what
        self.path = str(path)
        self.problem = problem
        self.fix = fix
        super().__init__(f"{what}={_short(self.path)}: {problem}. Fix: {fix}")


class NotInitializedError(CommopsError, RuntimeError):
    """A collective was called before torch.distributed was initialised."""


class LaunchError(CommopsError, RuntimeError):
    """The process was not started by a launcher that ``collectives.init`` understands."""


class CollectiveTimeout(CommopsError, _DistBackendError, TimeoutError):
    """A collective waited longer than its bound for a peer; names the op, the stage and the peers
    that did not arrive. Catchable where torch's own timeout is (``DistBackendError``, a
    ``RuntimeError``) and as a ``TimeoutError``; where the backend raised, its text follows ours."""

    def __init__(self, op: str, missing: list[int], detail: str, backend_text: str = "") -> None:
        self.op = op
        self.missing = missing
        tail = f". Backend: {backend_text}" if backend_text else ""
        super().__init__(f"{op}: rank(s) {missing} did not arrive: {detail}{tail}")


class CollectiveMismatch(CommopsError, RuntimeError):
    """Debug check mode: the ranks called a collective with different arguments; every rank
    raises this, naming the field and which ranks passed which value, before anything is sent.

    ``field`` is a fingerprint field, or ``"splits"`` for an all-to-all whose split sizes do not
    pair up (``detail`` then lists the pairs of ranks that disagree, with both sides' rows).
    """

    def __init__(self, op: str, seq: int, field: str, sides: dict[str, list[int]], *, detail: str = "",
                 fix: str = "") -> None:
        self.op, self.seq, self.field, self.sides = op, seq, field, sides
        listed = "; ".join(f"rank(s) {ranks} passed {value}" for value, ranks in sides.items())
        fix = fix or ("give every rank of the group the same call (same op, shapes, dtype, reduce op and root) in "
                      "the same order")
        super().__init__(f"{op} call #{seq}: the ranks disagree on {field}: {detail + '; ' if detail else ''}"
                         f"{listed}. Fix: {fix}")


class SettingsMismatch(CommopsError, ValueError):
    """Settings that must agree across the ranks of a group differ (peer-buffer bytes, tuned
    tables, topology override, debug mode, calibration); raised on every rank, with the same text,
    before the group's first collective is sent (``collectives/_agree.py``).

    Attributes:
        group: the group's name.
        setting: the first setting that differs; ``differ`` has them all, each as
            ``{value: [global ranks]}``.
    """

    def __init__(self, group: str, differ: dict[str, dict[str, list[int]]]) -> None:
        self.group, self.differ = group, differ
        self.setting = next(iter(differ))
        listed = " | ".join(f"{name}: " + "; ".join(f"rank(s) {ranks} have {value}" for value, ranks in sides.items())
                            for name, sides in differ.items())
        super().__init__(f"group {group}: settings that must agree across its ranks differ: {listed}. Fix: give "
                         "every rank the same value of each (the same COMMOPS_* environment and the same tables "
                         "passed to set_tuned / set_calibration) before the group's first collective")


def _short(value: object) -> str:
    # Tensors print their data; a shape and dtype is what the reader needs.
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        device = getattr(value, "device", "?")
        return f"<tensor shape={tuple(shape)} dtype={dtype} device={device}>"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


class RankLeft(CommopsError, _DistBackendError):
    """A peer's connection dropped in the middle of a collective: names the rank(s) whose process
    is gone (their heartbeat stopped) and keeps the backend's own text. A ``DistBackendError``
    (a ``RuntimeError``), as what torch raises for the same failure."""

    def __init__(self, op: str, seq: int, gone: list[int] | None, backend_text: str) -> None:
        self.op, self.seq, self.gone = op, seq, gone
        if gone:
            who = f"rank(s) {gone} left the group mid-call (the process exited or was killed)"
        elif gone is None:
            who = "a peer's connection dropped (which rank is gone could not be read from the store)"
        else:
            who = "a peer's connection dropped, but every rank's heartbeat still moves (a network fault)"
        super().__init__(f"{op} call #{seq}: {who}. The group cannot be used again: destroy it and "
                         f"restart. Backend: {backend_text}")


class RankFailed(CommopsError, _DistBackendError):
    """Another rank's call failed (a bad argument, a refused algorithm, an error inside the
    algorithm) while this rank waited in the same call: raised within seconds of the failure,
    told through the store (``collectives/_watch.py``), naming that rank, its call and its error.

    Attributes:
        culprit: the global rank whose call failed. seq: its call number on the group.
        error: what it raised (type and message). usable: whether the group can still be used
            (True only when it failed before the group's first collective sent anything).
    """

    def __init__(self, op: str, seq: int, culprit: int, culprit_op: str, culprit_seq: int, error: str, *,
                 usable: bool) -> None:
        self.op, self.seq, self.culprit, self.error, self.usable = op, seq, culprit, error, usable
        then = ("Nothing was sent (the group's first collective): the group is usable, and every rank raised "
                "this or that rank's error" if usable else
                f"The group is aborted: every later call on it raises {GroupAborted.__name__}; make a new group "
                "for these ranks (torch.distributed.new_group) or restart the job")
        super().__init__(f"{op} call #{seq}: rank {culprit} failed its call #{culprit_seq} ({culprit_op}) on this "
                         f"group: {error}. {then}")


class GroupAborted(CommopsError, _DistBackendError):
    """A call on a group that an earlier failure left out of step: raised at once, before anything
    is sent, naming that failure. No call on the group can run again; make a new group for the
    same ranks (``torch.distributed.new_group``) or restart the job."""

    def __init__(self, op: str, group: str, reason: str) -> None:
        self.op, self.group, self.reason = op, group, reason
        super().__init__(f"{op}: group {group} was aborted ({reason}); no call on it can run again. Fix: make a "
                         "new group for these ranks (torch.distributed.new_group) or restart the job")
