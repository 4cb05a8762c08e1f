"""The alpha-beta-gamma cost model: the predicted time of a communication plan on a calibrated machine.

Each tier is a link with a per-message latency ``a`` (alpha, seconds) and a per-byte time ``b``
(beta, seconds per byte); ``g`` (gamma) is the time to reduce one byte locally (Hockney 1994;
Thakur, Rabenseifner & Gropp 2005). A plan is described as *rounds*: in a round every rank
sends at most one message per destination, all at once. A round costs::

    max( a_intra + b_intra * (largest bytes a rank sends inside its node),
         a_inter + b_inter * (largest bytes a node sends or receives across nodes)
                           / min(flows of that node, NICs per node) )
    + g * (bytes a rank reduces)

so ranks of one node that cross to other nodes at the same time share the node's NICs: that is
what makes a flat ring across nodes slower than a hierarchy on nodes with one uplink, and what a
rail-optimised cluster (one NIC per GPU) does not suffer. Rounds are built from a pattern on the
real rank-to-node map, so they hold for any placement.

Design note: this module knows no algorithm by name. Every algorithm describes its own
communication as a :class:`CostPlan` (``Algorithm.cost`` in ``collectives/algos/``): stages of
rounds, which links each runs on (:class:`Links`), stages that run at the same time (grid2d's
two halves) and pipelining in chunks (:class:`Pipeline`, hierarchical's all-reduce), as data.
:func:`price` evaluates whatever plan it is handed; ``collectives.selection`` prices every
registered algorithm that returns one. Tried first and replaced: a table of algorithm names here
(``algorithms_for``) whose patterns were rebuilt by name, with special cases for hierarchical
pipelining and grid2d's halves; every new algorithm meant an edit here, and reading
hierarchical's phases made ``topology`` import ``collectives``, which imports ``topology``.

What stays here is the pattern library (:func:`flat_rounds`): the flat patterns the backends'
own collectives run (``Machine.native`` names one per op) and that our point-to-point schedules
follow. Closed forms (``p`` ranks, ``n`` bytes, one tier; Thakur et al. 2005, secs. 4.1-4.3; Chan
et al. 2007), which the rounds reproduce on one node::

    ring             all-reduce 2(p-1)a + 2(p-1)/p n b + (p-1)/p n g;  RS, AG: (p-1)a + (p-1)/p n b (+ g)
    recursive_doubling  all-reduce log2(p)(a + n b + n g);   AG: log2(p) a + (p-1)/p n b
    halving_doubling all-reduce 2 log2(p) a + 2(p-1)/p n b + (p-1)/p n g
    binomial_tree    broadcast, reduce ceil(log2 p)(a + n b)
    pairwise         all-to-all (p-1)(a + n/p b);   bruck: ceil(log2 p)(a + n/2 b)
    direct           all-to-all (every message at once, Gloo's): a + (p-1)/p n b

Non-power-of-two ``p`` adds the fold's two rounds of ``n`` bytes (``collectives/algos/_fold.py``).
Composite algorithms are sums of these on sub-groups (hierarchical all-reduce: ``T_RS(g; intra) +
T_AR(n_nodes, n/g; inter) + T_AG(g; intra)``), see each algorithm's module. The model is
evaluated vectorised over message sizes, so the simulator can sweep thousands of ranks.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = ["LinkCost", "Machine", "Round", "Links", "Stage", "Pipeline", "CostPlan", "Priced", "price", "stage",
           "flat_plan", "flat_rounds", "GLOO_NATIVE", "NCCL_NATIVE"]


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
        """This machine as the backend's own collectives see it: their links where they were fitted."""
        if self.native_intra is None and self.native_inter is None:
            return self
        # Links fitted from the backend's whole all-reduce already include its reduction: no gamma.
        return Machine(self.name, self.native_intra or self.intra, self.native_inter or self.inter,
                       self.nics_per_node, 0.0, self.native,
                       intra_exchange=None if self.native_intra else self.intra_exchange,
                       inter_exchange=None if self.native_inter else self.inter_exchange,
                       uplink=None if self.native_inter else self.uplink,
                       uplink_exchange=None if self.native_inter else self.uplink_exchange)

    def calibrated_on(self, nodes: Sequence[Sequence[int]]) -> bool:
        """Whether ``nodes`` has the shape this machine was calibrated on (``meta["ranks_per_node"]``):
        where its whole-call measurements (``anchors``, ``native_all_to_all``) apply."""
        return [len(n) for n in nodes] == self.meta.get("ranks_per_node")

    def measured_call(self, op: str) -> LinkCost | None:
        """The backend's whole ``op`` as measured on the calibrated topology, or None."""
        return {"all_to_all": self.native_all_to_all}.get(op)


@dataclass(frozen=True)
class Round:
    """One round: rank ``r`` sends ``frac * n`` bytes to each ``dst[r, k] >= 0``; ``reduce``: it reduces them.

    ``dst`` is ``[ranks, k]`` (global ranks, ``-1`` pads); ``n`` is the op's nccl-tests size in
    bytes; ``count`` repeats the round.
    """

    dst: np.ndarray
    frac: float
    reduce: bool
    count: int = 1


# -- plans: what an algorithm hands the model ----------------------------------------------------
class Links(enum.Enum):
    """Which of a machine's link costs a stage is priced on."""

    EXECUTOR = "executor"  # our point-to-point executor's steps: the plain links plus Machine.step per round
    PLAIN = "plain"        # the plain links alone: a few batched sends outside the executor (hierarchical's)
    NATIVE = "native"      # the backend's own collective: Machine.for_native(), no host time per round


@dataclass(frozen=True)
class Stage:
    """Rounds run one after another on one kind of links (``links``)."""

    rounds: tuple[Round, ...]
    links: Links = Links.NATIVE


@dataclass(frozen=True)
class Pipeline:
    """A plan run in ``k`` chunks that flow through its phases: ``k`` = ``nbytes // chunk_bytes``,
    between 1 and ``max_chunks``. Time: every phase once on a chunk, plus the slowest ``k - 1``
    more times (the others hide behind it)."""

    chunk_bytes: int
    max_chunks: int

    def chunks(self, nbytes: int) -> int:
        """How many chunks a call of ``nbytes`` is cut into."""
        return max(1, min(self.max_chunks, nbytes // self.chunk_bytes))


@dataclass(frozen=True)
class CostPlan:
    """An algorithm's communication for one op on one topology, as the cost model prices it.

    Attributes:
        phases: run one after another. A phase is one or more stages that run at the same time
            (grid2d's two halves); it takes its slowest stage's time.
        pipeline: None, or how the phases are pipelined in chunks.
        backend_call: the plan is the backend's own collective for this op on the whole group:
            where the machine holds a measurement of that whole call on this topology
            (:meth:`Machine.measured_call`), the measurement is the price.
    """

    phases: tuple[tuple[Stage, ...], ...]
    pipeline: Pipeline | None = None
    backend_call: str | None = None

    @classmethod
    def sequence(cls, stages: Iterable[Stage], pipeline: Pipeline | None = None) -> CostPlan:
        """Stages run one after another, each its own phase."""
        return cls(tuple((st,) for st in stages), pipeline)


class Priced(Protocol):
    """What :func:`price` needs of an algorithm (``collectives.algos.Algorithm`` fills it)."""

    @property
    def name(self) -> str:
        """The key of the algorithm's measured calls in ``Machine.anchors``."""
        ...

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """The algorithm's plan for ``op`` on ``nodes``, or None where the model has no price for it."""
        ...


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


# -- plans from patterns, and their price -------------------------------------------------------
def stage(pattern: str, op: str, groups: Sequence[Sequence[int]], world: int, scale: float = 1.0,
          links: Links = Links.NATIVE) -> Stage:
    """The flat ``pattern`` of ``op`` run on every rank set in ``groups`` at once, as one stage.

    Args:
        pattern: a name :func:`flat_rounds` knows (``Machine.native`` holds such names).
        op: the op whose rounds the pattern gives.
        groups: rank sets of equal size, in global ranks (e.g. the nodes, or the rails).
        world: ranks in all.
        scale: bytes of this stage per byte of the whole op's nccl-tests size.
        links: what the stage runs on.
    """
    rounds = flat_rounds(pattern, op, len(groups[0]))
    return Stage(tuple(_place(rounds, [tuple(g) for g in groups], world, scale)), links)


def flat_plan(pattern: str, op: str, nodes: Sequence[Sequence[int]], links: Links, *,
              backend_call: str | None = None) -> CostPlan:
    """A plan of one stage: ``pattern`` over the whole group (``nodes`` only count its ranks)."""
    p = sum(len(n) for n in nodes)
    return CostPlan(((stage(pattern, op, [range(p)], p, 1.0, links),),), backend_call=backend_call)


def price(subject: CostPlan | Priced, op: str, nodes: list[list[int]], machine: Machine, sizes: Iterable[float], *,
          anchor: str | None = None) -> np.ndarray:
    """Predicted seconds of ``subject`` for ``op`` at each nccl-tests size in ``sizes`` (bytes).

    Args:
        subject: a plan, or an algorithm whose :meth:`Priced.cost` gives the plan.
        op: the op (for the machine's anchors and the algorithm's plan).
        nodes: global ranks per node.
        machine: the calibrated link costs.
        sizes: message sizes in bytes.
        anchor: the name the machine's anchors are keyed by; default the algorithm's name, none for a plan.

    Returns:
        ``[len(sizes)]`` float64 seconds.

    Raises:
        KeyError: the algorithm has no plan for ``op`` on ``nodes``.

    Where the machine holds an anchor for this op and name on this topology, the time is
    anchored on it: ``T(n) = anchor + B(max(n, n0)) - B(n0)``, with ``n0`` the anchor's size and
    ``B`` the plan with every latency set to zero (bytes and reductions only). The measured small
    call carries the algorithm's whole fixed cost (NCCL's tuner keeps a base latency per algorithm
    for the same reason); the links carry how the time grows with size.
    """
    if isinstance(subject, CostPlan):
        plan = subject
    else:
        found = subject.cost(op, nodes, machine)
        if found is None:
            raise KeyError(f"the cost model has no price for {subject.name} {op} on nodes of {[len(n) for n in nodes]}")
        plan, anchor = found, subject.name if anchor is None else anchor
    s = np.asarray(list(sizes), dtype=float)
    measured = machine.anchors.get(op, {}).get(anchor) if anchor is not None else None
    if measured is not None and machine.anchor_bytes > 0 and machine.calibrated_on(nodes):
        n0 = float(machine.anchor_bytes)
        b = _evaluate(plan, nodes, machine.bandwidth_only(), np.concatenate([[n0], np.maximum(s, n0)]))
        return measured + b[1:] - b[0]
    return _evaluate(plan, nodes, machine, s)


def _evaluate(plan: CostPlan, nodes: list[list[int]], machine: Machine, s: np.ndarray) -> np.ndarray:
    p = sum(len(n) for n in nodes)
    if p <= 1:
        return np.zeros_like(s)
    whole = machine.measured_call(plan.backend_call) if plan.backend_call is not None else None
    if whole is not None and machine.calibrated_on(nodes):
        return whole.alpha + whole.beta * s
    node_of = np.empty(p, dtype=np.int64)
    for k, members in enumerate(nodes):
        node_of[list(members)] = k
    if not plan.phases:
        return np.zeros_like(s)
    native = machine.for_native()

    def phase(stages: tuple[Stage, ...], sizes: np.ndarray) -> np.ndarray:
        return np.maximum.reduce([_stage_time(st, node_of, machine, native, sizes) for st in stages])

    if plan.pipeline is not None:
        chunks = np.array([plan.pipeline.chunks(int(x)) for x in s], dtype=float)
        per = [phase(ph, s / chunks) for ph in plan.phases]
        return np.sum(per, axis=0) + (chunks - 1) * np.maximum.reduce(per)
    return np.sum([phase(ph, s) for ph in plan.phases], axis=0)


def _stage_time(st: Stage, node_of: np.ndarray, machine: Machine, native: Machine, s: np.ndarray) -> np.ndarray:
    coefs = [_coef(rd, node_of) for rd in st.rounds]
    if st.links is Links.NATIVE:
        return _time(coefs, native, s)
    return _time(coefs, machine, s, machine.step if st.links is Links.EXECUTOR else 0.0)
