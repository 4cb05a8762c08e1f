"""A transport defined here, in one block, and registered with one line, carries every MoE path.

``_PlainAllToAll`` moves the rows with plain ``torch.distributed.all_to_all_single`` (Gloo here)
on the host plan of ``overlap.moe.routing.route_on_host``, and offers a pipelined forward of its
own (every chunk's rows sent asynchronously up front). Each rank registers it for the length of
one call (``_registered``, which unregisters it after) and runs, at 2 and 3 ranks: the
dispatcher's dispatch, combine and forward (dropless and with capacity drops), ``MoELayer``, the
pipelined forward (its own pipeline without autograd, the dispatcher's chunks with autograd,
"auto"), and the MoE benchmark's smallest run. Outputs and gradients are compared with the
single-process definition (``reference_moe``) in float64, on fresh random data of odd sizes, with
token counts that differ between ranks, zero included.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import collectives as C
from collectives.errors import UnsupportedError
from overlap.moe import MoEDispatcher, reference_moe
from overlap.moe.handles import DispatchHandle
from overlap.moe.routing import route_on_host
from overlap.moe.transport import CombineGrads, Experts, Transport, register_transport, unregister_transport
from tests.test_overlap_moe import sharded_layer

NAME = "plain_all_to_all"
H = 5  # an odd width


# -- the transport: one block ---------------------------------------------------------------------
class _PlainAllToAll(Transport):
    """Rows over ``torch.distributed.all_to_all_single``, routed on the host (``route_on_host``)."""

    pipelines_run = 0  # (how often its own pipeline ran, in this process)

    def route(self, topk_idx: torch.Tensor, bounds: list[tuple[int, int]]) -> list[DispatchHandle]:
        return route_on_host(self.setup, topk_idx, bounds)

    def _send(self, x: torch.Tensor, h: DispatchHandle, async_op: bool = False) -> tuple[torch.Tensor, Any]:
        rows = x.index_select(0, h.token_of)
        got = rows.new_empty((sum(h.recv_counts), x.shape[1]))
        work = dist.all_to_all_single(got, rows, h.recv_counts, h.send_counts, group=self.group, async_op=async_op)
        return got, work

    def _back(self, rows: torch.Tensor, h: DispatchHandle) -> torch.Tensor:
        """Rows in recv_x's layout back to their pairs' ranks, in send order."""
        by_source = torch.empty_like(rows)
        by_source[h.regroup] = rows
        out = rows.new_empty((sum(h.send_counts), rows.shape[1]))
        dist.all_to_all_single(out, by_source, h.send_counts, h.recv_counts, group=self.group)
        return out

    @staticmethod
    def _sum(back: torch.Tensor, h: DispatchHandle, weights: torch.Tensor | None) -> torch.Tensor:
        """Each token's (weighted) sum of its returned rows."""
        w = back.new_ones(back.shape[0]) if weights is None else weights.reshape(-1).index_select(0, h.order)
        out = back.new_zeros((h.num_tokens, back.shape[1]))
        return out.index_add(0, h.token_of, back * w.to(back.dtype).unsqueeze(-1))

    def dispatch_rows(self, x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return self._send(x, handle)[0].index_select(0, handle.regroup)

    def dispatch_backward(self, grad_recv: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        return self._sum(self._back(grad_recv, handle), handle, None)

    def combine(self, rows: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle, weights_grad: bool
                ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
        back = self._back(rows.contiguous(), handle)
        return self._sum(back, handle, weights), (back, weights.reshape(-1).index_select(0, handle.order))

    def combine_backward(self, grad_out: torch.Tensor, handle: DispatchHandle,
                         saved: tuple[torch.Tensor | None, ...], wanted: CombineGrads
                         ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        back, w = saved
        assert back is not None and w is not None
        g_rows = grad_out.index_select(0, handle.token_of)
        grad_rows = grad_weights = None
        if wanted.rows:
            scaled = g_rows * w.to(g_rows.dtype).unsqueeze(-1)
            got = scaled.new_empty((sum(handle.recv_counts), scaled.shape[1]))
            dist.all_to_all_single(got, scaled, handle.recv_counts, handle.send_counts, group=self.group)
            grad_rows = got.index_select(0, handle.regroup)
        if wanted.weights:
            flat = torch.zeros(math.prod(wanted.weights_shape), dtype=wanted.weights_dtype, device=grad_out.device)
            flat[handle.order] = (g_rows * back).sum(-1).to(wanted.weights_dtype)
            grad_weights = flat.view(wanted.weights_shape)
        return grad_rows, grad_weights

    def pipeline(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts: Experts,
                 bounds: list[tuple[int, int]]) -> torch.Tensor:
        """Every chunk's rows sent at once, asynchronously; each chunk's experts and combine as its
        rows arrive."""
        type(self).pipelines_run += 1
        handles = self.route(topk_idx, bounds)
        flying = [self._send(x[lo:hi], h, async_op=True) for (lo, hi), h in zip(bounds, handles)]
        outs = []
        for (lo, hi), h, (got, work) in zip(bounds, handles, flying):
            work.wait()
            y = experts(got.index_select(0, h.regroup), h.tokens_per_expert)
            outs.append(self.combine(y, topk_weights[lo:hi], h, False)[0])
        return torch.cat(outs)


@contextlib.contextmanager
def registered(name: str, factory: Any) -> Iterator[None]:
    """Transport ``factory`` registered as ``name`` on this rank for the length of a call, unregistered after."""
    register_transport(name, factory)
    try:
        yield
    finally:
        unregister_transport(name)


def _registered() -> contextlib.AbstractContextManager[None]:
    return registered(NAME, _PlainAllToAll)


# -- the cases ------------------------------------------------------------------------------------
def _params(e: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(70_000 + e)
    w = torch.randn(H, H, generator=g, dtype=torch.float64) / H ** 0.5
    return w, torch.randn(H, generator=g, dtype=torch.float64)


def _expert(e: int, x: torch.Tensor) -> torch.Tensor:
    w, b = _params(e)
    return torch.tanh(x @ w + b)


def _tokens(world: int, seed: int) -> list[int]:
    """Token counts that differ between ranks, one of them zero."""
    g = torch.Generator().manual_seed(seed)
    counts = [int(torch.randint(3, 14, (1,), generator=g)) for _ in range(world)]
    counts[seed % world] = 0
    return counts


def _data(rank: int, tokens: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed * 101 + rank)
    x = torch.randn(tokens, H, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)]) if tokens else \
        torch.empty(0, k, dtype=torch.int64)
    return x, idx, torch.rand(tokens, k, generator=g, dtype=torch.float64)


def _kept(idx: torch.Tensor, E: int, capacity: float | None) -> torch.Tensor:
    """The pairs each expert keeps: its first ``ceil(capacity * pairs / E)`` in token order."""
    if capacity is None or not idx.numel():
        return torch.ones(idx.shape, dtype=torch.bool)
    cap, seen, keep = math.ceil(capacity * idx.numel() / E), [0] * E, []
    for e in idx.reshape(-1).tolist():
        keep.append(seen[e] < cap)
        seen[e] += 1
    return torch.tensor(keep).view(idx.shape)


def _experts_of(disp: MoEDispatcher) -> Experts:
    def run(rows: torch.Tensor, per_expert: list[int]) -> torch.Tensor:
        outs = [_expert(disp.first_expert + e, r) for e, r in enumerate(rows.split(per_expert))]
        return torch.cat(outs) if outs else rows
    return run


def _err(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None or not b.numel():
        return 0.0 if (a is None or not a.numel()) and (b is None or not b.numel()) else math.inf
    return (a - b).abs().max().item()


def _dispatcher_case(rank: int, world: int, seed: int, k: int, capacity: float | None) -> dict[str, Any]:
    with _registered():
        E = 3 * world
        tokens = _tokens(world, seed)
        x, idx, w = _data(rank, tokens[rank], E, k, seed)
        disp = MoEDispatcher(E, H, dtype=torch.float64, capacity_factor=capacity, transport=NAME)
        assert disp.transport == NAME and isinstance(disp.transport_impl, _PlainAllToAll)
        local = _experts_of(disp)
        keep = _kept(idx, E, capacity)
        gout = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + rank), dtype=torch.float64)
        errs: dict[str, float] = {}

        def ref() -> tuple[torch.Tensor, ...]:
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = reference_moe(xr, idx, wr * keep, _expert)
            if out.requires_grad:
                (out * gout).sum().backward()
            return out.detach(), xr.grad, wr.grad

        want, want_gx, want_gw = ref()
        # dispatch -> experts -> combine, with autograd to x and the weights
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        recv, handle = disp.dispatch(xs, idx, ws)
        assert recv.shape == (sum(handle.tokens_per_expert), H) and handle.state is None
        assert handle.dropped == int((~keep).sum())
        out = disp.combine(local(recv, handle.tokens_per_expert), handle, ws)
        (out * gout).sum().backward()
        errs["forward"] = max(_err(out.detach(), want), _err(xs.grad, want_gx), _err(ws.grad, want_gw))
        # the pipelined forward: the transport's own pipeline without autograd ...
        before = _PlainAllToAll.pipelines_run
        with torch.no_grad():
            piped = disp.forward_pipelined(x, idx, w, local, chunks=3)
        assert _PlainAllToAll.pipelines_run == before + 1 and disp.last_chunks == (3, "requested by the caller")
        # (each chunk keeps its own capacity)
        parts = [reference_moe(x[lo:hi], idx[lo:hi], w[lo:hi] * _kept(idx[lo:hi], E, capacity), _expert)
                 for lo, hi in ((x.shape[0] * i // 3, x.shape[0] * (i + 1) // 3) for i in range(3))]
        errs["pipeline"] = _err(piped, torch.cat(parts))
        # ... the dispatcher's chunks with autograd (routed ahead, one after another) ...
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        chunked = disp.forward_pipelined(xs, idx, ws, local, chunks=2)
        (chunked * gout).sum().backward()
        assert _PlainAllToAll.pipelines_run == before + 1
        if capacity is None:
            errs["chunks"] = max(_err(chunked.detach(), want), _err(xs.grad, want_gx), _err(ws.grad, want_gw))
        # ... and "auto", which this transport answers with one chunk
        with torch.no_grad():
            auto = disp.forward_pipelined(x, idx, w, local, chunks="auto")
        assert disp.last_chunks == (1, "one chunk: this transport follows no tuned table"), disp.last_chunks
        errs["auto"] = _err(auto, want)
        # what it does not offer is refused by the dispatcher, typed
        with torch.no_grad(), pytest.raises(UnsupportedError, match="low-latency"):
            disp.dispatch_low_latency(x, idx)
        with torch.no_grad(), pytest.raises(UnsupportedError, match="sources"):
            disp.forward_pipelined(x, idx, w, local, chunks="sources")
        return errs


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_registered_transport_carries_dispatch_combine_and_pipelines(worlds, world_size: int) -> None:  # noqa: ANN001
    w = worlds(world_size)
    for seed, (k, capacity) in enumerate([(2, None), (3, None), (1, None), (2, 0.5)]):
        for res in w.run(_dispatcher_case, 10 + seed, k, capacity):
            assert all(v < 1e-12 for v in res.values()), (k, capacity, res)


def _layer_case(rank: int, world: int, seed: int, chunks: int | str) -> float:
    with _registered():
        torch.manual_seed(900 + seed)  # the same reference on every rank
        E, k, FF = 3 * world, 2, 7
        tokens = _tokens(world, seed)
        layer, router, full = sharded_layer(rank, world, H, E, k, FF, transport=NAME, chunks=chunks)
        lo = rank * (E // world)

        def data(q: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(seed * 31 + q)
            return (torch.randn(tokens[q], H, generator=g, dtype=torch.float64),
                    torch.randn(tokens[q], H, generator=g, dtype=torch.float64))

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            return (F.silu(rows @ full.w1[e]) * (rows @ full.w3[e])) @ full.w2[e]

        x, gout = data(rank)
        xs = x.clone().requires_grad_()
        out = layer(xs)
        (out * gout).sum().backward()
        # the reference over every rank's tokens: the experts' gradients sum over them
        loss, mine = torch.zeros((), dtype=torch.float64), None
        for q in range(world):
            xq, gq = data(q)
            xq = xq.clone().requires_grad_(q == rank)
            probs = torch.softmax(router(xq), dim=-1)
            wq, idx = probs.topk(k, dim=-1)
            ref = reference_moe(xq, idx, wq / wq.sum(-1, keepdim=True), expert)
            if q == rank:
                mine = (xq, ref.detach())
            loss = loss + (ref * gq).sum()
        loss.backward()
        assert mine is not None
        errs = [_err(out.detach(), mine[1]), _err(xs.grad, mine[0].grad) if tokens[rank] else 0.0]
        for name in ("w1", "w2", "w3"):
            errs.append(_err(getattr(layer.experts, name).grad, getattr(full, name).grad[lo:lo + E // world]))
        return max(errs)


@pytest.mark.parametrize("world_size", [2, 3])
def test_moe_layer_over_the_registered_transport(worlds, world_size: int) -> None:  # noqa: ANN001
    w = worlds(world_size)
    for seed, chunks in enumerate([1, 2, "auto"]):
        assert max(w.run(_layer_case, 20 + seed, chunks)) < 1e-10, chunks


def _bench_case(rank: int, world: int) -> list[tuple[Any, ...]]:
    from bench.moe_bench import measure_config

    with _registered():
        recs = measure_config(C.get_communicator(), "tiny", 5 + 2 * rank, 7, 12, 3 * world, 2, torch.float32,
                              torch.device("cpu"), chunk_counts=(2, "auto"), iters=1, reps=1, transport=NAME)
    assert all(r.layer_sequential_us > 0 and r.layer_pipelined_us > 0 for r in recs)
    assert recs[1].auto_ran.startswith("1 (one chunk"), recs[1].auto_ran
    return [(r.chunks, r.wrong, r.transport, r.routing, r.pipeline, r.bytes_sent) for r in recs]


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_moe_benchmark_runs_over_the_registered_transport(worlds, world_size: int) -> None:  # noqa: ANN001
    for rank, recs in enumerate(worlds(world_size).run(_bench_case)):
        sent = (5 + 2 * rank) * 2 * 7 * 4  # tokens * k rows of 7 floats
        assert recs == [(2, 0, NAME, "host", NAME, sent), ("auto", 0, NAME, "host", NAME, sent)], recs


def test_the_registry_names_the_transport_only_while_registered() -> None:
    from overlap.moe import registered_transports

    with _registered():
        assert NAME in registered_transports()
        with pytest.raises(ValueError, match="taken"):
            register_transport(NAME, _PlainAllToAll)
    assert NAME not in registered_transports() and registered_transports()[:2] == ["nccl", "peer"]
