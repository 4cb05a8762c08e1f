"""Debug check mode: the ranks compare every call's fingerprint before anything is sent.

Each rank writes its call's fingerprint (op, algorithm, shapes, dtype, reduce op, root; the key
carries the group and the call's sequence number) into the group's store, then reads everyone's.
Disagreement raises :class:`~collectives.errors.CollectiveMismatch` on every rank with the same
text; a rank that does not write within the timeout is named in a
:class:`~collectives.errors.CollectiveTimeout`. A rank removes its key of two calls back, so the
store does not grow. Costs one store write and ``world`` reads per call (measured in the README).
Turned on by ``collectives.init(debug=True)``, ``COMMOPS_DEBUG=1`` or ``comm.debug = True``.
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING

from .errors import CollectiveMismatch, CollectiveTimeout
from .recorder import _store

if TYPE_CHECKING:
    from .dispatch import Call

__all__ = ["check_call", "FIELDS"]

FIELDS = ("op", "algorithm", "in_shape", "out_shape", "dtype", "reduce_op", "root")
TIMEOUT_S = 60.0


def _fingerprint(call: Call, algorithm: str) -> dict[str, object]:
    t_in, t_out = call.input, call.output
    # An all-to-all's row counts may differ between ranks (uneven splits): only a row's shape must agree.
    keep = 1 if call.op == "all_to_all" else 0
    return {"op": call.op, "algorithm": algorithm,
            "in_shape": None if t_in is None else list(t_in.shape)[keep:],
            "out_shape": None if t_out is None else list(t_out.shape)[keep:],
            "dtype": None if t_out is None else str(t_out.dtype).removeprefix("torch."),
            "reduce_op": call.reduce_op, "root": call.root}


def check_call(call: Call, algorithm: str, timeout_s: float = TIMEOUT_S) -> None:
    """Compare this call with every rank's (collective through the store); raise on any difference."""
    comm = call.comm
    store = _store()
    if store is None or comm.size == 1:
        return
    prefix = f"commops/debug/{comm._group_name}"
    mine = _fingerprint(call, algorithm)
    store.set(f"{prefix}/{call.seq}/{comm.rank}", json.dumps(mine))
    keys = [f"{prefix}/{call.seq}/{r}" for r in range(comm.size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - the store's timeout: say who is missing
        missing = [comm.global_ranks[r] for r, k in enumerate(keys) if not store.check([k])]
        raise CollectiveTimeout(call.op, missing, f"debug check of call #{call.seq}: rank(s) {missing} did not "
                                f"reach it within {timeout_s:g} s") from exc
    every = [json.loads(store.get(k).decode()) for k in keys]
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
