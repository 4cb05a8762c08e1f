"""Timing MoE dispatch, experts and combine, sequential and pipelined, as functions that return records.

For one configuration (tokens per rank, hidden, experts, top-k) with uniformly random routing,
the same run times: ``dispatch`` (routing and exchange), the experts (``GroupedSwiGLU``),
``combine``, the three in sequence, ``forward_pipelined`` at each chunk count (or
``forward_micro_batches``: a chunk count "micro<n>"), and NCCL's (or Gloo's)
``all_to_all_single`` moving the same rows with the same splits. ``*_GBps`` count the rows a rank
sends, its own included; ``*_link_GBps`` only the bytes that cross to other ranks
(``bytes_crossing``). ``hidden_pct`` is ``(sequential - pipelined) / (dispatch + combine)``;
``hidden_small_pct`` is ``(sequential - pipelined) / min(experts, dispatch + combine)``, the share
of the smaller term hidden, and ``ideal_us`` ``max(experts, dispatch + combine)``, the best any
overlap reaches; ``hidden_small_paired_pct`` the same with all five timed in the same rounds, the
median of the per-round shares. ``ce_link_GBps`` is the copy engines' rate for the same crossing
bytes in the same run (the copy-engine all-gather of them), the yardstick of ``dispatch_vs_ce``
and ``combine_vs_ce``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import collectives as C
from overlap.layers import MoELayer
from overlap.moe import MOE_TUNE_MIN_SPEEDUP, GroupedSwiGLU, MoEDispatcher, PeerTransport

from .harness import _align, _slowest, paired_hidden_share, paired_ratio, time_interleaved
from .harness import time_fn as _time

__all__ = ["MoERecord", "measure_config", "format_moe_table", "plot_moe", "tuned_moe_table", "micro_batches_of"]


LOW_LATENCY_MAX_TOKENS = 256  # configurations timed on the low-latency path too (decode)
# the two terms whose smaller one an overlap hides: the forward's, and the training step's
FORWARD_TERMS = (("experts",), ("dispatch", "combine"))
TRAIN_TERMS = (("experts",), ("exchange",))


@dataclass
class MoERecord:
    config: str
    tokens: int
    hidden: int
    ffn_hidden: int
    experts: int
    top_k: int
    world: int
    dtype: str
    device: str
    bytes_sent: int
    dispatch_us: float
    dispatch_GBps: float
    combine_us: float
    combine_GBps: float
    a2a_us: float           # the backend's all_to_all_single on the same rows
    a2a_GBps: float
    experts_us: float
    sequential_us: float
    pipelined_us: float
    chunks: int | str       # token chunks, "sources" or "auto" (forward_pipelined(chunks=...))
    hidden_pct: float
    wrong: int              # output elements of the pipelined and the pieced forward off the plain one (float32;
    #                         chunks "sources" and "auto" in the run's dtype, at 2^-5)
    pieces: int = 1         # the dispatcher's exchange_pieces
    transport: str = "nccl"  # the dispatcher's transport
    train_us: float = 0.0   # dispatch -> experts -> combine, forward and backward (x, weights, experts)
    # transport "peer": the low-latency (padded) dispatch and combine, eagerly and replayed from a
    # CUDA graph, and NCCL's all-to-all of the same rows replayed from a graph
    ll_dispatch_us: float = 0.0
    ll_combine_us: float = 0.0
    ll_dispatch_graph_us: float = 0.0
    ll_combine_graph_us: float = 0.0
    a2a_graph_us: float = 0.0
    routing: str = ""       # where the dispatcher's routing was worked out: "host" (numpy) or "device"
    pipeline: str = ""      # how the pipelined forward moved rows: "copy_engine" or "sm" (peer), "nccl"
    # the median over rounds of the sequential forward's time over the pipelined one's in the same
    # round (both timed in the same rounds: bench.harness.time_interleaved)
    speedup_paired: float = 0.0
    # chunks "sources" on CUDA: one traced call after the timing, [rank, step, microseconds from
    # that rank's first step to the end of this one] (PeerRows.timeline; the ranks start together)
    timeline: list[list[Any]] = field(default_factory=list)
    # chunks "auto": what it ran, and why (MoEDispatcher.last_chunks: a tuned table, or one chunk)
    auto_ran: str = ""
    # the layer (MoELayer: its router in front of the same dispatcher and experts) at one chunk and
    # at this record's chunks, timed in the same rounds, and the median of their per-round ratio
    layer_sequential_us: float = 0.0
    layer_pipelined_us: float = 0.0
    layer_speedup_paired: float = 0.0
    bytes_crossing: int = 0         # the bytes of bytes_sent bound for other ranks (what crosses the link)
    dispatch_link_GBps: float = 0.0  # bytes_crossing over the dispatch's and the combine's time
    combine_link_GBps: float = 0.0
    ideal_us: float = 0.0           # max(experts, dispatch + combine)
    hidden_small_pct: float = 0.0   # (sequential - pipelined) / min(experts, dispatch + combine)
    # the training step (forward + backward, as train_us) through this record's pipeline, timed in
    # the same rounds as train_us, and the median of their per-round ratio (a pipeline without
    # autograd runs one chunk when gradients are wanted)
    train_pipelined_us: float = 0.0
    train_speedup_paired: float = 0.0
    train_hidden_small_pct: float = 0.0
    # the same share measured: the experts' forward + backward alone and the exchange's (dispatch,
    # then combine of the rows as they came, forward + backward) alone, timed in the training
    # steps' rounds; the median of the per-round shares, in %
    train_hidden_small_paired_pct: float = 0.0
    # the FP8 dispatch (dispatch(fp8=True), where the transport takes it: "nccl", "peer"; hidden % 128 == 0):
    # its time, and the layer's error with it and without it, each the RMS of (out - ref) over
    # the RMS of ref, ref the float32 forward (0.0 where not run)
    fp8_dispatch_us: float = 0.0
    fp8_rms_err: float = 0.0
    plain_rms_err: float = 0.0
    fp8_vs_plain_dispatch: float = 0.0  # the FP8 dispatch's time over the plain one's, paired by round
    # the pipelined forward's share of the smaller term hidden, its five times in the same rounds
    hidden_small_paired_pct: float = 0.0
    # the copy engines moving bytes_crossing in the same run (CUDA, 2+ ranks of one node; else 0.0),
    # and the dispatch's and combine's link rates as fractions of it
    ce_link_GBps: float = 0.0
    dispatch_vs_ce: float = 0.0
    combine_vs_ce: float = 0.0
    # decode: the low-latency dispatch's and combine's graph replays over NCCL's all-to-all's,
    # the three in the same rounds, paired by round
    ll_dispatch_vs_a2a_graph: float = 0.0
    ll_combine_vs_a2a_graph: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def measure_config(comm: C.Communicator, name: str, tokens: int, hidden: int, ffn_hidden: int, experts: int,
                   top_k: int, dtype: torch.dtype, device: torch.device, *,
                   chunk_counts: tuple[int | str, ...] = (2, 4),
                   iters: int = 5, reps: int = 3, seed: int = 0, pieces: int = 1,
                   transport: str = "nccl", routing: str = "auto", transfers: tuple[str, ...] = ("auto",)
                   ) -> list[MoERecord]:
    """One record per chunk count, and over the peer transport per ``transfers`` setting of its
    pipeline (``MoEDispatcher(pipeline_transfers=...)``); the sequential figures repeat in each.
    A chunk count "sources" is the pipeline by source rank (peer transport, its buffers sized for
    copy engines; one record, whatever ``transfers``), checked in the run's dtype against the
    float32 reference at that dtype's tolerance (it runs the experts' bf16/fp16 kernels only).
    A chunk count "micro<n>" is ``forward_micro_batches(micro_batches=n)`` (any transport, with
    autograd), checked like the chunk counts in float32.
    A chunk count "auto" is ``forward_pipelined(chunks="auto")`` (a tuned table's choice, or one
    chunk), checked the same way; ``auto_ran`` says what it ran. Each record also times the layer,
    ``MoELayer`` (its router, then ``forward_pipelined``) over the same dispatcher and experts, at
    one chunk and at the record's chunks (the same calls as the checked ones, behind a router).
    The dispatcher moves its rows in ``pieces`` (``MoEDispatcher(exchange_pieces=...)``) over
    ``transport`` (over NCCL with its ``routing``), checked against one piece over NCCL (or Gloo)
    planned on the host."""
    g = torch.Generator(device=device)
    g.manual_seed(seed * 7919 + comm.rank)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)
    idx = torch.rand(tokens, experts, generator=g, device=device).topk(top_k, dim=-1).indices
    w = torch.rand(tokens, top_k, generator=g, device=device).to(dtype)
    bounds: dict[str, Any] = {"max_tokens": tokens, "top_k": top_k} if transport == "peer" else {"routing": routing}
    # buffers sized for the copy engines where a run may take them ("auto" may pick the pipeline by source)
    if transport == "peer" and ("copy_engine" in transfers or {"sources", "auto"} & set(chunk_counts)):
        bounds["pipeline_transfers"] = "copy_engine"
    disp = MoEDispatcher(experts, hidden, comm.group, dtype=dtype, device=device, exchange_pieces=pieces,
                         transport=transport, **bounds)
    where = disp.routes_on_device(idx)  # where its routing is worked out (the record's `routing`)
    mlp = GroupedSwiGLU(disp.local_experts, hidden, ffn_hidden, dtype=dtype, device=device)
    # the layer: a router (the same on every rank) in front of this dispatcher and these experts
    layer = MoELayer(hidden, ffn_hidden, experts, top_k, comm.group, dtype=dtype, device=device)
    layer.dispatcher, layer.experts = disp, mlp
    with torch.no_grad():
        recv, handle = disp.dispatch(x, idx, w)
        y = mlp(recv, handle.tokens_per_expert)
        es = x.element_size()
        sent_bytes = sum(handle.send_counts) * hidden * es
        crossing = (sum(handle.send_counts) - handle.send_counts[comm.rank]) * hidden * es
        fp8 = disp.transport_impl.packed_rows and hidden % 128 == 0
        dispatches = {"plain": lambda: disp.dispatch(x, idx, w)}
        if fp8:
            dispatches["fp8"] = lambda: disp.dispatch(x, idx, w, fp8=True)
        d_rounds: dict[str, list[float]] = {}
        d_times = time_interleaved(dispatches, comm, device, iters, reps, rounds=d_rounds)
        t_dispatch, t_fp8 = d_times["plain"], d_times.get("fp8", 0.0)
        t_experts = _time(lambda: mlp(recv, handle.tokens_per_expert), comm, device, iters, reps)
        t_combine = _time(lambda: disp.combine(y, handle, w), comm, device, iters, reps)
        # NCCL's all-to-all of the same rows (the host-planned handle: the same counts, and which
        # token each sent row is)
        plain = handle if handle.token_of.numel() or not sum(handle.send_counts) else disp.route(idx)
        rows = x.index_select(0, plain.token_of)
        out = rows.new_empty((sum(plain.recv_counts), hidden))
        t_a2a = _time(lambda: dist.all_to_all_single(out, rows, plain.recv_counts, plain.send_counts,
                                                     group=comm.group), comm, device, iters, reps)
        t_seq = _time(lambda: disp.forward(x, idx, w, mlp), comm, device, iters, reps)
        ce = _ce_rate(comm, crossing, dtype, device, iters, reps)
        # the low-latency path (where the transport offers it) is for decode-sized batches: its
        # blocks hold W x tokens rows per expert
        decode = disp.offers_low_latency and tokens <= LOW_LATENCY_MAX_TOKENS
        low = _low_latency(disp, mlp, x, idx, w, comm, device, iters, reps, out, rows, plain) if decode else {}
    # a training step of the layer's exchange and experts: gradients to x, the weights, the experts
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    gout = torch.randn(tokens, hidden, generator=g, device=device).to(dtype)

    def train(k: int | str = 1) -> None:
        _pipeline(disp, xg, idx, wg, mlp, k)().backward(gout)

    recv_g = recv.detach().clone().requires_grad_()
    gy = torch.randn(y.shape, generator=g, device=device).to(dtype)

    def experts_train() -> None:
        mlp(recv_g, handle.tokens_per_expert).backward(gy)

    def exchange_train() -> None:
        rows, h = disp.dispatch(xg, idx, wg)
        disp.combine(rows, h, wg).backward(gout)

    t_train = _time(train, comm, device, iters, reps)
    with torch.no_grad():
        # The check runs in float32 (a copy of the experts): chunking changes the experts' GEMM
        # shapes and so the rounding of a bf16 run, by more than any fixed tolerance of the result.
        mlp32 = GroupedSwiGLU(disp.local_experts, hidden, ffn_hidden, dtype=torch.float32, device=device)
        mlp32.load_state_dict({n: t.float() for n, t in mlp.state_dict().items()})
        disp32 = MoEDispatcher(experts, hidden, comm.group, dtype=torch.float32, device=device, exchange_pieces=pieces,
                               transport=transport, **bounds)
        # the reference plans its routing on the host, whatever the others do
        one_piece = MoEDispatcher(experts, hidden, comm.group, dtype=torch.float32, device=device, routing="host")
        ref = one_piece.forward(x.float(), idx, w.float(), mlp32)

        def off(got: torch.Tensor) -> int:
            return int(((got - ref).abs() > 1e-4 * (ref.abs() + ref.abs().mean() + 1e-12)).sum())

        wrong_seq = off(disp32.forward(x.float(), idx, w.float(), mlp32))

        def rms_err(got: torch.Tensor) -> float:
            # (summed over the group: every rank reports the layer's error)
            sums = torch.stack([((got.float() - ref) ** 2).sum(), (ref ** 2).sum()]).double()
            C.all_reduce(sums, group=comm.group)
            return float((sums[0] / sums[1]).sqrt()) if sums[1] > 0 else 0.0

        errs = {"fp8_dispatch_us": t_fp8, "fp8_rms_err": rms_err(disp.forward(x, idx, w, mlp, fp8=True)),
                "plain_rms_err": rms_err(disp.forward(x, idx, w, mlp)),
                "fp8_vs_plain_dispatch": paired_ratio(d_rounds, "fp8", "plain")} if fp8 else {}
        if decode:  # the low-latency path against the same reference
            rv, hl = disp32.dispatch_low_latency(x.float(), idx)
            wrong_seq += off(disp32.combine_low_latency(mlp32.forward_padded(rv), hl, w.float()))
        records = []
        runs = [(k, tr) for k, tr in itertools.product(chunk_counts, transfers if transport == "peer" else ("auto",))
                if k != "sources"] + [("sources", "copy_engine") for k in chunk_counts
                                      if k == "sources" and transport == "peer"]
        for k, tr in runs:
            disp.pipeline_transfers = disp32.pipeline_transfers = tr
            if k in ("sources", "auto"):  # the run's dtype: 2^-5 of each element's size (and the mean's)
                got = disp.forward_pipelined(x, idx, w, mlp, chunks=k).float()
                wrong = int(((got - ref).abs() > 2 ** -5 * (ref.abs() + ref.abs().mean() + 1e-12)).sum()) + wrong_seq
            else:
                wrong = off(_pipeline(disp32, x.float(), idx, w.float(), mlp32, k)()) + wrong_seq
            rounds: dict[str, list[float]] = {}
            both = time_interleaved({"sequential": lambda: disp.forward(x, idx, w, mlp),
                                     "pipelined": _pipeline(disp, x, idx, w, mlp, k),
                                     "experts": lambda: mlp(recv, handle.tokens_per_expert),
                                     "dispatch": lambda: disp.dispatch(x, idx, w),
                                     "combine": lambda: disp.combine(y, handle, w)},
                                    comm, device, iters, reps, rounds=rounds)
            t_pipe = both["pipelined"]
            # (read before the layer's calls below set last_chunks again)
            auto_ran = f"{disp.last_chunks[0]} ({disp.last_chunks[1]})" if k == "auto" and disp.last_chunks else ""
            layer_rounds: dict[str, list[float]] = {}
            layer_t = time_interleaved({"sequential": functools.partial(_layer_at, layer, x, 1),
                                        "pipelined": functools.partial(_layer_at, layer, x, k)},
                                       comm, device, iters, reps, rounds=layer_rounds)
            timeline = _timeline(disp, functools.partial(disp.forward_pipelined, x, idx, w, mlp, chunks=k), comm,
                                 device) if k == "sources" and device.type == "cuda" else []
            comm_us = t_dispatch + t_combine
            small = min(t_experts, comm_us)
            with torch.enable_grad():
                train_rounds: dict[str, list[float]] = {}
                train_t = time_interleaved({"sequential": train, "pipelined": functools.partial(train, k),
                                            "experts": experts_train, "exchange": exchange_train},
                                           comm, device, iters, reps, rounds=train_rounds)
            how = disp.last_pipeline[0] if disp.last_pipeline else transport  # the transport's record, if it keeps one
            records.append(MoERecord(
                name, tokens, hidden, ffn_hidden, experts, top_k, comm.size, str(dtype).removeprefix("torch."),
                str(device), sent_bytes, t_dispatch, sent_bytes / t_dispatch / 1e3, t_combine,
                sent_bytes / t_combine / 1e3, t_a2a, sent_bytes / t_a2a / 1e3, t_experts, t_seq, t_pipe, k,
                100 * (t_seq - t_pipe) / comm_us if comm_us else 0.0, wrong, pieces, transport, t_train, **low,
                routing="device" if where else "host", pipeline=how,
                speedup_paired=paired_ratio(rounds, "sequential", "pipelined"), timeline=timeline,
                auto_ran=auto_ran, layer_sequential_us=layer_t["sequential"], layer_pipelined_us=layer_t["pipelined"],
                layer_speedup_paired=paired_ratio(layer_rounds, "sequential", "pipelined"),
                bytes_crossing=crossing, dispatch_link_GBps=crossing / t_dispatch / 1e3,
                combine_link_GBps=crossing / t_combine / 1e3, ideal_us=max(t_experts, comm_us),
                hidden_small_pct=100 * (t_seq - t_pipe) / small if small else 0.0,
                hidden_small_paired_pct=paired_hidden_share(rounds, "sequential", "pipelined", FORWARD_TERMS),
                ce_link_GBps=ce,
                dispatch_vs_ce=crossing / t_dispatch / 1e3 / ce if ce else 0.0,
                combine_vs_ce=crossing / t_combine / 1e3 / ce if ce else 0.0,
                train_pipelined_us=train_t["pipelined"],
                train_speedup_paired=paired_ratio(train_rounds, "sequential", "pipelined"),
                # the training step's smaller term: the forward's, twice (the backward repeats both)
                train_hidden_small_pct=100 * (train_t["sequential"] - train_t["pipelined"]) / (2 * small)
                if small else 0.0, train_hidden_small_paired_pct=paired_hidden_share(
                    train_rounds, "sequential", "pipelined", TRAIN_TERMS), **errs))
    disp.close()
    disp32.close()
    return records


def micro_batches_of(k: int | str) -> int:
    """``n`` of a chunk count "micro<n>" (``forward_micro_batches``), else 0."""
    return int(k[5:]) if isinstance(k, str) and k.startswith("micro") and k[5:].isdigit() else 0


def _pipeline(disp: MoEDispatcher, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, mlp: GroupedSwiGLU,
              k: int | str) -> Callable[[], torch.Tensor]:
    """The forward a record's chunk count names: ``forward_micro_batches`` at "micro<n>", else
    ``forward_pipelined(chunks=k)`` (at 1: ``forward``)."""
    if micro_batches_of(k):
        return functools.partial(disp.forward_micro_batches, x, idx, w, mlp, micro_batches_of(k))
    if k == 1:
        return functools.partial(disp.forward, x, idx, w, mlp)
    return functools.partial(disp.forward_pipelined, x, idx, w, mlp, chunks=k)


def _layer_at(layer: MoELayer, x: torch.Tensor, chunks: int | str) -> torch.Tensor:
    n = micro_batches_of(chunks)
    layer.chunks, layer.micro_batches = ("auto", n) if n else (chunks, 1)
    return layer(x)


def _timeline(disp: MoEDispatcher, call: Callable[[], object], comm: C.Communicator,
              device: torch.device) -> list[list[Any]]:
    """One call of the peer transport's pipeline traced (``PeerRows.trace``), the ranks lined up
    on their GPUs first; every rank's steps, on every rank. The traced call follows an untraced
    one without a wait, as in a loop of calls: a call that starts on an idle GPU is timed by how
    fast the host issues its first steps."""
    peer = disp.transport_impl
    assert isinstance(peer, PeerTransport)  # (called for chunks "sources", the peer transport's)
    rows = peer.rows()
    _align(comm, device)
    call()
    rows.trace = []
    try:
        call()
        mine = rows.timeline()
    finally:
        rows.trace = None
    every: list[Any] = [None] * comm.size
    dist.all_gather_object(every, mine, group=comm.group)
    return [[q, step, us] for q, steps in enumerate(every) for step, us in steps]


def _low_latency(disp: MoEDispatcher, mlp: GroupedSwiGLU, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                 comm: C.Communicator, device: torch.device, iters: int, reps: int, out: torch.Tensor,
                 rows: torch.Tensor, plain: Any) -> dict[str, float]:
    """The low-latency dispatch and combine, eagerly and (on CUDA) replayed from a graph of an even
    number of calls (the transport's buffer halves alternate), beside NCCL's all-to-all of the
    same rows replayed the same way."""
    rv, h = disp.dispatch_low_latency(x, idx)
    y = mlp.forward_padded(rv, h.tokens_per_expert)
    got = {"ll_dispatch_us": _time(lambda: disp.dispatch_low_latency(x, idx), comm, device, iters, reps),
           "ll_combine_us": _time(lambda: disp.combine_low_latency(y, h, w), comm, device, iters, reps)}
    if device.type == "cuda":
        n = iters + iters % 2
        rounds: dict[str, list[float]] = {}
        t = time_interleaved({"dispatch": lambda: disp.dispatch_low_latency(x, idx),
                              "combine": lambda: disp.combine_low_latency(y, h, w),
                              "a2a": lambda: dist.all_to_all_single(out, rows, plain.recv_counts, plain.send_counts,
                                                                    group=comm.group)},
                             comm, device, n, reps, graph=True, rounds=rounds)
        got.update(ll_dispatch_graph_us=t["dispatch"], ll_combine_graph_us=t["combine"], a2a_graph_us=t["a2a"],
                   ll_dispatch_vs_a2a_graph=paired_ratio(rounds, "dispatch", "a2a"),
                   ll_combine_vs_a2a_graph=paired_ratio(rounds, "combine", "a2a"))
    return got


def _ce_rate(comm: C.Communicator, crossing: int, dtype: torch.dtype, device: torch.device, iters: int,
             reps: int) -> float:
    """GB/s of the copy engines moving a rank's crossing bytes to the other ranks: the copy-engine
    all-gather of ``crossing / (world - 1)`` bytes per rank, the largest ``crossing`` of any rank
    (an all-gather's shards are alike; 0.0 where it cannot run)."""
    if device.type != "cuda" or comm.size < 2:
        return 0.0
    crossing = int(_slowest(comm, [float(crossing)], device)[0])  # routing differs by rank
    if not crossing:
        return 0.0
    es = torch.empty((), dtype=dtype).element_size()
    n = max(1, crossing // (comm.size - 1) // es)
    shard = torch.randn(n, device=device).to(dtype)
    out = shard.new_empty(n * comm.size)
    try:
        C.all_gather_single(out, shard, algorithm="copy_engine", group=comm.group)
    except C.UnsupportedError:  # not GPUs of one node, say: the same answer on every rank
        return 0.0
    t = _time(lambda: C.all_gather_single(out, shard, algorithm="copy_engine", group=comm.group), comm, device,
              iters, reps)
    return n * es * (comm.size - 1) / t / 1e3


_TUNE_KEY = ("transport", "pieces", "dtype", "device_type", "tokens", "hidden", "ffn_hidden", "experts", "top_k")


def tuned_moe_table(records: list[MoERecord], meta: dict[str, Any], into: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """The table ``forward_pipelined(chunks="auto")`` follows (``overlap.set_tuned``,
    ``COMMOPS_OVERLAP_TUNED``): per measured layer, the pipeline with the best paired speedup
    over the sequential forward, if it reached ``MOE_TUNE_MIN_SPEEDUP`` with ``#wrong`` 0; else one
    chunk (records of chunks "auto" are left out). ``into``: a table to add to (its other
    operators' entries kept, its entries for the same layers replaced; measured at the same world
    size)."""
    groups: dict[tuple[Any, ...], list[MoERecord]] = {}
    for r in records:
        if r.chunks == "auto" or micro_batches_of(r.chunks):  # a table's pick, or not forward_pipelined's
            continue
        key = (r.transport, r.pieces, r.dtype, r.device.split(":")[0], r.tokens, r.hidden, r.ffn_hidden, r.experts,
               r.top_k)
        groups.setdefault(key, []).append(r)
    entries = []
    for key, rs in groups.items():
        good = [r for r in rs if r.wrong == 0 and r.speedup_paired >= MOE_TUNE_MIN_SPEEDUP]
        best = max(good or rs, key=lambda r: r.speedup_paired)
        how = f" over {best.pipeline}" if best.pipeline not in ("", "nccl") else ""
        measured = (f"pipelined/{best.chunks}{how}: {best.speedup_paired:.2f}x the sequential forward's speed, "
                    f"paired in the same rounds ({best.pipelined_us:.0f} us), #wrong {best.wrong}")
        if good:
            entry: dict[str, Any] = {"chunks": best.chunks, "pipeline": best.pipeline, "note": measured}
        else:
            entry = {"chunks": 1, "note": f"no pipeline {MOE_TUNE_MIN_SPEEDUP}x faster with #wrong 0 (best: {measured})"}
        entries.append({"op": "moe_forward", **dict(zip(_TUNE_KEY, key)), **entry,
                        "date": meta.get("date", "")})
    table: dict[str, Any] = {"meta": {k: meta[k] for k in ("world", "device", "date", "torch") if k in meta},
                             "entries": entries}
    if into is not None:
        world = into.get("meta", {}).get("world", meta.get("world"))
        if world != meta.get("world"):
            raise ValueError(f"the table to add to was measured at {world} ranks, these records at {meta.get('world')}")
        new = {tuple(e[f] for f in _TUNE_KEY) for e in entries}
        kept = [e for e in into.get("entries", [])
                if e.get("op") != "moe_forward" or tuple(e.get(f) for f in _TUNE_KEY) not in new]
        table = {"meta": {**into.get("meta", {}), **table["meta"]}, "entries": kept + entries}
    return table


def format_moe_table(records: list[MoERecord]) -> str:
    lines = []
    for r in records:
        lines.append(f"{r.config:<14} tokens {r.tokens:>6} h {r.hidden:>5} E {r.experts:>4} k {r.top_k} "
                     f"{r.transport} pieces {r.pieces} routing {r.routing} | dispatch "
                     f"{r.dispatch_us:9.1f} us {r.dispatch_GBps:7.2f} GB/s | combine {r.combine_us:9.1f} us "
                     f"{r.combine_GBps:7.2f} GB/s | all_to_all {r.a2a_us:9.1f} us {r.a2a_GBps:7.2f} GB/s | experts "
                     f"{r.experts_us:9.1f} us | sequential {r.sequential_us:9.1f} us | pipelined/{r.chunks} {r.pipeline} "
                     f"{r.pipelined_us:9.1f} us ({r.hidden_pct:6.1f}% hidden, {r.speedup_paired:.3f}x paired) | train step {r.train_us:9.1f} us "
                     f"#wrong {r.wrong}")
        lines.append(f"{'':<14} crossing {r.bytes_crossing / 1e6:8.2f} MB: dispatch {r.dispatch_link_GBps:7.2f} GB/s, "
                     f"combine {r.combine_link_GBps:7.2f} GB/s"
                     + (f" ({r.dispatch_vs_ce:.2f}x, {r.combine_vs_ce:.2f}x the copy engines' {r.ce_link_GBps:.1f} GB/s)"
                        if r.ce_link_GBps else "")
                     + f" | ideal {r.ideal_us:9.1f} us | smaller term hidden "
                     f"{r.hidden_small_pct:6.1f}% ({r.hidden_small_paired_pct:.1f}% paired) | train step pipelined/{r.chunks} {r.train_pipelined_us:9.1f} us "
                     f"({r.train_speedup_paired:.3f}x paired, {r.train_hidden_small_pct:6.1f}% hidden of twice the "
                     f"forward's smaller term, {r.train_hidden_small_paired_pct:.1f}% of the step's own smaller term, paired)")
        lines.append(f"{'':<14} layer (router included): sequential {r.layer_sequential_us:9.1f} us | pipelined/{r.chunks} "
                     f"{r.layer_pipelined_us:9.1f} us ({r.layer_speedup_paired:.3f}x paired)")
        if r.fp8_dispatch_us:
            lines.append(f"{'':<14} fp8 dispatch {r.fp8_dispatch_us:9.1f} us ({r.fp8_vs_plain_dispatch:.3f}x the "
                         f"{r.dtype} dispatch's time, paired) | layer error (RMS, of float32's) fp8 {r.fp8_rms_err:.2e}, "
                         f"{r.dtype} {r.plain_rms_err:.2e}")
        if r.auto_ran:
            lines.append(f"{'':<14} auto ran: {r.auto_ran}")
        for q in dict.fromkeys(q for q, _, _ in r.timeline):
            steps = " | ".join(f"{step} {us:.0f}" for p, step, us in r.timeline if p == q)
            lines.append(f"{'':<14} rank {q} timeline (us): {steps}")
        if r.ll_dispatch_us:
            lines.append(f"{'':<14} low latency: dispatch {r.ll_dispatch_us:9.1f} us (graph {r.ll_dispatch_graph_us:9.1f}) "
                         f"| combine {r.ll_combine_us:9.1f} us (graph {r.ll_combine_graph_us:9.1f}) | all_to_all graph "
                         f"{r.a2a_graph_us:9.1f} us (dispatch {r.ll_dispatch_vs_a2a_graph:.3f}x, combine "
                         f"{r.ll_combine_vs_a2a_graph:.3f}x it, paired)")
    return "\n".join(lines)


def plot_moe(records: list[MoERecord], path: str, title: str = "") -> None:
    """PNG: per configuration (and exchange_pieces), dispatch and combine against the backend's
    all-to-all (GB/s), and the sequential and pipelined layer times (one bar per chunk count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(r: MoERecord) -> str:
        return r.config + ("" if r.transport == "nccl" else f" {r.transport}") + (f" x{r.pieces}" if r.pieces > 1 else "")

    configs = list(dict.fromkeys(label(r) for r in records))  # a configuration per exchange_pieces
    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 4.5))
    first = [next(r for r in records if label(r) == c) for c in configs]
    xs = range(len(configs))
    for i, (name, key) in enumerate((("dispatch", "dispatch_GBps"), ("combine", "combine_GBps"),
                                     ("all_to_all_single", "a2a_GBps"))):
        ax_bw.bar([x + i * 0.27 for x in xs], [getattr(r, key) for r in first], 0.27, label=name)
    ax_bw.set_xticks([x + 0.27 for x in xs], configs, fontsize=8, rotation=30, ha="right")
    ax_bw.set_ylabel("GB/s sent per rank")
    ax_bw.legend(fontsize=8)

    def sequential(c: str) -> float:
        return next(r for r in records if label(r) == c).sequential_us

    def kind(r: MoERecord) -> str:  # how the pipeline moved rows, where there is a choice
        return "" if r.pipeline in ("", "nccl") else r.pipeline

    def pipelined(k: int | str, how: str, c: str) -> float:
        return next((r.pipelined_us for r in records if label(r) == c and r.chunks == k and kind(r) == how), 0.0)

    bars: list[tuple[str, Callable[[str], float]]] = [("sequential", sequential)]
    for k, how in dict.fromkeys((r.chunks, kind(r)) for r in records):
        bars.append((f"pipelined/{k}" + (f" {how}" if how else ""), functools.partial(pipelined, k, how)))
    width = 0.8 / len(bars)
    for i, (name, value) in enumerate(bars):
        ax_t.bar([x + i * width for x in xs], [value(c) for c in configs], width, label=name)
    ax_t.set_xticks([x + 0.4 - width / 2 for x in xs], configs, fontsize=8, rotation=30, ha="right")
    ax_t.set_ylabel("layer forward (us)")
    ax_t.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
