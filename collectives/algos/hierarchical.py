"""Hierarchical all-reduce, reduce-scatter, all-gather and all-to-all: the backend's collectives on
the groups the topology derives (intra-node, inter-node rails), so that each byte crosses the slow
inter-node tier as few times as it must.

With ``n`` nodes of ``g`` ranks (rail ``j`` = the ``j``-th rank of every node), ``m`` elements::

    all_reduce      intra reduce-scatter [g*c -> c]  ->  rail all-reduce [c]  ->  intra all-gather [c -> g*c]
                    (c = ceil(m/g); each rank sends 2(n-1)/n * m/g across nodes: the node as a
                    whole sends 2(n-1)/n * m, the minimum for an all-reduce between n nodes),
                    pipelined in up to 8 chunks so the intra-node phases hide behind the inter-node one
    reduce_scatter  pack the blocks rail-major  ->  intra reduce-scatter [g*n*c -> n*c]
                    ->  rail reduce-scatter [n*c -> c]      ((n-1)*c per rank across nodes)
    all_gather      rail all-gather [c -> n*c]  ->  intra all-gather [n*c -> g*n*c]  ->  unpack
    all_to_all      splits shared in the node  ->  intra all-to-all that gathers, on local rank j,
                    everything the node sends to rail j  ->  one rail all-to-all (one message per
                    node pair and rail, instead of g*g)  ->  unpack by source. Uneven splits work:
                    the node's split matrix rides along (Tutel's 2DH all-to-all, Hwang et al. 2023).
                    Both all-to-alls are point-to-point batches with receives posted first (see
                    ``_exchange``), not the backend's all-to-all.

Nodes of unequal size have no rails: all-reduce then reduces to each node's first rank, all-reduces
among those leaders and broadcasts inside the node (Jia et al. 2018's hierarchical all-reduce);
reduce-scatter does that all-reduce and keeps its block; all-gather gathers in the node, exchanges
padded node blocks among leaders and broadcasts. All-to-all needs equal nodes and says so before
anything is sent.

Cost (alpha-beta per tier, intra ``a_i, b_i``, inter ``a_e, b_e``; the sub-collectives' own
formulas, see ``topology/cost.py``): all-reduce ``T_RS,intra(g, m) + T_AR,inter(n, m/g) +
T_AG,intra(g, m)``. Design note: the sub-collectives are the backend's own (NCCL, Gloo), because
inside one tier the backend's tuned kernels are the fastest we have (measurements in
``bench/results/``); the hierarchy is what they lack. Three exceptions are point-to-point with the
receive posted before the send: a phase between two ranks (one exchange instead of the backend's
two-step all-reduce, or Gloo's reduce-scatter, which clones and runs a whole all-reduce), and
both all-to-alls (Gloo's posts sends first; over TCP that halved the rate in about half the runs).

Tried and rejected: a rail phase of reduce-to-root plus broadcast, roots spread over the nodes, so
that no connection carries both directions at once. In the emulated 2x2 cluster it ran at
0.95-1.29x native Gloo's time where the rail all-reduce ran at 0.73-0.77x; the slow two-way
exchanges it avoided turned out to be send-first ordering, fixed by posting receives first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from topology.cost import CostPlan, Links, Machine, Pipeline, stage
from topology.groups import rails_of
from topology.model import Topology

from .._types import torch_reduce_op
from ..errors import UnsupportedError
from ._executor import message_tag
from ._base import Algorithm, _divide
from ._executor import REDUCERS
from .native import Native, _all_gather, _reduce_scatter
from .._wait import wait

if TYPE_CHECKING:
    from ..communicator import Communicator
    from ..dispatch import Call

__all__ = ["Hierarchical", "Phase", "plan", "run_flat", "single_tier", "padded"]

_NATIVE = Native()


@dataclass(frozen=True)
class Phase:
    """One sub-collective of a plan: ``op`` over each rank set in ``groups`` at once.

    ``tier`` is "intra" (inside a node) or "inter" (across nodes); ``elements`` is the larger
    buffer of the sub-collective per rank (nccl-tests' size), or for all-to-all the elements each
    rank sends in all.
    """

    op: str
    tier: str
    groups: tuple[tuple[int, ...], ...]
    elements: int
    pattern: str | None = None  # how it runs when not the backend's own collective (cost model)


def _equal(nodes: list[list[int]]) -> bool:
    return len({len(n) for n in nodes}) == 1


def _needs_equal_nodes(op: str, nodes: list[list[int]], world: int) -> bool:
    """Whether ``op`` cannot run on ``nodes``: the two-level all-to-all needs rails (equal nodes)."""
    return op == "all_to_all" and not single_tier(nodes, world) and not _equal(nodes)


def plan(op: str, topo: Topology, elements: int) -> list[Phase]:
    """The sub-collectives ``hierarchical`` runs for ``op`` on ``elements`` (nccl-tests' size)."""
    nodes = topo.nodes()
    n, p = len(nodes), topo.world
    intra = tuple(tuple(x) for x in nodes)
    if single_tier(nodes, p):
        return [Phase(op, "intra" if n == 1 else "inter", (tuple(range(p)),), elements)]
    if not _equal(nodes):
        leaders = (tuple(x[0] for x in nodes),)
        if op == "all_gather":
            big = max(len(x) for x in nodes) * (elements // p)
            return [Phase("all_gather", "intra", intra, elements // p * len(nodes[0])),
                    Phase("all_gather", "inter", leaders, n * big), Phase("broadcast", "intra", intra, n * big)]
        return [Phase("reduce", "intra", intra, elements), Phase("all_reduce", "inter", leaders, elements),
                Phase("broadcast", "intra", intra, elements)]
    g = p // n
    rails = tuple(rails_of(nodes))
    if op == "all_reduce":
        c = -(-elements // g)
        # Two nodes: the rail all-reduce is one exchange of the shard (``_pair_peer``).
        # Two ranks per node: the intra phases are one exchange each (ring on two ranks).
        rail = Phase("all_reduce", "inter", rails, c, "recursive_doubling" if len(nodes) == 2 else None)
        pair = "ring" if g == 2 else None
        return [Phase("reduce_scatter", "intra", intra, g * c, pair), rail, Phase("all_gather", "intra", intra, g * c, pair)]
    c = elements // p
    if op == "reduce_scatter":
        return [Phase("reduce_scatter", "intra", intra, g * n * c), Phase("reduce_scatter", "inter", rails, n * c)]
    if op == "all_gather":
        return [Phase("all_gather", "inter", rails, n * c), Phase("all_gather", "intra", intra, g * n * c)]
    if op == "all_to_all":  # even splits of c elements per destination
        return [Phase("all_to_all", "intra", intra, p * c, "direct"), Phase("all_to_all", "inter", rails, p * c, "direct")]
    raise ValueError(f"no hierarchical plan for {op}")


# Pipelining the two-level all-reduce in chunks of at least this many bytes, at most MAX_CHUNKS
# of them. Each chunk costs one latency per phase (milliseconds on Gloo with 4 ranks on 2 cores),
# so chunks stay large; 8 chunks hide all but an eighth of the intra-node phases. Measured
# 2026-11-30 in the emulated 2x2 cluster (400 Mbit/s), 4 MB all-reduce: 2 MB chunks 101 ms,
# 1 MB 95 ms, 512 KB 98 ms; at 8 MB all three 188 ms.
PIPELINE_CHUNK_BYTES = 1 << 20
MAX_CHUNKS = 8
PIPELINE = Pipeline(PIPELINE_CHUNK_BYTES, MAX_CHUNKS)  # what the run and the cost model both follow


def pipeline_chunks(nbytes: int) -> int:
    """How many chunks the two-level all-reduce of ``nbytes`` is pipelined in (same on every rank)."""
    return PIPELINE.chunks(nbytes)


def _pair_peer(call: Call, d: Any) -> int | None:
    """On two nodes, the global rank of my rail peer: the rail all-reduce is then one exchange.

    One exchange of the whole shard (receive posted first, then reduce) instead of the backend's
    two-step all-reduce: the same bytes each way, one latency instead of two, and full duplex on
    Gloo over TCP (see ``_exchange``). Measured in the emulated 2x2 cluster, 4 MB all-reduce: 96.4
    ms with Gloo's all-reduce on the rails, 94.7 ms with this, 91.1 ms once the intra-node phases
    were exchanges too (2026-11-30).
    """
    if len(d.nodes) != 2 or d.rail_ranks is None:
        return None
    other = next(r for r in d.rail_ranks if r != call.comm.rank)
    return call.comm.global_ranks[other]


def _rop(call: Call) -> Any:
    red = call.reduce_op or "sum"
    return torch_reduce_op("sum" if red == "avg" else red)


def _index(order: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(order, dtype=torch.long, device=device)


class Hierarchical(Algorithm):
    name = "hierarchical"
    ops = frozenset({"all_reduce", "reduce_scatter", "all_gather", "all_to_all"})
    topology_aware = True
    summary = "intra-node then inter-node (rails) with the backend's collectives; two-level all-to-all"

    def plan(self, op: str, topo: Topology, elements: int) -> list[Phase]:
        """The sub-collectives this algorithm runs (what the cost model prices)."""
        return plan(op, topo, elements)

    def cost(self, op: str, nodes: list[list[int]], machine: Machine) -> CostPlan | None:
        """The plan's phases one after another: the backend's collectives on its own links, the
        point-to-point phases (those with a ``pattern``) on the plain ones; the two-level
        all-reduce pipelined in chunks (:data:`PIPELINE`). None where it cannot run (all-to-all on
        nodes of unequal size)."""
        p = sum(len(n) for n in nodes)
        if op not in self.ops or _needs_equal_nodes(op, nodes, p):
            return None
        stages = [stage(ph.pattern or machine.native.get(ph.op, "ring"), ph.op, ph.groups, p,
                        ph.elements / float(1 << 20), Links.PLAIN if ph.pattern else Links.NATIVE)
                  for ph in plan(op, Topology.from_nodes([list(n) for n in nodes]), 1 << 20)]
        # Two tiers: _all_reduce runs in chunks. (Unequal nodes run the leaders' all-reduce in one
        # piece, but the model has always priced them pipelined too.)
        pipelined = op == "all_reduce" and 1 < len(nodes) < p
        return CostPlan.sequence(stages, PIPELINE if pipelined else None)

    def unavailable(self, comm: Communicator, op: str) -> str:
        nodes = comm.topology.nodes()
        if not _needs_equal_nodes(op, nodes, comm.size):
            return ""
        return f"all-to-all needs nodes of equal size; this group's nodes have {[len(n) for n in nodes]} ranks"

    def check(self, call: Call) -> None:
        why = self.unavailable(call.comm, call.op)
        if why:
            raise UnsupportedError("algorithm", self.name, why, "use 'pairwise' or 'native' on nodes of unequal size")
        if not single_tier(call.comm.topology.nodes(), call.comm.size):
            call.comm.derived_groups()  # created here, on the caller's thread, before anything is sent

    def run(self, call: Call) -> None:
        comm = call.comm
        nodes = comm.topology.nodes()
        if single_tier(nodes, comm.size):
            run_flat(call)
            return
        d = comm.derived_groups()
        op = call.op
        if op == "all_reduce":
            self._all_reduce(call, d) if d.rails else _leader_all_reduce(call, d, call.output.view(-1))
        elif op == "reduce_scatter":
            self._reduce_scatter(call, d) if d.rails else self._leader_reduce_scatter(call, d)
        elif op == "all_gather":
            self._all_gather(call, d) if d.rails else self._leader_all_gather(call, d)
        else:
            self._all_to_all(call, d)
        if call.reduce_op == "avg":
            _divide(call, comm.size)

    # -- equal nodes -------------------------------------------------------------------------------
    def _all_reduce(self, call: Call, d: Any) -> None:
        x = call.output.view(-1)
        m, g = x.numel(), len(d.intra_ranks)
        if m == 0:
            return
        comm = call.comm
        k = pipeline_chunks(m * x.element_size())
        buf = padded(call, "hier.ar.buf", x, k * g)
        c = buf.numel() // (k * g)  # shard elements per chunk
        chunk = [buf[i * g * c:(i + 1) * g * c] for i in range(k)]
        rop = _rop(call)
        reduce = REDUCERS[call.reduce_op or "sum"]
        theirs = comm._workspace("hier.ar.theirs", x.dtype, x.device, 2 * k * c)
        # Two ranks per node: each intra phase is one exchange with the other rank of the node
        # (receive first, see ``_exchange``); Gloo's reduce-scatter would clone the chunk and run a
        # whole all-reduce. Otherwise the backend's reduce-scatter and all-gather.
        mate = comm.global_ranks[d.intra_ranks[1 - d.local]] if g == 2 else None
        if mate is not None:
            shard = [ch[d.local * c:(d.local + 1) * c] for ch in chunk]
            other = [ch[(1 - d.local) * c:(2 - d.local) * c] for ch in chunk]
        else:
            shards = comm._workspace("hier.ar.shard", x.dtype, x.device, k * c)
            shard = [shards[i * c:(i + 1) * c] for i in range(k)]
        pair = _pair_peer(call, d)
        mine_in = [theirs[i * c:(i + 1) * c] for i in range(k)]          # intra partner's half of my shard
        rail_in = [theirs[(k + i) * c:(k + i + 1) * c] for i in range(k)]  # rail peer's shard

        def swap(dst: torch.Tensor, src: torch.Tensor, peer: int, group: Any, tag: int) -> list[Any]:
            return list(dist.batch_isend_irecv([dist.P2POp(dist.irecv, dst, peer, group, message_tag(tag, dst)),
                                                dist.P2POp(dist.isend, src, peer, group, message_tag(tag, src))]))

        def done(works: Any) -> None:
            for w in works if isinstance(works, list) else [works]:
                wait(w)

        # Chunks flow through three queues (intra, rail, intra): while chunk i crosses the nodes,
        # chunk i+1 is reduce-scattered and chunk i-1 all-gathered inside the node.
        #   intra: RS0 RS1 RS2 ...          AG0 AG1 AG2
        #   rail :     AR0 AR1 AR2 ...
        if mate is not None:
            rs = [swap(mine_in[i], other[i], mate, d.intra, 3 * i) for i in range(k)]
        else:
            rs = [_reduce_scatter(shard[i], chunk[i], rop, d.intra, True) for i in range(k)]
        ar = []
        for i in range(k):
            done(rs[i])
            if mate is not None:
                reduce(shard[i], mine_in[i])
            if pair is None:
                ar.append(dist.all_reduce(shard[i], rop, d.rail, async_op=True))
            else:  # two nodes: swap shards with the rail peer, then reduce
                ar.append(swap(rail_in[i], shard[i], pair, d.rail, 3 * i + 1))
        ag = []
        for i in range(k):
            done(ar[i])
            if pair is not None:
                reduce(shard[i], rail_in[i])
            if mate is not None:
                ag.append(swap(other[i], shard[i], mate, d.intra, 3 * i + 2))
            else:
                ag.append(_all_gather(chunk[i], shard[i], d.intra, True))
        for w in ag:
            done(w)
        if buf is not x:
            x.copy_(buf[:m])

    def _reduce_scatter(self, call: Call, d: Any) -> None:
        out, inp = call.output.view(-1), call.input.view(-1)
        c, p, n = out.numel(), call.comm.size, len(d.nodes)
        if c == 0:
            return
        order = [r for rail in d.rails for r in rail]  # block i of the packed buffer is rank order[i]'s
        pack = call.comm._workspace("hier.rs.pack", out.dtype, out.device, p * c)
        torch.index_select(inp.view(p, c), 0, _index(order, out.device), out=pack.view(p, c))
        tmp = call.comm._workspace("hier.rs.tmp", out.dtype, out.device, n * c)
        wait(_reduce_scatter(tmp, pack, _rop(call), d.intra, True), cuda=tmp.is_cuda)
        wait(_reduce_scatter(out, tmp, _rop(call), d.rail, True), cuda=out.is_cuda)

    def _all_gather(self, call: Call, d: Any) -> None:
        out, inp = call.output.view(-1), call.input.view(-1)
        c, p, n = inp.numel(), call.comm.size, len(d.nodes)
        if c == 0:
            return
        t1 = call.comm._workspace("hier.ag.rail", out.dtype, out.device, n * c)
        wait(_all_gather(t1, inp, d.rail, True), cuda=t1.is_cuda)
        t2 = call.comm._workspace("hier.ag.node", out.dtype, out.device, p * c)
        wait(_all_gather(t2, t1, d.intra, True), cuda=t2.is_cuda)
        order = [r for rail in d.rails for r in rail]
        out.view(p, c).index_copy_(0, _index(order, out.device), t2.view(p, c))

    def _all_to_all(self, call: Call, d: Any) -> None:
        comm = call.comm
        lay = call.layout()
        ins, outs = list(lay.in_splits or ()), list(lay.out_splits or ())
        inp, out = call.input.view(-1), call.output.view(-1)
        p, g, me = comm.size, len(d.intra_ranks), d.local
        rails: list[tuple[int, ...]] = d.rails
        node_of = {r: k for k, members in enumerate(d.nodes) for r in members}
        # Every rank of the node learns what the others send where: S[i][q] elements from local i to q.
        mine = torch.tensor(ins, dtype=torch.int64, device=inp.device)
        every = torch.empty(g * p, dtype=torch.int64, device=inp.device)
        wait(_all_gather(every, mine, d.intra, True), cuda=every.is_cuda)
        S = every.view(g, p).tolist()
        in_off = [0] * (p + 1)
        for q in range(p):
            in_off[q + 1] = in_off[q] + ins[q]
        # Phase 1 (intra): local rank j collects everything the node sends to rail j.
        send1 = [sum(ins[q] for q in rails[j]) for j in range(g)]
        recv1 = [sum(S[i][q] for q in rails[me]) for i in range(g)]
        pack1 = comm._workspace("hier.a2a.pack1", inp.dtype, inp.device, sum(send1))
        segs = [inp[in_off[q]:in_off[q + 1]] for j in range(g) for q in rails[j]]
        if segs:
            torch.cat(segs, out=pack1)
        got1 = comm._workspace("hier.a2a.got1", inp.dtype, inp.device, sum(recv1))
        _exchange(got1, pack1, recv1, send1, [comm.global_ranks[r] for r in d.intra_ranks], me, d.intra)
        # got1 holds, for each local source i, its blocks for rail members in rail order; regroup by
        # rail member (the inter-node destination), sources in local order.
        off, pieces = 0, {}
        for i in range(g):
            for q in rails[me]:
                pieces[(q, i)] = got1[off:off + S[i][q]]
                off += S[i][q]
        send2 = [sum(S[i][q] for i in range(g)) for q in rails[me]]
        pack2 = comm._workspace("hier.a2a.pack2", inp.dtype, inp.device, sum(send2))
        segs = [pieces[(q, i)] for q in rails[me] for i in range(g)]
        if segs:
            torch.cat(segs, out=pack2)
        # Phase 2 (inter): one message per rail peer; it carries every source of its node, in local order.
        sources = [s for q in rails[me] for s in d.nodes[node_of[q]]]
        recv2 = [sum(outs[s] for s in d.nodes[node_of[q]]) for q in rails[me]]
        rail_glob = [comm.global_ranks[r] for r in rails[me]]
        pos = rails[me].index(comm.rank)
        if sources == list(range(p)):
            _exchange(out, pack2, recv2, send2, rail_glob, pos, d.rail)
            return
        got2 = comm._workspace("hier.a2a.got2", inp.dtype, inp.device, sum(recv2))
        _exchange(got2, pack2, recv2, send2, rail_glob, pos, d.rail)
        out_off = [0] * (p + 1)
        for s in range(p):
            out_off[s + 1] = out_off[s] + outs[s]
        off = 0
        for s in sources:
            out[out_off[s]:out_off[s + 1]].copy_(got2[off:off + outs[s]])
            off += outs[s]

    # -- nodes of unequal size ---------------------------------------------------------------------
    def _leader_reduce_scatter(self, call: Call, d: Any) -> None:
        out, inp = call.output.view(-1), call.input.view(-1)
        c, r = out.numel(), call.comm.rank
        full = call.comm._workspace("hier.rs.full", inp.dtype, inp.device, inp.numel())
        full.copy_(inp)
        _leader_all_reduce(call, d, full)
        out.copy_(full[r * c:(r + 1) * c])

    def _leader_all_gather(self, call: Call, d: Any) -> None:
        comm = call.comm
        out, inp = call.output.view(-1), call.input.view(-1)
        c, n = inp.numel(), len(d.nodes)
        if c == 0:
            return
        big = max(len(x) for x in d.nodes)
        mine = comm._workspace("hier.ag.mine", out.dtype, out.device, len(d.intra_ranks) * c)
        wait(_all_gather(mine, inp, d.intra, True), cuda=mine.is_cuda)
        every = comm._workspace("hier.ag.every", out.dtype, out.device, n * big * c)
        if d.leaders is not None:
            padded = comm._workspace("hier.ag.pad", out.dtype, out.device, big * c)
            padded[:mine.numel()].copy_(mine)
            padded[mine.numel():].zero_()
            wait(_all_gather(every, padded, d.leaders, True), cuda=every.is_cuda)
        wait(dist.broadcast(every, comm.global_ranks[d.intra_ranks[0]], d.intra, True), cuda=every.is_cuda)
        for k, members in enumerate(d.nodes):
            for i, r in enumerate(members):
                out[r * c:(r + 1) * c].copy_(every[(k * big + i) * c:(k * big + i + 1) * c])


def _exchange(out: torch.Tensor, inp: torch.Tensor, recv: list[int], send: list[int], peers: list[int],
              me: int, group: Any) -> None:
    """All-to-all of ``inp`` (``send[i]`` elements to ``peers[i]``) into ``out`` over ``group``.

    Every message at once, receives posted before sends: Gloo's own all-to-all posts sends first,
    and over TCP an exchange posted send-first ran at half the link rate in about half the runs
    (emulated 400 Mbit/s link, 2026-11-30); receive-first ran at the full rate every time. NCCL
    groups the point-to-point calls, so the order does not matter there.
    """
    ro = [0] * (len(peers) + 1)
    so = [0] * (len(peers) + 1)
    for i in range(len(peers)):
        ro[i + 1] = ro[i] + recv[i]
        so[i + 1] = so[i] + send[i]
    out[ro[me]:ro[me + 1]].copy_(inp[so[me]:so[me + 1]])
    ops = [dist.P2POp(dist.irecv, out[ro[i]:ro[i + 1]], peers[i], group) for i in range(len(peers)) if i != me and recv[i]]
    ops += [dist.P2POp(dist.isend, inp[so[i]:so[i + 1]], peers[i], group) for i in range(len(peers)) if i != me and send[i]]
    if ops:
        for w in dist.batch_isend_irecv(ops):
            wait(w)


def single_tier(nodes: list[list[int]], world: int) -> bool:
    """One node, or one rank per node: nothing to stage between tiers."""
    return len(nodes) == 1 or len(nodes) == world


def padded(call: Call, key: str, x: torch.Tensor, parts: int) -> torch.Tensor:
    """``x`` itself if it splits into ``parts`` equal pieces, else a zero-padded workspace copy."""
    m = x.numel()
    c = -(-m // parts)
    if m == parts * c:
        return x
    buf = call.comm._workspace(key, x.dtype, x.device, parts * c)
    buf[:m].copy_(x)
    buf[m:].zero_()
    return buf


def run_flat(call: Call) -> None:
    """The backend's collective on the whole group, synchronously (the caller handles async)."""
    was = call.async_op
    call.async_op = False
    try:
        _NATIVE.run(call)
    finally:
        call.async_op = was


def _leader_all_reduce(call: Call, d: Any, x: torch.Tensor) -> None:
    """Reduce to each node's first rank, all-reduce among those, broadcast inside the node."""
    if x.numel() == 0:
        return
    leader = call.comm.global_ranks[d.intra_ranks[0]]
    if len(d.intra_ranks) > 1:
        wait(dist.reduce(x, leader, _rop(call), d.intra, True), cuda=x.is_cuda)
    if d.leaders is not None:
        wait(dist.all_reduce(x, _rop(call), d.leaders, True), cuda=x.is_cuda)
    if len(d.intra_ranks) > 1:
        wait(dist.broadcast(x, leader, d.intra, True), cuda=x.is_cuda)
