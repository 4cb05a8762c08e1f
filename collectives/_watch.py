"""When one rank's call goes wrong, the others hear of it within seconds, without debug mode.

Everything here travels through the group's store (the default store, keys under
``commops/watch/``) and only once something has gone wrong or a call has waited a while; a call
that goes well pays nothing for it.

* **A failure notice.** A rank whose call raises (a bad argument, a refused algorithm, an error
  inside the algorithm, a timeout) writes what it raised under the call's number and counts it in
  the group's failure counter (:func:`failed`).
* **The patrol.** The flight recorder's publishing thread (it writes each rank's progress every
  ``PROGRESS_PERIOD_S``, 0.5 s) also looks at this process's calls on Gloo groups that have been
  in flight longer than a period (the recorder's entries still "started"). For each it reads the
  failure counter (one store round trip per period) and, once the call has waited
  ``COMMOPS_CHECK_AFTER_S`` (2 s), writes the fingerprint of the pending call and of the group's
  previous one (op, algorithm, shapes, dtype, reduce op, root; the call number is the key) and
  compares it with those the other ranks wrote. A notice from another rank for this call or an
  earlier one, or a fingerprint that differs, **aborts** the group on this rank: the exception to
  raise (:class:`~collectives.errors.RankFailed` naming that rank, its call and its error, or
  :class:`~collectives.errors.CollectiveMismatch` naming both sides) is kept on the communicator,
  the abort is written to the store, and the blocked wait is broken: a receive from each peer,
  posted on each of the group's Gloo contexts and waited for a millisecond, makes Gloo close
  that context's connections, so that the wait inside the collective returns with an error, which the dispatch
  point replaces by the kept exception. (Gloo's own abort does not wake a waiting thread, and a
  timed wait on a send or receive closes the connections in the same way, so waits cannot be
  taken in slices.) The previous call's fingerprint is there because a mismatch can let one side
  finish (Gloo returns a short all-reduce on a rank that passed fewer elements) and wait in its
  next call instead.
* **The verdict.** After a failure the group is in one of two states, and every rank ends up
  knowing which. Where every rank failed the same call (the same bad argument everywhere) nothing
  was sent and the group stays usable. Otherwise some rank entered the call and sent, the ranks
  are out of step, and the group is aborted: every later call on it raises
  :class:`~collectives.errors.GroupAborted` at once, before anything is sent. The rank whose call
  failed learns which state holds at its next call on the group (:func:`settle`), which first
  waits, bounded like a call, until every other rank has either failed the same call or aborted.
  A failure in the group's very first call, before the settings check, travels in that check
  instead (``collectives/_agree.py``): nothing has been sent, so the group stays usable there.

A failed call uses up its call number on the rank that failed, so that where the group stays
usable every rank has counted the same calls.

Not covered (the timeout, or torchrun's stop, decides there): NCCL, where the host does not wait
inside a collective (the verdict and ``GroupAborted`` hold there too); MPI; a wait on an
``async_op=True`` handle; the recorder turned off (``COMMOPS_RECORDER=0``), whose entries the
patrol reads; and ranks that disagree on a size in a call the backend's own Gloo collective runs:
Gloo's TCP transport aborts the process that receives a longer message than it posted (C++
``EnforceNotMet``, SIGABRT) before Python can act, or fills a longer buffer in part. Debug check
mode catches those before anything is sent. In our point-to-point schedules each message's tag
carries its element count and dtype (``algos/_executor.py``'s ``message_tag``), so there the two
sides' messages do not match, both wait, and the fingerprint check names them.
"""

from __future__ import annotations

import datetime
import json
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import _env
from .debug import FIELDS
from ._types import normalize_reduce_op
from ._wait import bound_s
from .errors import CollectiveMismatch, CollectiveTimeout, GroupAborted, RankFailed
from .recorder import FIELDS as _RFIELDS
from .recorder import PROGRESS_PERIOD_S, RECORDER, _store

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["watch", "failed", "settle", "first_failure", "failures_before", "patrol", "ABORTED"]

ABORTED = "aborted"  # comm._trouble[0] of an aborted group; ("suspect", seq) awaits a verdict
_SETTLE_POLL_S = (0.005, 0.1)  # the verdict's poll: first and largest sleep
_BREAK_TAG = 0x7C0FFEE  # the tag of the receive that breaks a Gloo context (never sent to)
_COMPARED = FIELDS  # what debug check mode compares
_AT = {f: _RFIELDS.index(f) for f in ("group", "seq", "t_enqueue", "state", *_COMPARED)}
_RECENT = 64  # recorder entries the patrol looks back through

# group name -> the communicators the patrol watches (Gloo, a store, more than one rank)
_WATCHED: dict[str, weakref.ReferenceType[Communicator]] = {}


def watch(comm: Communicator) -> None:
    """Watch ``comm`` from now on (the settings check calls this once it has agreed)."""
    if comm._epoch is not None and comm.backend_for("cpu") == "gloo":
        _WATCHED[comm._group_name] = weakref.ref(comm)


def _keys(comm: Communicator) -> str:
    return f"commops/watch/{comm._epoch}"


def _global(comm: Communicator) -> int:
    return comm.global_ranks[comm.rank]


# -- a call failed on this rank ---------------------------------------------------------------------
def failed(comm: Communicator, seq: int, op: str, exc: BaseException) -> None:
    """This rank's call #``seq`` raised ``exc``: tell the other ranks (a notice in the store) and
    hold the group until the verdict at its next call (:func:`settle`). Nothing when the group
    has one rank or no store, or when the failure came from another rank (the group is aborted)."""
    if comm._epoch is None or (comm._trouble is not None and comm._trouble[0] == ABORTED):
        return
    _notice(comm, seq, op, f"{type(exc).__name__}: {exc}")
    comm._trouble = ("suspect", seq)
    comm._fast.clear()  # the fast paths go through the dispatch point, which settles first


def _notice(comm: Communicator, seq: int, op: str, error: str) -> None:
    store = _store()
    if store is None:
        return
    detail = json.dumps({"rank": _global(comm), "seq": seq, "op": op, "error": error[:1500]})
    base = _keys(comm)
    try:
        store.set(f"{base}/fail/{seq}/{comm.rank}", detail)
        i = store.add(f"{base}/failures", 1)
        store.set(f"{base}/failure/{i}", detail)
    except Exception:  # noqa: BLE001 - the store is gone: the others fall back on their timeouts
        pass


def _abort(comm: Communicator, reason: str) -> None:
    comm._trouble = (ABORTED, reason)
    comm._fast.clear()
    store = _store()
    if store is not None:
        try:
            store.set(f"{_keys(comm)}/aborted/{comm.rank}", reason[:500])
        except Exception:  # noqa: BLE001 - the store is gone
            pass


def settle(comm: Communicator, op: str) -> None:
    """Before a call on a group in trouble: raise ``GroupAborted`` if it is aborted; after this
    rank's own failure of call #k, wait (bounded like a call) until every other rank has failed
    call #k too (the group stays usable) or aborted (raise ``GroupAborted``)."""
    kind, info = comm._trouble  # type: ignore[misc]
    if kind == ABORTED:
        raise GroupAborted(op, comm._group_name, str(info))
    seq = int(info)
    store = _store()
    if store is None:
        comm._trouble = None
        return
    base, me = _keys(comm), comm.rank
    pending = [r for r in range(comm.size) if r != me]
    aborted: list[int] = []
    deadline = time.monotonic() + bound_s(comm)
    delay = _SETTLE_POLL_S[0]
    while pending:
        for r in list(pending):
            if store.check([f"{base}/fail/{seq}/{r}"]):
                pending.remove(r)
            elif store.check([f"{base}/aborted/{r}"]):
                pending.remove(r)
                aborted.append(comm.global_ranks[r])
        if aborted or not pending:
            break
        if time.monotonic() > deadline:
            missing = [comm.global_ranks[r] for r in pending]
            why = f"after this rank's call #{seq} failed, rank(s) {missing} neither failed it too nor aborted " \
                  "within the call's bound"
            comm._trouble = (ABORTED, why)
            raise CollectiveTimeout(op, missing, why)
        time.sleep(delay)
        delay = min(2 * delay, _SETTLE_POLL_S[1])
    if aborted:
        why = f"this rank's call #{seq} failed while rank(s) {sorted(aborted)} were in it"
        _abort(comm, why)
        raise GroupAborted(op, comm._group_name, why)
    comm._trouble = None  # every rank failed call #seq: it never happened anywhere
    comm._settled.add(seq)


def _others(comm: Communicator, store: Any, seq: int) -> list[dict[str, Any]]:
    """The other ranks' failure notices for calls up to #``seq`` not settled as harmless; reads
    from the store only the notices this communicator has not read before."""
    n = int(store.add(f"{_keys(comm)}/failures", 0))
    while comm._notices_read < n:
        key = f"{_keys(comm)}/failure/{comm._notices_read + 1}"
        if not store.check([key]):
            break  # written just after the count: read next time
        comm._notices.append(json.loads(store.get(key).decode()))
        comm._notices_read += 1
    me = _global(comm)
    return [d for d in comm._notices if d["rank"] != me and d["seq"] <= seq and d["seq"] not in comm._settled]


def first_failure(comm: Communicator, seq: int, op: str) -> RankFailed | None:
    """Another rank's failure of call #``seq`` or an earlier one, read from the store, as the
    ``RankFailed`` to raise here (the group is then aborted); None if there is none."""
    store = _store()
    if comm._epoch is None or store is None:
        return None
    try:
        found = _others(comm, store, seq)
    except Exception:  # noqa: BLE001 - the store is out of reach
        return None
    if not found:
        return None
    d = found[0]
    _abort(comm, f"rank {d['rank']} failed call #{d['seq']} ({d['op']}) while this rank was in call #{seq}")
    return RankFailed(op, seq, d["rank"], d["op"], d["seq"], d["error"], usable=False)
    return None


def failures_before(comm: Communicator, seq: int) -> str:
    """The other ranks' failure notices for calls up to #``seq``, as text ("" for none or no store)."""
    store = _store()
    if comm._epoch is None or store is None:
        return ""
    try:
        seen = _others(comm, store, seq)
    except Exception:  # noqa: BLE001 - the store is out of reach
        return ""
    return "; ".join(f"rank {d['rank']} failed call #{d['seq']} ({d['op']}): {d['error'][:300]}" for d in seen)


class _Pending:
    """What the patrol knows of one call in flight: its fingerprints, once written."""

    __slots__ = ("seq", "since", "published", "count_seen")

    def __init__(self, seq: int, since: float) -> None:
        self.seq, self.since = seq, since
        self.published: list[int] = []
        self.count_seen = -1


_PENDING: dict[str, _Pending] = {}  # group name -> the call in flight the patrol is looking at


def patrol() -> None:
    """One look at this process's calls in flight on the watched groups (the recorder's publishing
    thread calls this every period)."""
    if not _WATCHED or not RECORDER.enabled:
        return
    now = time.time()
    entries = RECORDER.recent(_RECENT)
    for name, ref in list(_WATCHED.items()):
        comm = ref()
        if comm is None or comm.group is None:
            _WATCHED.pop(name, None)
            _PENDING.pop(name, None)
            continue
        entry = next((e for e in reversed(entries) if e[_AT["group"]] == name), None)
        pending = _PENDING.get(name)
        if entry is None or entry[_AT["state"]] != "started" or comm._trouble is not None \
                or now - (entry[_AT["t_enqueue"]] or now) < PROGRESS_PERIOD_S:
            if pending is not None:
                _PENDING.pop(name, None)
                _unpublish(comm, pending)
            continue
        if pending is None or pending.seq != entry[_AT["seq"]]:
            if pending is not None:
                _unpublish(comm, pending)
            pending = _PENDING[name] = _Pending(entry[_AT["seq"]], entry[_AT["t_enqueue"]])
        try:
            found = _look(comm, pending, entry, entries, now)
        except Exception:  # noqa: BLE001 - the store is out of reach: the timeout decides
            continue
        if found is not None:
            _PENDING.pop(name, None)
            comm._kept = found
            _break(comm)


def _look(comm: Communicator, pending: _Pending, entry: list[Any], entries: list[list[Any]],
          now: float) -> BaseException | None:
    """The exception to raise in the call in flight, or None to go on waiting."""
    store = _store()
    if store is None:
        return None
    seq, op = pending.seq, entry[_AT["op"]]
    for d in _others(comm, store, seq):
        if d["error"].startswith(CollectiveMismatch.__name__):
            found = _compare(comm, pending, entry, entries, now, force=True)
            if found is not None:
                return found
        _abort(comm, f"rank {d['rank']} failed call #{d['seq']} ({d['op']}) while this rank was in call #{seq}")
        return RankFailed(op, seq, d["rank"], d["op"], d["seq"], d["error"], usable=False)
    if now - pending.since >= _env.CHECK_AFTER_S.get():
        return _compare(comm, pending, entry, entries, now)
    return None


def _compare(comm: Communicator, pending: _Pending, entry: list[Any], entries: list[list[Any]], now: float,
             force: bool = False) -> BaseException | None:
    store = _store()
    base, seq = f"{_keys(comm)}/pending", pending.seq
    if not pending.published:
        mine = {seq: _fingerprint_entry(entry)}
        for e in entries:  # the group's previous call, where the ring still holds it
            if e[_AT["group"]] == comm._group_name and e[_AT["seq"]] == seq - 1:
                mine[seq - 1] = _fingerprint_entry(e)
        for s, fp in mine.items():
            store.set(f"{base}/{s}/{comm.rank}", json.dumps(fp))
            pending.published.append(s)
        store.add(f"{base}/count", 1)
    n = int(store.add(f"{base}/count", 0))
    if n == pending.count_seen and not force:
        return None  # no rank has written a fingerprint since the last comparison
    pending.count_seen = n
    theirs: dict[int, dict[str, Any]] = {comm.rank: _fingerprint_entry(entry)}
    for r in range(comm.size):
        key = f"{base}/{seq}/{r}"
        if r != comm.rank and store.check([key]):
            theirs[r] = json.loads(store.get(key).decode())
    for field in _COMPARED:
        values: dict[str, list[int]] = {}
        for r, fp in sorted(theirs.items()):
            values.setdefault(json.dumps(fp[field]), []).append(comm.global_ranks[r])
        if len(values) > 1:
            exc = CollectiveMismatch(entry[_AT["op"]], seq, field, values,
                                     detail=f"found after the call had waited {now - pending.since:.1f} s for its "
                                            "peers (fingerprints compared through the store, without debug mode); "
                                            "the group is aborted")
            _notice(comm, seq, entry[_AT["op"]], f"{CollectiveMismatch.__name__}: {exc}")
            _abort(comm, f"call #{seq}: the ranks disagree on {field}")
            return exc
    return None


def _unpublish(comm: Communicator, pending: _Pending) -> None:
    store = _store()
    for s in pending.published if store is not None else ():
        try:
            store.delete_key(f"{_keys(comm)}/pending/{s}/{comm.rank}")
        except Exception:  # noqa: BLE001 - a store without delete keeps the key: harmless
            pass


def _break(comm: Communicator) -> None:
    """Make the wait blocked in ``comm``'s call return: on each of the group's Gloo contexts (the
    group, its point-to-point twin, its derived groups) post a receive and wait a millisecond for
    it, which makes Gloo close that context's connections and fail what waits on them."""
    groups = [comm.group]
    if comm._p2p is not None and comm._p2p is not comm.group:
        groups.append(comm._p2p)
    derived = comm._derived
    for attr in ("intra", "rail", "leaders"):
        g = getattr(derived, attr, None) if derived is not None else None
        if isinstance(g, dist.ProcessGroup):
            groups.append(g)
    for g in groups:
        try:
            size, me = dist.get_world_size(g), dist.get_rank(g)
        except Exception:  # noqa: BLE001 - the group is gone
            continue
        # From every peer: a connection another rank has closed already refuses the receive at
        # once, without closing this context, while the wait may be on another peer.
        for q in range(size):
            if q == me:
                continue
            try:
                work = dist.irecv(torch.empty(1), dist.get_global_rank(g, q), group=g, tag=_BREAK_TAG)
                if work is not None:
                    work.wait(datetime.timedelta(milliseconds=1))
            except Exception:  # noqa: BLE001 - the expected outcome: Gloo gave the context up
                pass


# ops whose leading dimension is each rank's own (its rows to send and receive): not compared
_PER_RANK_ROWS = frozenset({"all_to_all", "moe_dispatch", "moe_combine", "moe_forward"})


def _fingerprint_entry(e: list[Any]) -> dict[str, Any]:
    keep = 1 if e[_AT["op"]] in _PER_RANK_ROWS else 0
    rop = e[_AT["reduce_op"]]
    return {"op": e[_AT["op"]], "algorithm": e[_AT["algorithm"]],
            "in_shape": None if e[_AT["in_shape"]] is None else list(e[_AT["in_shape"]])[keep:],
            "out_shape": None if e[_AT["out_shape"]] is None else list(e[_AT["out_shape"]])[keep:],
            "dtype": None if e[_AT["dtype"]] is None else str(e[_AT["dtype"]]).removeprefix("torch."),
            "reduce_op": None if rop is None else normalize_reduce_op(rop), "root": e[_AT["root"]]}




RECORDER.patrols.append(patrol)
