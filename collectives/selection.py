"""How ``algorithm="auto"`` picks an algorithm.

In order, each a named predicate with its reason:

1. ``single_rank``: one rank runs the backend's collective (a local copy).
2. ``tuned_table``: a tuned table (``COMMOPS_TUNED``, written by the benchmark's ``--tune``) for
   this op, dtype, world and node count names the algorithm measured fastest at this size.
3. ``peer_memory``: NCCL groups whose ranks share one node with peer access (``collectives/peer``):
   ``one_shot``/``two_shot``/``copy_engine`` up to the sizes where they measured faster than NCCL
   (for the copy engines, depending on the peer buffers' size); where peer memory cannot run, the
   choice that follows says why.
4. ``cost_model``: with a calibration for this machine (``COMMOPS_CALIBRATION``, or a shipped file
   in ``topology/calibrations/`` matching the backend, device and node count), the algorithm with
   the least predicted time on this group's topology. Candidates are every registered algorithm
   that can run the call and describes its cost (``Algorithm.cost``), priced by
   ``topology.cost.price``; the choice lists every candidate's predicted time (``Choice.predicted``).
5. Without either, the measured rules of the core issue: ``vendor_tuned`` (NCCL/HCCL: native),
   ``cpu_small_all_reduce`` (Gloo/MPI <= 512 KB: recursive doubling), else ``default`` (native).

Choices are cached per (op, dtype, size) on the communicator: the model costs about a
millisecond per size, once. Every choice is a :class:`Choice` with the rule that fired and a
sentence a user can read (``Communicator.last_choice``). :func:`predict` and
:func:`predict_many` price a registered algorithm by name (tests, ``bench/model_check.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from topology.calibrate import device_label
from topology.cost import Machine, price

from . import _env
from .algos import REGISTRY, for_op
from .algos.two_shot import two_shot_piece
from .errors import UnsupportedError
from .peer.memory import DTYPES as PEER_DTYPES, peer_unavailable

if TYPE_CHECKING:
    from .communicator import Communicator
    from .dispatch import Call

__all__ = ["Choice", "choose", "calibration_for", "predict", "predict_many", "SHIPPED"]

SHIPPED = Path(__file__).resolve().parent.parent / "topology" / "calibrations"


@dataclass(frozen=True, slots=True)
class Choice:
    """The algorithm that ran a call and why.

    Attributes:
        algorithm: the registered name that ran.
        rule: the rule that fired (see the module's list).
        reason: a sentence a user can read.
        predicted: rule ``cost_model``: every candidate's name and predicted seconds, fastest first.
    """

    algorithm: str
    rule: str
    reason: str
    predicted: tuple[tuple[str, float], ...] = ()


def _is_single_rank(world: int) -> bool:
    return world == 1


def _backend_is_vendor_tuned(backend: str) -> bool:
    # NCCL and HCCL pick among their own tuned kernels per size and topology; our point-to-point
    # schedules pay one launch and one synchronisation per step on top of the same links.
    return backend in ("nccl", "hccl")


# Measured 2026-11-30 on a 2-core VM, Gloo, 3 and 4 ranks, float32 (launch/bench_allreduce.py):
# recursive doubling took 0.12-0.5x native Gloo's time from 1 KB to 512 KB and tied at 1 MB.
SMALL_ALL_REDUCE_BYTES = 512 << 10


def _is_cpu_small_all_reduce(op: str, backend: str, nbytes: int) -> bool:
    # Gloo's and MPI's all-reduce pay several latencies per call on few cores; log2(p) exchanges win
    # until the message is large enough for bandwidth to dominate.
    return op == "all_reduce" and backend in ("gloo", "mpi") and nbytes <= SMALL_ALL_REDUCE_BYTES


_SINGLE = Choice("native", "single_rank", "one rank: the backend's collective is a local copy")

# Measured 2026-11-30 on 2xH200 (NV18), bf16, eager and CUDA graphs (launch/tune_peer.py,
# launch/bench_collectives.py): one_shot all-reduce is the fastest up to 8 MB, two_shot beats
# NCCL up to 32 MB and ties it above; one_shot all-gather beats NCCL up to 512 MB with the default
# peer buffers. Other node sizes use the same limits until they are measured.
ONE_SHOT_MAX_BYTES = 8 << 20
PEER_ALL_REDUCE_MAX_BYTES = 32 << 20
PEER_ALL_GATHER_MAX_BYTES = 512 << 20
_PEER_OPS = ("all_reduce", "reduce_scatter", "all_gather")
# Measured 2026-11-30 on 2xH200 with 1 GiB peer buffers (bench/results/gpu_2xh200_peer_big.json):
# two_shot run in one piece reaches 1.13-1.22x NCCL's bus bandwidth at 64-256 MB (1.02-1.05x
# above); cut into pieces by the default 64 MiB buffers it ties NCCL (a run with the default
# buffers, in the history of bench/results/gpu_2xh200_peer.json).
PEER_ALL_REDUCE_ONE_PIECE_MAX_BYTES = 256 << 20
# With 1 GiB buffers (256 MB pieces) it stays ahead at 512 MB (1.05-1.06x in two runs) but ties
# NCCL at 1 GB (1.01-1.02x, then 0.99x).
PEER_ALL_REDUCE_BIG_MAX_BYTES = 512 << 20
# Measured 2026-11-30 on 2xH200 with 1 GiB peer buffers (bench/results/gpu_2xh200_peer_ce_ar.json,
# eager and graph): at two ranks the copy-engine all-reduce (one shot: each tensor crosses once,
# summed where it lands) beats two_shot and NCCL above 256 MB (512 MB: 345 GB/s against 330-331
# and 312-313; 1 GB: 358 against 333-334 and 326-332); at 256 MB two_shot in one piece stays
# ahead (327-330 against 294-298).
PEER_ALL_REDUCE_CE_WORLD = 2
# Measured 2026-11-30 on 2xH200, bf16, 8 MB-1 GB, eager and CUDA graphs
# (bench/results/gpu_2xh200_peer_ce_{default,1g}.json): the copy-engine reduce-scatter beats
# one_shot above 64 MB and NCCL by 1.03-1.19x up to 1 GB with the default 64 MiB buffers (its
# ring has 2 slots), 1.19-1.31x with 1 GiB; the copy-engine all-gather beats one_shot above
# 128 MB only with 1 GiB buffers (1.21-1.27x NCCL; with 64 MiB it falls below NCCL at 1 GB).
PEER_REDUCE_SCATTER_ONE_SHOT_MAX_BYTES = 64 << 20
PEER_REDUCE_SCATTER_CE_MAX_BYTES = 1 << 30  # with smaller buffers than PEER_BIG_BUFFER_BYTES
PEER_ALL_GATHER_ONE_SHOT_BIG_MAX_BYTES = 128 << 20  # one_shot's limit when the copy engines take over
PEER_BIG_BUFFER_BYTES = 1 << 30  # peer buffers from which the rules above for 1 GiB apply


def _peer_slot_bytes(comm: Any) -> int:
    """The communicator's peer buffer size: built, or as ``COMMOPS_PEER_BYTES`` will build it."""
    pm = getattr(comm, "_peer_memory", None)
    return pm.slot_bytes if pm is not None and not pm.closed else _env.PEER_BYTES.get()


def _two_shot_in_one_piece(comm: Any, nbytes: int, element_size: int) -> bool:
    """Whether the communicator's peer buffers hold a two-shot all-reduce of ``nbytes`` in one
    piece (``collectives/algos/two_shot.py``'s plan)."""
    return nbytes <= two_shot_piece(_peer_slot_bytes(comm) // 2, comm.size, element_size) * element_size


def _copy_engine_all_reduce(comm: Any, nbytes: int) -> bool:
    # one shot moves as much over the link as two shot at two ranks only (w - 1 copies of the tensor)
    return (comm.size == PEER_ALL_REDUCE_CE_WORLD
            # two_shot in one piece measured faster up to here
            and nbytes > PEER_ALL_REDUCE_ONE_PIECE_MAX_BYTES
            # 128 MiB chunks in a ring of 4 slots: measured with 1 GiB buffers only
            and _peer_slot_bytes(comm) >= PEER_BIG_BUFFER_BYTES)


def _peer_memory(call: Call, backend: str, nbytes: int) -> tuple[Choice | None, str]:
    """The peer-memory algorithm for this call, or None and why not ("" when it does not apply)."""
    if backend != "nccl" or call.op not in _PEER_OPS:
        return None, ""
    if call.output.dtype not in PEER_DTYPES or call.reduce_op not in (None, "sum", "avg"):
        return None, ""
    reason = peer_unavailable(call.comm)
    if reason:
        return None, f"peer memory cannot run: {reason}"
    if call.op == "all_reduce":
        if nbytes <= ONE_SHOT_MAX_BYTES:
            return Choice("one_shot", "peer_memory", f"{nbytes} B <= {ONE_SHOT_MAX_BYTES} B on one node: "
                          "one push and one reduction beat NCCL's launch and protocol"), ""
        if nbytes <= PEER_ALL_REDUCE_MAX_BYTES:
            return Choice("two_shot", "peer_memory", f"{nbytes} B <= {PEER_ALL_REDUCE_MAX_BYTES} B on one node: "
                          "peer-memory reduce-scatter + all-gather measured faster than NCCL"), ""
        if nbytes <= PEER_ALL_REDUCE_ONE_PIECE_MAX_BYTES and \
                _two_shot_in_one_piece(call.comm, nbytes, call.output.element_size()):
            return Choice("two_shot", "peer_memory", f"{nbytes} B <= {PEER_ALL_REDUCE_ONE_PIECE_MAX_BYTES} B in one "
                          "piece of the peer buffers: two_shot measured 1.13-1.22x NCCL's bus bandwidth"), ""
        if _copy_engine_all_reduce(call.comm, nbytes):
            return Choice("copy_engine", "peer_memory", f"{nbytes} B > {PEER_ALL_REDUCE_ONE_PIECE_MAX_BYTES} B at "
                          f"{PEER_ALL_REDUCE_CE_WORLD} ranks with peer buffers of at least {PEER_BIG_BUFFER_BYTES} B: "
                          "the copy engines' one-shot all-reduce measured faster than two_shot and NCCL"), ""
        if nbytes <= PEER_ALL_REDUCE_BIG_MAX_BYTES and _peer_slot_bytes(call.comm) >= PEER_BIG_BUFFER_BYTES:
            return Choice("two_shot", "peer_memory", f"{nbytes} B <= {PEER_ALL_REDUCE_BIG_MAX_BYTES} B with peer "
                          f"buffers of at least {PEER_BIG_BUFFER_BYTES} B: two_shot in pieces measured 1.05-1.06x "
                          "NCCL's bus bandwidth"), ""
        return None, (f"{nbytes} B > {PEER_ALL_REDUCE_MAX_BYTES} B and not one piece of at most "
                      f"{PEER_ALL_REDUCE_ONE_PIECE_MAX_BYTES} B of the peer buffers (COMMOPS_PEER_BYTES): "
                      "NCCL measured faster than peer memory")
    big = _peer_slot_bytes(call.comm) >= PEER_BIG_BUFFER_BYTES
    if call.op == "reduce_scatter":
        limit = PEER_REDUCE_SCATTER_ONE_SHOT_MAX_BYTES
        ce_limit = None if big else PEER_REDUCE_SCATTER_CE_MAX_BYTES
    else:
        limit = PEER_ALL_GATHER_ONE_SHOT_BIG_MAX_BYTES if big else PEER_ALL_GATHER_MAX_BYTES
        ce_limit = None if big else 0
    if nbytes <= limit:
        return Choice("one_shot", "peer_memory", f"{nbytes} B <= {limit} B on one node: "
                      "pushing each peer its part beats NCCL"), ""
    if ce_limit is None or nbytes <= ce_limit:
        return Choice("copy_engine", "peer_memory", f"{nbytes} B > {limit} B on one node"
                      f"{' with peer buffers of at least %d B' % PEER_BIG_BUFFER_BYTES if big else ''}: copy-engine "
                      "pushes (and copies) measured faster than one_shot and NCCL"), ""
    return None, (f"{nbytes} B > {max(limit, ce_limit)} B with peer buffers under {PEER_BIG_BUFFER_BYTES} B "
                  "(COMMOPS_PEER_BYTES): NCCL measured faster than peer memory")


def _matches(meta: dict[str, Any], backend: str, device: str, nodes: int) -> bool:
    return (meta.get("match", True) and meta.get("backend") == backend and meta.get("device") == device
            and meta.get("nodes") == nodes)


def calibration_for(comm: Communicator, backend: str, device: Any) -> Machine | None:
    """The :class:`topology.cost.Machine` ``auto`` prices with on ``comm``, or None (cached)."""
    cache = comm._choices
    if "calibration" in cache:  # Communicator.set_calibration
        return cache["calibration"]
    key = ("calibration", backend, getattr(device, "type", None))
    if key in cache:
        return cache[key]
    found = None
    path = _env.CALIBRATION.get()
    if path:
        found = Machine.load(path)
    else:
        nodes = len(comm.topology.nodes())
        for f in sorted(SHIPPED.glob("*.json")):
            m = Machine.load(f)
            if _matches(m.meta, backend, device_label(device), nodes):
                found = m
                break
    cache[key] = found
    return found


def _tuned(comm: Communicator, op: str, dtype: str, nbytes: int) -> Choice | None:
    data = comm._choices.get("tuned_table")  # Communicator.set_tuned
    path = "the tuned table given to set_tuned"
    if data is None:
        path = _env.TUNED.get()
        if not path:
            return None
        data = comm._choices.get(("tuned", path))
        if data is None:
            data = comm._choices[("tuned", path)] = json.loads(Path(path).read_text())
    meta = data.get("meta", {})
    nodes = len(comm.topology.nodes())
    if meta.get("world", comm.size) != comm.size or meta.get("nodes", nodes) != nodes:
        return None  # measured on another shape of cluster
    table = data.get("entries", [])
    rows = sorted((e for e in table if e["op"] == op and e["dtype"] == dtype), key=lambda e: e["max_bytes"])
    if not rows:
        return None
    row = next((e for e in rows if nbytes <= e["max_bytes"]), rows[-1])
    return Choice(row["algorithm"], "tuned_table",
                  f"{path}: measured fastest for {op} {dtype} up to {row['max_bytes']} B ({row.get('note', '')})".rstrip(" ()"))


def _modelled(call: Call, backend: str, machine: Machine) -> Choice:
    comm, op = call.comm, call.op
    dtype = call.output.dtype if call.output is not None else None
    nodes = comm.topology.nodes()
    times = {}
    for name, algo in REGISTRY.items():
        if not algo.supports(op, dtype, backend):
            continue
        if algo.equal_splits_only and op == "all_to_all" and (len(set(call.in_rows)) > 1 or len(set(call.out_rows)) > 1):
            continue
        plan = algo.cost(op, nodes, machine)
        if plan is None:  # the model has no price for it here
            continue
        if algo.topology_aware:  # after cost(): check() may create sub-groups (collective)
            try:
                algo.check(call)
            except UnsupportedError:
                continue
        times[name] = float(price(plan, op, nodes, machine, [call.nbytes], anchor=name)[0])
    best = min(times, key=times.__getitem__)
    ranked = tuple(sorted(times.items(), key=lambda kv: kv[1]))
    listed = ", ".join(f"{a} {t * 1e6:.0f} us" for a, t in ranked)
    return Choice(best, "cost_model", f"least predicted time on {machine.name} ({len(nodes)} node(s)): {listed}",
                  ranked)


def predict_many(algorithm: str, op: str, nodes: list[list[int]], machine: Machine,
                 sizes: Iterable[float]) -> np.ndarray:
    """Predicted seconds of the registered ``algorithm`` for ``op`` at each nccl-tests size in ``sizes``.

    Raises:
        KeyError: no algorithm of that name is registered, or it has no price for ``op`` on ``nodes``.
    """
    algo = REGISTRY.get(algorithm)
    if algo is None:
        raise KeyError(f"no algorithm named {algorithm!r} is registered")
    return price(algo, op, nodes, machine, sizes)


def predict(algorithm: str, op: str, nodes: list[list[int]], machine: Machine, nbytes: float) -> float:
    """Predicted seconds of the registered ``algorithm`` for one ``op`` of ``nbytes`` (see :func:`predict_many`)."""
    return float(predict_many(algorithm, op, nodes, machine, [nbytes])[0])


def choose(call: Call, backend: str) -> Choice:
    op, comm = call.op, call.comm
    if _is_single_rank(comm.size):
        return _movable(_SINGLE, op, call.output.dtype if call.output is not None else None, backend)
    nbytes = call.nbytes
    even = op != "all_to_all" or (len(set(call.in_rows)) <= 1 and len(set(call.out_rows)) <= 1)
    key = (op, call.output.dtype if call.output is not None else None, nbytes, backend, even, call.reduce_op)
    hit = comm._choices.get(key)
    if hit is not None:
        return hit
    dtype = str(call.output.dtype).removeprefix("torch.") if call.output is not None else ""
    choice = _tuned(comm, op, dtype, nbytes) if op != "barrier" else None
    why_not_peer = ""
    if choice is None:
        choice, why_not_peer = _peer_memory(call, backend, nbytes)
    if choice is None and op != "barrier":
        machine = calibration_for(comm, backend, call.output.device if call.output is not None else None)
        if machine is not None:
            choice = _modelled(call, backend, machine)
    if choice is None:
        choice = _rules(op, backend, nbytes)
    if why_not_peer:
        choice = Choice(choice.algorithm, choice.rule, f"{choice.reason}; {why_not_peer}")
    choice = _movable(choice, op, call.output.dtype if call.output is not None else None, backend)
    comm._choices[key] = choice
    return choice


def _movable(choice: Choice, op: str, dtype: Any, backend: str) -> Choice:
    """``choice``, or where its algorithm cannot move ``dtype`` on ``backend`` (Gloo's collectives
    lack int16, say), the first registered algorithm that can (validation has made sure one does)."""
    if dtype is None or REGISTRY[choice.algorithm].supports(op, dtype, backend):
        return choice
    usable = for_op(op, dtype, backend)
    if not usable:
        return choice
    return Choice(usable[0], "dtype", f"{choice.algorithm} ({choice.rule}) cannot move {dtype} on {backend}; "
                  f"{usable[0]} can")


def _rules(op: str, backend: str, nbytes: int) -> Choice:
    if _backend_is_vendor_tuned(backend):
        return Choice("native", "vendor_tuned", f"{backend} tunes its own algorithms per size and topology")
    if _is_cpu_small_all_reduce(op, backend, nbytes):
        return Choice("recursive_doubling", "cpu_small_all_reduce",
                      f"{nbytes} B <= {SMALL_ALL_REDUCE_BYTES} B on {backend}: log2(p) exchanges beat {backend}'s all-reduce")
    return Choice("native", "default", f"no algorithm of ours measured faster than {backend}'s {op} here")
