"""The alpha-beta-gamma cost model: predicted time of every algorithm for every op, size and topology.

Each tier is a link with a per-message latency ``a`` (alpha, seconds) and a per-byte time ``b``
(beta, seconds per byte); ``g`` (gamma) is the time to reduce one byte locally (Hockney 1994;
Thakur, Rabenseifner & Gropp 2005). An algorithm is described as *rounds*: in a round every rank
sends at most one message per destination, all at once. A round costs::

    max( a_intra + b_intra * (largest bytes a rank sends inside its node),
         a_inter + b_inter * (largest bytes a node sends or receives across nodes)
                           / min(flows of that node, NICs per node) )
    + g * (bytes a rank reduces)

so ranks of one node that cross to other nodes at the same time share the node's NICs: that is
what makes a flat ring across nodes slower than a hierarchy on nodes with one uplink, and what a
rail-optimised cluster (one NIC per GPU) does not suffer. Rounds are built from the algorithm's
pattern on the real rank-to-node map, so they hold for any placement.

Closed forms (``p`` ranks, ``n`` bytes, one tier; Thakur et al. 2005, secs. 4.1-4.3; Chan et
al. 2007), which the rounds reproduce on one node::

    ring             all-reduce 2(p-1)a + 2(p-1)/p n b + (p-1)/p n g;  RS, AG: (p-1)a + (p-1)/p n b (+ g)
    recursive_doubling  all-reduce log2(p)(a + n b + n g);   AG: log2(p) a + (p-1)/p n b
    halving_doubling all-reduce 2 log2(p) a + 2(p-1)/p n b + (p-1)/p n g
    binomial_tree    broadcast, reduce ceil(log2 p)(a + n b)
    pairwise         all-to-all (p-1)(a + n/p b);   bruck: ceil(log2 p)(a + n/2 b)
    direct           all-to-all (every message at once, Gloo's): a + (p-1)/p n b
    hierarchical     all-reduce T_RS(g; intra) + T_AR(n_nodes, n/g; inter) + T_AG(g; intra)
    grid2d           all-reduce sum over 3 phases of max(rows-first half, columns-first half)
    native           the backend's own algorithm (``Machine.native``), optionally with its own links

Non-power-of-two ``p`` adds the fold's two rounds of ``n`` bytes (``collectives/algos/_fold.py``).
The model is evaluated vectorised over message sizes, so the simulator can sweep thousands of ranks.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LinkCost", "Machine", "Round", "predict", "predict_many", "algorithms_for", "rounds"]


@dataclass(frozen=True)
class LinkCost:
    """One tier's link: ``alpha`` seconds per message, ``beta`` seconds per byte."""

    alpha: float
    beta: float

    @property
    def bandwidth_GBps(self) -> float:
        return 1e-9 / self.beta if self.beta > 0 else math.inf


# What torch's Gloo backend runs (gloo/allreduce.cc: ring unless told otherwise; allgather: ring;
# alltoall(v): every send and receive posted at once; broadcast/reduce: from/to the root;
# ProcessGroupGloo's reduce_scatter_tensor clones the input and runs a whole all-reduce).
GLOO_NATIVE = {"all_reduce": "ring", "reduce_scatter": "ring_all_reduce", "all_gather": "ring",
               "all_to_all": "direct", "broadcast": "binomial_tree", "reduce": "binomial_tree"}
NCCL_NATIVE = {"all_reduce": "ring", "reduce_scatter": "ring", "all_gather": "ring", "all_to_all": "direct",
               "broadcast": "ring", "reduce": "ring"}


@dataclass(frozen=True)
class Machine:
    """Calibrated link costs of one kind of cluster.

    Attributes:
        name: a label (also the calibration file's key).
        intra: link between two ranks of one node, one way, as our point-to-point schedules see it.
        inter: link between nodes, per NIC, one way (None for single-node machines).
        nics_per_node: how many concurrent inter-node flows of one node run at full speed.
        gamma: seconds to reduce one byte.
        native: op -> the pattern the backend's own collective runs (e.g. Gloo's ring all-reduce).
        native_intra / native_inter: the backend's own collectives' links where they differ from our
            point-to-point steps (NCCL's fused kernels pay one launch, not one per step).
        intra_exchange / inter_exchange: the same links when both ranks of a pair send to each
            other at once over one connection (recursive doubling, 2-rank rings, all-to-all);
            two-way TCP gets less than twice the one-way rate. None: as one way.
        uplink / uplink_exchange: a whole node's inter-node capacity (beta per byte the node
            sends), measured with every local rank sending at once; None: ``inter`` over
            ``nics_per_node``. Several connections can fill a link that one cannot.
        step: host seconds our point-to-point executor adds to every round (Python, staging,
            launching the reduction): fitted from our ring all-reduce at small sizes.
        native_all_to_all: the backend's all-to-all measured on the calibrated topology
            (``meta["ranks_per_node"]``), as seconds = alpha + beta * bytes; used for that topology.
        anchors: op -> algorithm -> seconds measured for one call of ``anchor_bytes`` on the
            calibrated topology: the algorithm's whole fixed cost (every message's latency, host
            scheduling, the executor), which the tier links cannot see when it is set by CPUs
            rather than wires. Used for that topology (see ``predict_many``).
        anchor_bytes: the size the anchors were measured at.
        meta: where and how it was measured.
    """

    name: str
    intra: LinkCost
    inter: LinkCost | None = None
    nics_per_node: int = 1
    gamma: float = 0.0
    native: dict[str, str] = field(default_factory=lambda: dict(GLOO_NATIVE))
    native_intra: LinkCost | None = None
    native_inter: LinkCost | None = None
    intra_exchange: LinkCost | None = None
    inter_exchange: LinkCost | None = None
    uplink: LinkCost | None = None
    uplink_exchange: LinkCost | None = None
    step: float = 0.0
    native_all_to_all: LinkCost | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    anchors: dict[str, dict[str, float]] = field(default_factory=dict)
    anchor_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Machine:
        def link(x: Any) -> LinkCost | None:
            return LinkCost(**x) if x else None

        return cls(d["name"], LinkCost(**d["intra"]), link(d.get("inter")), d.get("nics_per_node", 1),
                   d.get("gamma", 0.0), dict(d.get("native") or GLOO_NATIVE), link(d.get("native_intra")),
                   link(d.get("native_inter")), link(d.get("intra_exchange")), link(d.get("inter_exchange")),
                   link(d.get("uplink")), link(d.get("uplink_exchange")), d.get("step", 0.0),
                   link(d.get("native_all_to_all")), dict(d.get("meta") or {}),
                   {op: dict(t) for op, t in (d.get("anchors") or {}).items()}, d.get("anchor_bytes", 0))

    def dump(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Machine:
        """A machine file, or a calibration file (``{"machine": ..., "points": ...}``)."""
        data = json.loads(Path(path).read_text())
        return cls.from_dict(data.get("machine", data))

    def bandwidth_only(self) -> Machine:
        """This machine with every per-message latency and the executor step set to zero."""
        def zero(lc: LinkCost | None) -> LinkCost | None:
            return None if lc is None else LinkCost(0.0, lc.beta)

        return dataclasses.replace(
            self, intra=LinkCost(0.0, self.intra.beta), inter=zero(self.inter), native_intra=zero(self.native_intra),
            native_inter=zero(self.native_inter), intra_exchange=zero(self.intra_exchange),
            inter_exchange=zero(self.inter_exchange), uplink=zero(self.uplink),
            uplink_exchange=zero(self.uplink_exchange), step=0.0, native_all_to_all=zero(self.native_all_to_all),
            anchors={}, anchor_bytes=0)

    def for_native(self) -> Machine:
        if self.native_intra is None and self.native_inter is None:
            return self
        # Links fitted from the backend's whole all-reduce already include its reduction: no gamma.
        return Machine(self.name, self.native_intra or self.intra, self.native_inter or self.inter,
                       self.nics_per_node, 0.0, self.native,
                       intra_exchange=None if self.native_intra else self.intra_exchange,
                       inter_exchange=None if self.native_inter else self.inter_exchange,
                       uplink=None if self.native_inter else self.uplink,
                       uplink_exchange=None if self.native_inter else self.uplink_exchange)


@dataclass(frozen=True)
class Round:
    """One round: rank ``r`` sends ``frac * n`` bytes to each ``dst[r, k] >= 0``; ``reduce``: it reduces them.

    ``dst`` is ``[ranks, k]``; ``count`` repeats the round; ``tier`` "intra"/"inter" only labels it.
    """

    dst: np.ndarray
    frac: float
    reduce: bool
    count: int = 1


# -- flat patterns on q ranks (local indices); n = nccl-tests size in bytes ------------------------
def _fold_rounds(q: int) -> tuple[list[Round], list[Round], int, list[int]]:
    """Rounds before and after a power-of-two core, p2, and the real rank of each virtual rank."""
    p2 = 1 << (q.bit_length() - 1)
    rem = q - p2
    real = [2 * v + 1 if v < rem else v + rem for v in range(p2)]
    if rem == 0:
        return [], [], p2, real
    pre = np.full(q, -1)
    post = np.full(q, -1)
    for r in range(0, 2 * rem, 2):
        pre[r] = r + 1
        post[r + 1] = r
    return [Round(pre.reshape(-1, 1), 1.0, True)], [Round(post.reshape(-1, 1), 1.0, False)], p2, real


def _xor_round(q: int, real: list[int], dist_: int, frac: float, reduce: bool) -> Round:
    dst = np.full(q, -1)
    for v, r in enumerate(real):
        dst[r] = real[v ^ dist_]
    return Round(dst.reshape(-1, 1), frac, reduce)


@lru_cache(maxsize=4096)
def flat_rounds(pattern: str, op: str, q: int) -> tuple[Round, ...]:
    """Rounds of a single-tier algorithm on ``q`` ranks (fractions of the op's nccl-tests size)."""
    if q <= 1:
        return ()
    idx = np.arange(q, dtype=np.int64)
    ring = ((idx + 1) % q).reshape(-1, 1)
    if pattern == "ring":
        if op == "all_reduce":
            return (Round(ring, 1 / q, True, q - 1), Round(ring, 1 / q, False, q - 1))
        if op in ("reduce_scatter", "all_gather"):
            return (Round(ring, 1 / q, op == "reduce_scatter", q - 1),)
        if op in ("broadcast", "reduce"):  # pipelined chain: about the message once per hop, chunks overlap
            return (Round(ring, 1.0, op == "reduce", 1), Round(ring, 0.0, False, q - 2))
    if pattern == "ring_all_reduce" and op == "reduce_scatter":  # a reduce-scatter done as an all-reduce
        return flat_rounds("ring", "all_reduce", q)
    if pattern == "recursive_doubling":
        pre, post, p2, real = _fold_rounds(q)
        k = p2.bit_length() - 1
        if op == "all_reduce":
            return (*pre, *(_xor_round(q, real, 1 << i, 1.0, True) for i in range(k)), *post)
        if op == "all_gather":
            return (*pre, *(_xor_round(q, real, 1 << i, (1 << i) / p2, False) for i in range(k)), *post)
    if pattern == "halving_doubling":
        pre, post, p2, real = _fold_rounds(q)
        k = p2.bit_length() - 1
        rs = tuple(_xor_round(q, real, p2 >> (i + 1), 1 / (2 << i), True) for i in range(k))
        if op == "reduce_scatter":
            return (*pre, *rs, *post)
        if op == "all_reduce":
            ag = tuple(_xor_round(q, real, 1 << i, (1 << i) / p2, False) for i in range(k))
            return (*pre, *rs, *ag, *post)
    if pattern == "binomial_tree" and op in ("broadcast", "reduce"):
        out = []
        steps = (q - 1).bit_length()
        masks = [1 << i for i in range(steps)]
        for mask in (masks if op == "broadcast" else masks[::-1]):
            dst = np.full(q, -1)
            for v in range(q):
                if op == "broadcast" and v < mask and v + mask < q:
                    dst[v] = v + mask
                if op == "reduce" and v & mask and not v & (mask - 1):
                    dst[v] = v - mask
            out.append(Round(dst.reshape(-1, 1), 1.0, op == "reduce"))
        return tuple(out)
    if pattern == "pairwise" and op == "all_to_all":
        return tuple(Round(((idx + s) % q).reshape(-1, 1), 1 / q, False) for s in range(1, q))
    if pattern == "bruck" and op == "all_to_all":
        out, d = [], 1
        while d < q:
            blocks = int(np.count_nonzero(idx & d))
            out.append(Round(((idx + d) % q).reshape(-1, 1), blocks / q, False))
            d <<= 1
        return tuple(out)
    if pattern == "direct" and op == "all_to_all":
        dst = (idx.reshape(-1, 1) + np.arange(1, q, dtype=np.int64).reshape(1, -1)) % q
        return (Round(dst, 1 / q, False),)
    raise KeyError(f"no cost pattern for {pattern} {op}")


# -- evaluation ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Coef:
    """A round, reduced to what its time depends on: time(n) = count * (max(intra, inter) + g*red*n)."""

    count: int
    intra: float   # largest bytes/n a rank sends inside a node (0: none)
    inter: float   # bytes/n of one inter-node flow (0: none)
    node: float    # largest bytes/n one node sends or receives across nodes, all its flows together
    red: float     # bytes/n reduced per rank
    exchange: bool = False  # pairs send to each other at once (one connection, both ways)


def _coef(rd: Round, node_of: np.ndarray) -> _Coef:
    p, k = rd.dst.shape
    src = np.repeat(np.arange(p), k)
    dst = rd.dst.ravel()
    ok = dst >= 0
    src, dst = src[ok], dst[ok]
    if src.size == 0:
        return _Coef(rd.count, 0.0, 0.0, 0.0, 0.0)
    cross = node_of[src] != node_of[dst]
    intra = 0.0
    if (~cross).any():
        intra = float(np.bincount(src[~cross], minlength=p).max()) * rd.frac
    inter = node = 0.0
    if cross.any():
        inter = rd.frac
        nodes = int(node_of.max()) + 1
        for side in (node_of[src[cross]], node_of[dst[cross]]):
            node = max(node, float(np.bincount(side, minlength=nodes).max()) * rd.frac)
    red = rd.frac * (float(np.bincount(dst, minlength=p).max()) if rd.reduce else 0.0)
    ids = src * p + dst
    exchange = bool(np.isin(dst * p + src, ids).sum() * 2 >= ids.size)
    return _Coef(rd.count, intra, inter, node, red, exchange)


def _time(coefs: list[_Coef], m: Machine, sizes: np.ndarray, step: float = 0.0) -> np.ndarray:
    up_one = m.uplink.beta if m.uplink else None
    up_two = m.uplink_exchange.beta if m.uplink_exchange else up_one
    t = np.zeros_like(sizes, dtype=float)
    for c in coefs:
        parts = []
        if c.intra:
            link = (m.intra_exchange if c.exchange else None) or m.intra
            parts.append(link.alpha + link.beta * c.intra * sizes)
        if c.inter:
            link = (m.inter_exchange if c.exchange else None) or m.inter or m.intra
            node_beta = (up_two if c.exchange else up_one) or link.beta / m.nics_per_node
            parts.append(link.alpha + np.maximum(link.beta * c.inter, node_beta * c.node) * sizes)
        if not parts:  # a round in which nobody sends (a folded rank's idle step)
            continue
        t += c.count * (np.maximum.reduce(parts) + m.gamma * c.red * sizes + step)
    return t


def _place(rds: Iterable[Round], groups: list[tuple[int, ...]], p: int, scale: float) -> list[Round]:
    """Run the same flat rounds on every group at once, in global ranks; sizes scaled by ``scale``."""
    out = []
    for rd in rds:
        dst = np.full((p, rd.dst.shape[1]), -1, dtype=np.int64)
        for members in groups:
            arr = np.asarray(members)
            local = rd.dst[: len(members)]
            glob = np.where(local >= 0, arr[np.clip(local, 0, None)], -1)
            dst[arr] = glob
        out.append(Round(dst, rd.frac * scale, rd.reduce, rd.count))
    return out


# Our point-to-point schedules (priced on the plain links); everything else runs the backend's own
# collectives (priced on the backend's links).
_POINT_TO_POINT = ("ring", "recursive_doubling", "halving_doubling", "binomial_tree", "pairwise", "bruck", "direct")


def algorithms_for(op: str) -> list[str]:
    """Algorithm names the model prices for ``op`` (the registry's, see ``collectives.algos``)."""
    table = {
        "all_reduce": ["native", "ring", "recursive_doubling", "halving_doubling", "hierarchical", "grid2d"],
        "reduce_scatter": ["native", "ring", "halving_doubling", "hierarchical"],
        "all_gather": ["native", "ring", "recursive_doubling", "hierarchical"],
        "all_to_all": ["native", "pairwise", "bruck", "hierarchical"],
        "broadcast": ["native", "binomial_tree"],
        "reduce": ["native", "binomial_tree"],
    }
    return table.get(op, ["native"])


def rounds(algorithm: str, op: str, nodes: list[list[int]], machine: Machine) -> list[list[Round]]:
    """The phases of ``algorithm`` as rounds in global ranks; phases in one inner list run one after
    another, and the outer list's entries are run concurrently (grid2d's two halves) per phase."""
    p = sum(len(n) for n in nodes)
    world = [tuple(range(p))]
    if algorithm == "native" or algorithm in _POINT_TO_POINT:
        pattern = machine.native.get(op, "ring") if algorithm == "native" else algorithm
        return [_place(flat_rounds(pattern, op, p), world, p, 1.0)]
    if algorithm != "grid2d":
        return [[rd for rds, _ in _phases(algorithm, op, nodes, machine) for rd in rds]]
    from .model import Topology

    topo = Topology.from_nodes([list(n) for n in nodes])
    native = machine.native
    # grid2d: half A rows-first (hierarchical all-reduce of n/2), half B columns-first.
    from topology.groups import equal_nodes, rails_of

    from collectives.algos.hierarchical import single_tier

    g = equal_nodes(topo)
    if g is None or single_tier([list(n) for n in nodes], p):
        return [_place(flat_rounds(native.get(op, "ring"), op, p), world, p, 1.0)]
    rails = rails_of([list(n) for n in nodes])
    rows = [tuple(n) for n in nodes]
    nn = len(nodes)

    def three(first: list[tuple[int, ...]], second: list[tuple[int, ...]], a: int, b: int) -> list[list[Round]]:
        return [_place(flat_rounds(native["reduce_scatter"], "reduce_scatter", a), first, p, 0.5),
                _place(flat_rounds(native["all_reduce"], "all_reduce", b), second, p, 0.5 / a),
                _place(flat_rounds(native["all_gather"], "all_gather", a), first, p, 0.5)]

    half_a = three(rows, rails, g, nn)
    half_b = three(rails, rows, nn, g)
    return [[*ra] for ra in half_a] + [[*rb] for rb in half_b]  # 6 lists: phases 0-2 of A, then of B


def _phases(algorithm: str, op: str, nodes: list[list[int]], machine: Machine) -> list[tuple[list[Round], Machine]]:
    """A plan-based algorithm's rounds, one list per phase, each with the links it runs on: the
    backend's (``Machine.for_native``) for the backend's collectives, the plain ones for our
    point-to-point phases (those with a ``pattern``)."""
    from collectives.algos import REGISTRY

    from .model import Topology

    algo = REGISTRY.get(algorithm)
    if algo is None or not hasattr(algo, "plan"):
        raise KeyError(f"the cost model has no formula for {algorithm}")
    p = sum(len(n) for n in nodes)
    topo = Topology.from_nodes([list(n) for n in nodes])
    out = []
    for ph in algo.plan(op, topo, 1 << 20):
        pattern = ph.pattern or machine.native.get(ph.op, "ring")
        rds = _place(flat_rounds(pattern, ph.op, len(ph.groups[0])), list(ph.groups), p, ph.elements / float(1 << 20))
        out.append((rds, machine if ph.pattern else machine.for_native()))
    return out


def predict_many(algorithm: str, op: str, nodes: list[list[int]], machine: Machine, sizes: Iterable[float]) -> np.ndarray:
    """Predicted seconds of ``algorithm`` for ``op`` at each nccl-tests size in ``sizes`` (bytes).

    Where the machine holds an anchor for this op and algorithm on this topology, the time is
    anchored on it: ``T(n) = anchor + B(max(n, n0)) - B(n0)``, with ``n0`` the anchor's size and
    ``B`` the rounds below with every latency set to zero (bytes and reductions only). The
    measured small call carries the algorithm's whole fixed cost (NCCL's tuner keeps a base
    latency per algorithm for the same reason); the links carry how the time grows with size.
    """
    s = np.asarray(list(sizes), dtype=float)
    anchor = machine.anchors.get(op, {}).get(algorithm)
    if anchor is not None and machine.anchor_bytes > 0 \
            and [len(n) for n in nodes] == machine.meta.get("ranks_per_node"):
        n0 = float(machine.anchor_bytes)
        b = _links_many(algorithm, op, nodes, machine.bandwidth_only(), np.concatenate([[n0], np.maximum(s, n0)]))
        return anchor + b[1:] - b[0]
    return _links_many(algorithm, op, nodes, machine, s)


def _links_many(algorithm: str, op: str, nodes: list[list[int]], machine: Machine, s: np.ndarray) -> np.ndarray:
    p = sum(len(n) for n in nodes)
    if p <= 1:
        return np.zeros_like(s)
    node_of = np.empty(p, dtype=np.int64)
    for k, members in enumerate(nodes):
        node_of[list(members)] = k
    fitted = machine.native_all_to_all
    if algorithm == "native" and op == "all_to_all" and fitted is not None \
            and [len(n) for n in nodes] == machine.meta.get("ranks_per_node"):
        return fitted.alpha + fitted.beta * s
    if algorithm not in ("native", "grid2d") and algorithm not in _POINT_TO_POINT:
        # Plan-based: each phase priced on the links it runs on (see _phases).
        stages = _phases(algorithm, op, nodes, machine)
        if algorithm == "hierarchical" and op == "all_reduce" and 1 < len(nodes) < p:
            # Pipelined in k chunks (collectives/algos/hierarchical.py): the phases of one chunk
            # once, plus the slowest phase k-1 more times.
            from collectives.algos.hierarchical import pipeline_chunks

            chunks = np.array([pipeline_chunks(int(x)) for x in s], dtype=float)
            per = [_time([_coef(rd, node_of) for rd in st], mm, s / chunks) for st, mm in stages]
            return np.sum(per, axis=0) + (chunks - 1) * np.maximum.reduce(per)
        return np.sum([_time([_coef(rd, node_of) for rd in st], mm, s) for st, mm in stages], axis=0)
    # The backend's own collectives run on the backend's links; our point-to-point schedules on
    # the plain ones, plus the executor's host time per round.
    m = machine.for_native() if algorithm in ("native", "grid2d") else machine
    parts = rounds(algorithm, op, nodes, machine)
    step = machine.step if algorithm in _POINT_TO_POINT else 0.0
    times = [_time([_coef(rd, node_of) for rd in ph], m, s, step) for ph in parts]
    if algorithm == "grid2d" and len(times) == 6:
        return np.sum([np.maximum(times[i], times[i + 3]) for i in range(3)], axis=0)
    return np.sum(times, axis=0)


def predict(algorithm: str, op: str, nodes: list[list[int]], machine: Machine, nbytes: float) -> float:
    return float(predict_many(algorithm, op, nodes, machine, [nbytes])[0])
