"""Debug check mode: the ranks compare every call's fingerprint before anything is sent.

Each rank writes its call's fingerprint (op, algorithm, shapes, dtype, reduce op, root, and an
all-to-all's split sizes; the key carries the group and the call's sequence number) into the
default store, then reads everyone's. Disagreement raises
:class:`~collectives.errors.CollectiveMismatch` on every rank with the same text; a rank that does
not write within the call's bound is named in a :class:`~collectives.errors.CollectiveTimeout`.
A rank removes its key of two calls back, so the store does not grow. Costs one store write, one
wait and one read of every rank's key per call (measured in the README). Turned on by
``collectives.init(debug=True)``, ``COMMOPS_DEBUG=1`` or ``comm.debug = True``.

Design note: most fields must be equal on every rank, but an all-to-all's row counts legitimately
differ (uneven splits), so comparing them for equality was rejected, and leaving them out let a
split or size mismatch through to the backend, where Gloo aborts the ranks that receive too much
and the others wait out their timeout. Since every rank reads every rank's fingerprint anyway, the
splits are checked for consistency instead: rank r's input split to q must equal rank q's output
split from r (in rows); the rows' shape is an ordinary equal field. The wait is the call's own
bound (:func:`collectives._wait.bound_s`: the ``call_timeout`` block, else ``init(timeout=...)``,
else the group's timeout); a fixed minute made a hang take a minute whatever the timeout, and
outlived short group timeouts.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ._wait import bound_s, store_gather
from .errors import CollectiveMismatch
from .recorder import _store

if TYPE_CHECKING:
    from .dispatch import Call

__all__ = ["check_call", "FIELDS"]

FIELDS = ("op", "algorithm", "in_shape", "out_shape", "dtype", "reduce_op", "root")
_PAIRS_SHOWN = 8  # disagreeing pairs spelled out in the error; the rest are counted


def _fingerprint(call: Call, algorithm: str) -> dict[str, object]:
    t_in, t_out = call.input, call.output
    a2a = call.op == "all_to_all"
    # An all-to-all's row counts may differ between ranks (uneven splits): only a row's shape must
    # agree, and the row counts are checked against the peers' (_split_pairs).
    keep = 1 if a2a else 0
    return {"op": call.op, "algorithm": algorithm,
            "in_shape": None if t_in is None else list(t_in.shape)[keep:],
            "out_shape": None if t_out is None else list(t_out.shape)[keep:],
            "dtype": None if t_out is None else str(t_out.dtype).removeprefix("torch."),
            "reduce_op": call.reduce_op, "root": call.root,
            "in_rows": list(call.in_rows) if a2a else None, "out_rows": list(call.out_rows) if a2a else None}


def check_call(call: Call, algorithm: str, timeout_s: float | None = None) -> None:
    """Compare this call with every rank's (collective through the store); raise on any difference.

    Args:
        call: the validated call, with its sequence number.
        algorithm: the algorithm that will run it.
        timeout_s: the wait's bound; ``None`` is the call's own (:func:`collectives._wait.bound_s`).
    Raises:
        CollectiveMismatch: the ranks' calls differ (the same text on every rank).
        CollectiveTimeout: a rank did not reach the call within the bound; names it.
    """
    comm = call.comm
    store = _store()
    if store is None or comm.size == 1:
        return
    bound = bound_s(comm) if timeout_s is None else timeout_s
    prefix = f"commops/debug/{comm._group_name}"
    raw = store_gather(store, f"{prefix}/{call.seq}", comm.rank, json.dumps(_fingerprint(call, algorithm)),
                       comm.global_ranks, bound, call.op, f"debug check of call #{call.seq}")
    every = [json.loads(v) for v in raw]
    if call.seq > 2:
        try:
            store.delete_key(f"{prefix}/{call.seq - 2}/{comm.rank}")
        except Exception:  # noqa: BLE001 - stores without delete keep the key; harmless
            pass
    for field in FIELDS:
        values = [json.dumps(e[field]) for e in every]
        if len(set(values)) > 1:
            sides: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                sides.setdefault(v, []).append(comm.global_ranks[r])
            raise CollectiveMismatch(call.op, call.seq, field, sides)
    if call.op == "all_to_all":
        _check_splits(call, every)


def _check_splits(call: Call, every: list[dict[str, object]]) -> None:
    """Rank r's input split to q must be rank q's output split from r, for every pair."""
    g = call.comm.global_ranks
    ins = [list(e["in_rows"]) for e in every]  # type: ignore[call-overload]
    outs = [list(e["out_rows"]) for e in every]  # type: ignore[call-overload]
    bad = [(r, q) for r in range(len(every)) for q in range(len(every)) if ins[r][q] != outs[q][r]]
    if not bad:
        return
    pairs = [f"rank {g[r]} sends {ins[r][q]} row(s) to rank {g[q]}, which expects {outs[q][r]} from it"
             for r, q in bad[:_PAIRS_SHOWN]]
    if len(bad) > _PAIRS_SHOWN:
        pairs.append(f"and {len(bad) - _PAIRS_SHOWN} more pair(s)")
    sides: dict[str, list[int]] = {}
    for r in sorted({r for pair in bad for r in pair}):
        sides.setdefault(f"input_split_sizes={ins[r]}, output_split_sizes={outs[r]}", []).append(g[r])
    raise CollectiveMismatch(call.op, call.seq, "splits", sides, detail="; ".join(pairs),
                             fix="make input_split_sizes[q] of rank r equal output_split_sizes[r] of rank q for "
                                 "every pair (without split sizes: give every rank the same dim 0)")
