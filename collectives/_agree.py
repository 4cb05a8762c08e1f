"""Settings that must agree across the ranks of a group, checked once before its first collective.

Each rank reads some settings from its own environment and never sends them, yet the ranks act on
them together: the peer-memory slot buffers are sized from ``COMMOPS_PEER_BYTES``, and a rank
with a larger value writes past its peers' buffers; the tuned tables (``COMMOPS_TUNED``,
``COMMOPS_OVERLAP_TUNED``, ``Communicator.set_tuned``; ``COMMOPS_KERNELS_TUNED``, whose kernel
configurations only change timings, so that ranks run alike), the calibration (``COMMOPS_CALIBRATION``,
``Communicator.set_calibration``) and the topology override (``COMMOPS_TOPOLOGY``) steer
``algorithm="auto"``, and ranks that choose different algorithms run different schedules; debug
check mode (``COMMOPS_DEBUG``, ``comm.debug``) on some ranks only makes those wait for fingerprints
the others never write. :func:`agree` compares them across the group and raises
:class:`~collectives.errors.SettingsMismatch` on every rank, with the same text naming each
setting that differs, the ranks and their values.

The dispatch point runs it on a communicator's first call (``comm.seq == 0``, which only the full
path sees: the fast paths serve repeats of calls that already went through it), after validation
and before the algorithm is chosen, so nothing has been sent and no choice was made from a
setting the ranks do not share. ``PeerMemory`` runs it too, because it may be built before any
collective, and sizes its buffers from the agreed value. The result is kept on the communicator:
the cost is one store round trip per communicator (one write, one bounded wait, one read of every
rank's key), not per call.

Design note: each rank writes one key: a digest of its settings, the values compared (a file by
its content's digest, so one table at two paths agrees and two tables at one path, on ranks of
different hosts, do not) and their descriptions for the error (a file's path too). The digests
are compared first; the values only where the digests differ, so that the error can name them.
Rejected: an all-gather over the group (it is itself a collective sent before the check that
guards it, and on NCCL it needs device memory); checking on every call (a store round trip per
call, which debug mode pays for the call's own arguments); exchanging values only when digests
differ (a second round trip on the error path for a few hundred bytes saved). Settings changed
after the first call (``set_tuned`` later on) are not checked again: those calls are local by
contract, and a second exchange at an arbitrary call would need every rank to make it at the
same call. ``overlap.set_tuned`` is not seen here (``overlap`` sits above ``collectives``); its
environment variable is.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import _env, _watch
from ._wait import bound_s, store_gather
from .errors import InvalidSettingError, RankFailed, SettingsMismatch
from .recorder import _store

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Settings", "agree", "local_settings"]

_ROUNDS: dict[str, int] = {}  # group name -> agreements made on it by this process (the store key's round)


@dataclass(frozen=True)
class Settings:
    """The settings a communicator's ranks agreed on.

    Attributes:
        peer_bytes: bytes of each rank's peer-memory slot buffer (``COMMOPS_PEER_BYTES``).
        debug: debug check mode at the first call.
        compared: setting -> what must be equal on every rank (a file by its content's digest).
        described: setting -> its value as the error shows it (a file by its path and digest).
        digest: a digest of ``compared``, what the ranks compare first.
    """

    peer_bytes: int
    debug: bool
    compared: dict[str, str] = field(default_factory=dict)
    described: dict[str, str] = field(default_factory=dict)
    digest: str = ""


def _file(var: _env.EnvVar[str]) -> tuple[str, str]:
    path = var.get()
    if not path:
        return "unset", "unset"
    try:
        with open(path, "rb") as f:
            content = f"sha256 {hashlib.sha256(f.read()).hexdigest()[:12]}"
    except OSError as exc:
        content = f"unreadable: {exc.strerror}"
    return content, f"{path!r} ({content})"


def _table(table: Any) -> tuple[str, str]:
    if table is None:
        return "none", "none"
    text = json.dumps(table, sort_keys=True, default=repr)
    content = f"sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]}"
    return content, f"a table ({content})"


def _plain(value: object) -> tuple[str, str]:
    return str(value), str(value)


def local_settings(comm: Communicator) -> Settings:
    """This rank's settings for ``comm``, as :func:`agree` compares them (local; sends nothing)."""
    peer_bytes = int(_env.PEER_BYTES.get())
    debug = bool(comm.debug)
    pairs = {
        _env.PEER_BYTES.name: _plain(peer_bytes),
        _env.TUNED.name: _file(_env.TUNED),
        _env.OVERLAP_TUNED.name: _file(_env.OVERLAP_TUNED),
        _env.KERNELS_TUNED.name: _file(_env.KERNELS_TUNED),
        "set_tuned": _table(comm._choices.get("tuned_table")),
        _env.TOPOLOGY.name: _file(_env.TOPOLOGY),
        f"debug mode ({_env.DEBUG.name} / comm.debug)": _plain("on" if debug else "off"),
        _env.CALIBRATION.name: _file(_env.CALIBRATION),
        "set_calibration": _table(comm._choices.get("calibration")),
    }
    compared = {k: v[0] for k, v in pairs.items()}
    digest = hashlib.sha256(json.dumps(compared, sort_keys=True).encode()).hexdigest()[:16]
    return Settings(peer_bytes, debug, compared, {k: v[1] for k, v in pairs.items()}, digest)


def _differ(every: list[dict[str, Any]], ranks: tuple[int, ...]) -> dict[str, dict[str, list[int]]]:
    """setting -> {value as shown: global ranks} for each setting whose compared values differ."""
    differ: dict[str, dict[str, list[int]]] = {}
    for setting in every[0]["compared"]:
        groups: dict[str, list[int]] = {}
        for r, e in enumerate(every):
            groups.setdefault(e["compared"].get(setting, "unknown"), []).append(r)
        if len(groups) < 2:
            continue
        sides: dict[str, list[int]] = {}
        for value, members in groups.items():
            shown = {every[r]["described"].get(setting, value) for r in members}
            # one file at several paths: the content is what agrees, so show it alone
            label = shown.pop() if len(shown) == 1 else f"{value} (at {len(shown)} paths)"
            sides[label] = [ranks[r] for r in members]
        differ[setting] = sides
    return differ


def _invalid_settings() -> list[str] | None:
    """Read every ``COMMOPS_`` variable once: [name, value, problem] of the first that does not
    parse, else None. Read here, before the group's first call sends anything, a bad value cannot
    surface in the middle of a later call (the NVTX switch is read after a call has started)."""
    for var in _env.VARIABLES:
        try:
            var.get()
        except InvalidSettingError as exc:
            return [var.name, str(exc.value), exc.problem]
    return None


def _raise_invalid(reports: list[list[str] | None], ranks: tuple[int, ...]) -> None:
    bad = [(ranks[r], rep) for r, rep in enumerate(reports) if rep]
    if bad:
        name, value, problem = bad[0][1]
        where = sorted(g for g, rep in bad if rep[0] == name)
        raise InvalidSettingError(name, value, f"{problem}, on rank(s) {where}",
                                  f"fix {name} on those ranks (or unset it); every rank raised this before its first call")


def agree(comm: Communicator, op: str = "set-up") -> Settings:
    """The settings every rank of ``comm`` agreed on; compared through the default store the first time.

    Collective over ``comm``'s group the first time it runs on a communicator (every rank must
    reach it: the dispatch point calls it on the first call); then it returns what was agreed.
    The wait is bounded like the call's (:func:`collectives._wait.bound_s`).

    Args:
        comm: the communicator.
        op: the call that asks, for the timeout's text.
    Raises:
        SettingsMismatch: the ranks' settings differ; names each setting, the ranks and values.
        CollectiveTimeout: a rank did not reach its first call within the bound; names it.
    """
    done: Settings | None = comm._settings
    if done is not None:
        return done
    invalid = _invalid_settings()
    store = _store()
    if store is None or comm.size == 1:
        _raise_invalid([invalid], comm.global_ranks)
    # A variable this rank cannot parse is reported to every rank (below) instead of raised here,
    # where the others would wait for this rank's key until their bound.
    mine = local_settings(comm) if invalid is None else Settings(0, False, {}, {}, "invalid")
    if store is None or comm.size == 1:
        comm._settings = mine
        return mine
    name = comm._group_name
    # A fresh key for each agreement on this group name (a Communicator built again for the group,
    # an attempt after a mismatch): every rank makes them in the same order, so counts match.
    _ROUNDS[name] = n = _ROUNDS.get(name, 0) + 1
    raw = store_gather(store, f"commops/agree/{name}/{n}", comm.rank,
                       json.dumps({"digest": mine.digest, "compared": mine.compared, "described": mine.described,
                                   "invalid": invalid}),
                       comm.global_ranks, bound_s(comm), op, "settings check before the group's first collective")
    every = [json.loads(v) for v in raw]
    refused = [(comm.global_ranks[r], e["failed"]) for r, e in enumerate(every) if e.get("failed")]
    if refused:  # a rank's first call failed before this check: nothing was sent, the group stays usable
        culprit, d = refused[0]
        raise RankFailed(op, 1, culprit, d["op"], 1, d["error"], usable=True)
    _raise_invalid([e.get("invalid") for e in every], comm.global_ranks)
    if any(e["digest"] != mine.digest for e in every):
        differ = _differ(every, comm.global_ranks)
        if differ:  # digests differ only where the compared values do, short of a hash collision
            raise SettingsMismatch(name, differ)
    comm._settings = mine
    comm._epoch = f"{name}/{n}"  # the failure notices' keys (collectives/_watch.py)
    _watch.watch(comm)
    return mine


def refuse(comm: Communicator, op: str, exc: BaseException) -> None:
    """This rank's first call on ``comm`` failed before the settings check: put the failure where
    that check's exchange is, so that the ranks waiting in it raise ``RankFailed`` at once instead
    of waiting out the bound. Nothing was sent; the next call's check is the next round on every rank."""
    store = _store()
    if store is None or comm.size == 1:
        return
    name = comm._group_name
    _ROUNDS[name] = n = _ROUNDS.get(name, 0) + 1
    detail = {"op": op, "error": f"{type(exc).__name__}: {exc}"[:1500]}
    try:
        store.set(f"commops/agree/{name}/{n}/{comm.rank}", json.dumps({"failed": detail}))
    except Exception:  # noqa: BLE001 - the store is gone: the others fall back on their timeouts
        pass
