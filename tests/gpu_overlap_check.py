"""The overlap operators, tensor-parallel layers and MoE layer on GPUs over NCCL (run by
``tests/test_gpu_overlap.py``): ``torchrun --nproc-per-node N tests/gpu_overlap_check.py``.

The same comparisons as the Gloo tests, in float32 on CUDA: each operator and strategy against
its plain reference, a two-layer tensor-parallel MLP (with and without sequence parallelism)
against the unsharded module, and ``MoELayer`` against the single-process MoE, outputs and
gradients. Prints one line per failure; exits non-zero on any.

The checks are grouped in families (``families(device_type)``; ``tests/_checks.py``), which
``--json`` writes with their counts and failures, one pytest case each in
``tests/test_gpu_overlap.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from collectives.errors import InvalidArgumentError  # noqa: E402
from overlap import ops  # noqa: E402
from overlap.layers import ColumnParallelLinear, MoELayer, RowParallelLinear  # noqa: E402
from overlap.moe import GroupedSwiGLU, MoEDispatcher, reference_moe  # noqa: E402
from overlap.moe.peer import PeerDenseState  # noqa: E402
from tests._checks import Checks, report  # noqa: E402

TOL = 2e-4  # float32, sums of a few hundred terms of size ~1
OPS = ("gemm_all_reduce", "gemm_reduce_scatter", "all_gather_gemm")
CASES = (("sequential", 1), ("chunked", 3), ("auto", 1))  # (strategy, chunks) of each operator
CUDA_CASES = (("copy_engine", 1), ("copy_engine", 3), ("copy_engine", 20))
GRAPH_CASES = (("sequential", 1), ("chunked", 2), ("copy_engine", 3))  # captured in a CUDA graph
MLP_STRATEGIES = ("sequential", "chunked")
CUDA_MLP_STRATEGIES = ("copy_engine",)
MOE_LAYERS = (("nccl", 1), ("nccl", 3))  # (transport, exchange pieces)
CUDA_MOE_LAYERS = (("peer", 1),)
# the dispatcher's checks on CUDA, one family each, in the order they run
CUDA_MOE = ("moe_dispatch", "moe_pipeline/prefill", "moe_peer_edges", "moe_refusals", "moe_device_routing",
            "moe_peer_autograd", "moe_low_latency")


def _mlp_family(sequence_parallel: bool, strategy: str) -> str:
    return f"tp_mlp/{'sp/' if sequence_parallel else ''}{strategy}"


def _moe_layer_family(transport: str, pieces: int) -> str:
    return f"moe_layer/{transport}/pieces{pieces}"


def families(device_type: str) -> tuple[str, ...]:
    """The families that a run on ``device_type`` ("cuda" over NCCL, "cpu" over Gloo) records
    checks into."""
    cuda = device_type == "cuda"
    strategies = dict.fromkeys(s for s, _ in CASES + (CUDA_CASES if cuda else ()))
    names = [f"{op}/{s}" for s in strategies for op in OPS]
    if cuda:
        names += ["copy_engine/back_to_back", "copy_engine/large_bf16"]
        names += [f"graphs/{s}" for s, _ in GRAPH_CASES] + ["graphs/auto"]
    names += [_mlp_family(sp, s) for sp in (False, True)
              for s in MLP_STRATEGIES + (CUDA_MLP_STRATEGIES if cuda else ())]
    names += [_moe_layer_family(t, n) for t, n in MOE_LAYERS + (CUDA_MOE_LAYERS if cuda else ())]
    return (*names, *(CUDA_MOE if cuda else ()))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", help="write the results by family here (tests/_checks.py)")
    args = p.parse_args()
    comm = C.init()
    w, r = comm.size, comm.rank
    # CUDA under NCCL; the same checks run on CPU under Gloo (how this script itself is tested)
    dev = torch.device("cuda", torch.cuda.current_device()) if comm.backend_for("cuda") else torch.device("cpu")
    ck = Checks(families(dev.type), r)

    def close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float = TOL) -> None:
        ck.count()
        err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
        scale = want.float().abs().max().item() if want.numel() else 1.0
        if not err <= tol * max(1.0, scale):
            ck.fail(f"rank {r} {what}: max error {err:.3g} (scale {scale:.3g})")

    def captured(fn: Any) -> tuple[torch.cuda.CUDAGraph, Any]:
        """``fn`` warmed up once on a side stream, then captured in a CUDA graph: the graph and
        what ``fn`` returned while it was being captured (the tensors its replays write)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        return graph, out

    g = torch.Generator(device=dev)
    cases = CASES
    if dev.type == "cuda":  # chunks > the 16 (8 for all-reduce) ring slots: slots reused within a call
        cases += CUDA_CASES
    for strategy, chunks in cases:
        for m in (7 * w, 64 * w + w):
            g.manual_seed(100 * m + r)
            a = torch.randn(m, 96, generator=g, device=dev) / 96 ** 0.5
            b = torch.randn(96, 80, generator=g, device=dev)
            ck.begin(f"gemm_all_reduce/{strategy}")
            close(f"gemm_all_reduce {strategy}/{chunks} M={m}", ops.gemm_all_reduce(a, b, strategy=strategy, chunks=chunks),
                  ops.reference_gemm_all_reduce(a, b))
            ck.begin(f"gemm_reduce_scatter/{strategy}")
            close(f"gemm_reduce_scatter {strategy}/{chunks} M={m}",
                  ops.gemm_reduce_scatter(a, b, strategy=strategy, chunks=chunks),
                  ops.reference_gemm_reduce_scatter(a, b))
            ck.begin(f"all_gather_gemm/{strategy}")
            close(f"all_gather_gemm {strategy}/{chunks} M={m}",
                  ops.all_gather_gemm(a, b, strategy=strategy, chunks=chunks), ops.reference_all_gather_gemm(a, b))

    if dev.type == "cuda":
        # all-reduce rows that the ranks do not divide (uneven blocks), and back-to-back calls
        # with fresh data (a race shows as an error that moves)
        ck.begin("copy_engine/back_to_back")
        for i in range(30):
            g.manual_seed(7000 + 10 * i + r)
            m = 5 * w + 1 + i % 3
            a = torch.randn(m, 64, generator=g, device=dev) / 8
            b = torch.randn(64, 48, generator=g, device=dev)
            close(f"gemm_all_reduce copy_engine/4 M={m} call {i}", ops.gemm_all_reduce(a, b, strategy="copy_engine",
                                                                                  chunks=4),
                  ops.reference_gemm_all_reduce(a, b))
            a2 = torch.randn(4 * w, 64, generator=g, device=dev) / 8
            close(f"gemm_reduce_scatter copy_engine/2 call {i}", ops.gemm_reduce_scatter(a2, b, strategy="copy_engine",
                                                                                      chunks=2),
                  ops.reference_gemm_reduce_scatter(a2, b))
            close(f"all_gather_gemm copy_engine/2 call {i}", ops.all_gather_gemm(a2, b, strategy="copy_engine", chunks=2),
                  ops.reference_all_gather_gemm(a2, b))

    if dev.type == "cuda":
        # large bf16 GEMMs whose chunks wrap the ring of the default peer buffers, eagerly and in a
        # CUDA graph: on the GPUs a host call inside the loop can block until the device is idle,
        # which hung these (overlap/_copy_engine.py, "Issue order") while the small cases passed
        ck.begin("copy_engine/large_bf16")
        big_a = torch.empty(4096, 4096, device=dev, dtype=torch.bfloat16)
        big_b = torch.empty(4096, 8192, device=dev, dtype=torch.bfloat16)
        half_a = big_a[:2048]
        for chunks in (2, 32):
            for op, ref, x in ((ops.gemm_all_reduce, ops.reference_gemm_all_reduce, big_a),
                               (ops.gemm_reduce_scatter, ops.reference_gemm_reduce_scatter, big_a),
                               (ops.all_gather_gemm, ops.reference_all_gather_gemm, half_a)):
                name = f"{op.__name__} copy_engine/{chunks} {tuple(x.shape)}x{tuple(big_b.shape)} bf16"
                for i in range(2):
                    g.manual_seed(11000 + 10 * i + chunks + r)
                    big_a.copy_(torch.randn(big_a.shape, generator=g, device=dev) / 64)
                    big_b.copy_(torch.randn(big_b.shape, generator=g, device=dev))
                    close(f"{name} call {i}", op(x, big_b, strategy="copy_engine", chunks=chunks), ref(x, big_b), 1e-2)
                graph, out_big = captured(lambda: op(x, big_b, strategy="copy_engine", chunks=chunks))
                g.manual_seed(12000 + chunks + r)
                big_a.copy_(torch.randn(big_a.shape, generator=g, device=dev) / 64)
                graph.replay()
                close(f"{name} in a CUDA graph", out_big, ref(x, big_b), 1e-2)
                del graph, out_big

    if dev.type == "cuda":
        # under a CUDA graph: each strategy captured once on static inputs, replayed on fresh data
        a_st = torch.empty(6 * w + 3, 64, device=dev)
        b_st = torch.empty(64, 40, device=dev)
        for strategy, chunks in GRAPH_CASES:
            ck.begin(f"graphs/{strategy}")
            for op, ref in ((ops.gemm_all_reduce, ops.reference_gemm_all_reduce),
                            (ops.all_gather_gemm, ops.reference_all_gather_gemm)):
                name = f"{op.__name__} {strategy}/{chunks} in a CUDA graph"
                try:
                    graph, out_st = captured(lambda: op(a_st, b_st, strategy=strategy, chunks=chunks))
                except Exception as exc:  # noqa: BLE001 - reported as a failure, with what raised
                    ck.fail(f"rank {r} {name}: capture raised {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                for i in range(3):
                    g.manual_seed(9000 + 10 * i + r)
                    a_st.copy_(torch.randn(a_st.shape, generator=g, device=dev) / 8)
                    b_st.copy_(torch.randn(b_st.shape, generator=g, device=dev))
                    graph.replay()
                    close(f"{name} replay {i}", out_st, ref(a_st, b_st))
                del graph

        # `auto` under capture follows the table's graph entry (copy_engine) where eagerly it runs
        # the sequence; on a new group, so that the eager warm-up call is what builds the peer buffers
        ck.begin("graphs/auto")
        grp = dist.new_group(list(range(w)))
        entry = {"op": "gemm_all_reduce", "dtype": "float32", "M": a_st.shape[0], "K": 64, "N": 40}
        ops.set_tuned({"meta": {"world": w}, "entries": [{**entry, "graph": False, "strategy": "sequential", "chunks": 1},
                                                         {**entry, "graph": True, "strategy": "copy_engine", "chunks": 3}]})
        try:
            choices: list[Any] = []  # what auto chose in the warm-up call, then in the capture

            def auto_call() -> torch.Tensor:
                out = ops.gemm_all_reduce(a_st, b_st, grp)
                choices.append(ops.last_choice(grp))
                return out

            graph, out_st = captured(auto_call)
            eager, in_graph = choices
            ck.count()
            if (eager.strategy, in_graph.strategy) != ("sequential", "copy_engine"):
                ck.fail(f"rank {r} auto under capture: ran {eager.strategy} eagerly, {in_graph.strategy} captured "
                        f"({in_graph.reason})")
            for i in range(3):
                g.manual_seed(9500 + 10 * i + r)
                a_st.copy_(torch.randn(a_st.shape, generator=g, device=dev) / 8)
                b_st.copy_(torch.randn(b_st.shape, generator=g, device=dev))
                graph.replay()
                close(f"auto (graph entry) in a CUDA graph replay {i}", out_st, ops.reference_gemm_all_reduce(a_st, b_st))
            del graph
        except Exception as exc:  # noqa: BLE001 - reported as a failure, with what raised
            ck.fail(f"rank {r} auto under capture: raised {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            ops.set_tuned(None)

    # tensor-parallel MLP against the unsharded module
    H, S, B = 16 * w, 8 * w, 2
    for sp in (False, True):
        for strategy in MLP_STRATEGIES + (CUDA_MLP_STRATEGIES if dev.type == "cuda" else ()):
            ck.begin(_mlp_family(sp, strategy))
            torch.manual_seed(7)
            ref1, ref2 = torch.nn.Linear(H, 4 * H).to(dev), torch.nn.Linear(4 * H, H).to(dev)
            x = torch.randn(S, B, H, device=dev, requires_grad=True)
            gout = torch.randn(S, B, H, device=dev)
            (ref2(F.gelu(ref1(x))) * gout).sum().backward()
            fc1 = ColumnParallelLinear.from_linear(ref1, sequence_parallel=sp, strategy=strategy, chunks=2)
            fc2 = RowParallelLinear.from_linear(ref2, sequence_parallel=sp, strategy=strategy, chunks=2)
            rows = slice(r * S // w, (r + 1) * S // w)
            xs = (x.detach()[rows] if sp else x.detach()).clone().requires_grad_()
            y = fc2(F.gelu(fc1(xs)))
            (y * (gout[rows] if sp else gout)).sum().backward()
            f = fc1.out_per_rank
            tag = f"mlp sp={sp} {strategy}"
            with torch.no_grad():
                yr = ref2(F.gelu(ref1(x)))
            close(f"{tag} output", y, yr[rows] if sp else yr)
            close(f"{tag} input grad", xs.grad, x.grad[rows] if sp else x.grad)
            close(f"{tag} fc1 weight grad", fc1.weight.grad, ref1.weight.grad[r * f:(r + 1) * f])
            close(f"{tag} fc2 weight grad", fc2.weight.grad, ref2.weight.grad[:, r * f:(r + 1) * f])
            close(f"{tag} fc2 bias grad", fc2.bias.grad, ref2.bias.grad)

    # MoE layer against the single-process MoE (this rank's tokens; experts' grads over all ranks)
    E, k, FF = 4 * w, 2, 48
    torch.manual_seed(11)
    router = torch.nn.Linear(H, E, bias=False).to(dev)
    full = GroupedSwiGLU(E, H, FF, device=dev)
    def moe_layer_check(transport: str, pieces: int) -> None:
        full.zero_grad(set_to_none=True)  # the reference's gradients, fresh for each layer
        router.zero_grad(set_to_none=True)
        layer = MoELayer(H, FF, E, k, device=dev, transport=transport, exchange_pieces=pieces,
                         max_tokens=64 if transport == "peer" else None)
        lo = r * (E // w)
        with torch.no_grad():
            layer.router.weight.copy_(router.weight)
            for name in ("w1", "w2", "w3"):
                getattr(layer.experts, name).copy_(getattr(full, name)[lo:lo + E // w])
        tokens = [16 + 5 * q for q in range(w)]

        def data(q: int) -> tuple[torch.Tensor, torch.Tensor]:
            gq = torch.Generator(device=dev).manual_seed(500 + q)
            return torch.randn(tokens[q], H, generator=gq, device=dev), torch.randn(tokens[q], H, generator=gq, device=dev)

        x, gout = data(r)
        xs = x.clone().requires_grad_()
        out = layer(xs)
        (out * gout).sum().backward()

        def expert(e: int, rows_: torch.Tensor) -> torch.Tensor:
            return (F.silu(rows_ @ full.w1[e]) * (rows_ @ full.w3[e])) @ full.w2[e]

        total = torch.zeros((), device=dev)
        for q in range(w):
            xq, gq = data(q)
            xq = xq.clone().requires_grad_(q == r)
            probs = torch.softmax(router(xq), dim=-1)
            wq, idx = probs.topk(k, dim=-1)
            ref = reference_moe(xq, idx, wq / wq.sum(-1, keepdim=True), expert)
            if q == r:
                close(f"moe {transport}/{pieces} output", out, ref.detach())
                mine = xq
            total = total + (ref * gq).sum()
        total.backward()
        close(f"moe {transport}/{pieces} input grad", xs.grad, mine.grad)
        for name in ("w1", "w2", "w3"):
            close(f"moe {transport}/{pieces} {name} grad", getattr(layer.experts, name).grad, getattr(full, name).grad[lo:lo + E // w])
        layer.close()


    for transport, pieces in MOE_LAYERS + (CUDA_MOE_LAYERS if dev.type == "cuda" else ()):
        ck.begin(_moe_layer_family(transport, pieces))
        moe_layer_check(transport, pieces)
    if dev.type == "cuda":
        # dispatch and combine alone, every transport against one NCCL piece, back to back with
        # fresh routing, in bf16 (the grouped GEMM's dtype) and fp32: dispatch moves rows exactly
        ck.begin("moe_dispatch")
        Ed, kd = 8 * w, 3
        for dtype in (torch.float32, torch.bfloat16):
            plain = MoEDispatcher(Ed, H, dtype=dtype, device=dev)
            others = {(t, n): MoEDispatcher(Ed, H, dtype=dtype, device=dev, transport=t, exchange_pieces=n,
                                            **({"max_tokens": 64, "top_k": kd, "pipeline_transfers": "copy_engine"}
                                               if t == "peer" else {}))
                      for t, n in (("nccl", 4), ("peer", 1))}
            for call in range(10):
                g.manual_seed(800 + 10 * call + r)
                T = 29 + 7 * r + call
                xd = torch.randn(T, H, generator=g, device=dev).to(dtype)
                idx = torch.rand(T, Ed, generator=g, device=dev).topk(kd, dim=-1).indices
                wd = torch.rand(T, kd, generator=g, device=dev).to(dtype)
                with torch.no_grad():
                    recv_ref, h_ref = plain.dispatch(xd, idx)
                    out_ref = plain.combine(recv_ref * 1.5, h_ref, wd)
                    for (t, n), d in others.items():
                        recv, h = d.dispatch(xd, idx)
                        ck.count()
                        if not torch.equal(recv, recv_ref):
                            ck.fail(f"rank {r} dispatch {t}/{n} {dtype} call {call}: rows differ")
                        close(f"combine {t}/{n} {dtype} call {call}", d.combine(recv * 1.5, h, wd), out_ref,
                              tol=TOL if dtype == torch.float32 else 2e-2)
                        # the pipelined forward (no autograd): chunks' exchanges beside the experts
                        for transfers in (("copy_engine", "sm") if t == "peer" else ("auto",)):
                            d.pipeline_transfers = transfers
                            piped = d.forward_pipelined(xd, idx, wd, lambda rows, tpe: rows * 1.5, chunks=3)
                            close(f"forward_pipelined {t}/{n}/{transfers} {dtype} call {call}", piped, out_ref,
                                  tol=TOL if dtype == torch.float32 else 2e-2)
            others[("peer", 1)].close()
        # the no-grad pipeline over NCCL at prefill size, many chunks (its sends come from a side
        # stream, whose memory is reused from chunk to chunk): fp32, against the plain forward
        ck.begin("moe_pipeline/prefill")
        Ep, kp, Hp = 16 * w, 4, 1024
        big = MoEDispatcher(Ep, Hp, dtype=torch.float32, device=dev)
        # and the peer transport's pipeline both ways (copy engines: every copy's arrival a flag
        # waited for on the GPU; SM kernels on a side stream), against the same plain forward
        bigp = MoEDispatcher(Ep, Hp, dtype=torch.float32, device=dev, transport="peer", max_tokens=4200, top_k=kp,
                             pipeline_transfers="copy_engine")
        for call in range(3):
            g.manual_seed(900 + 10 * call + r)
            T = 4096 + 37 * r + call
            xb = torch.randn(T, Hp, generator=g, device=dev)
            idx = torch.rand(T, Ep, generator=g, device=dev).topk(kp, dim=-1).indices
            wb = torch.rand(T, kp, generator=g, device=dev)

            def scaled(rows: torch.Tensor, tpe: list[int]) -> torch.Tensor:
                return torch.cat([t * (1 + e) for e, t in enumerate(rows.split(tpe))])

            with torch.no_grad():
                want = big.forward(xb, idx, wb, scaled)
                for chunks in (4, 8):
                    close(f"forward_pipelined nccl fp32 {T} tokens chunks {chunks} call {call}",
                          big.forward_pipelined(xb, idx, wb, scaled, chunks=chunks), want)
                for transfers in ("copy_engine", "sm"):
                    bigp.pipeline_transfers = transfers
                    for chunks in (2, 5, 8):
                        close(f"forward_pipelined peer/{transfers} fp32 {T} tokens chunks {chunks} call {call}",
                              bigp.forward_pipelined(xb, idx, wb, scaled, chunks=chunks), want)
                        ck.count()
                        if bigp.last_pipeline is None or bigp.last_pipeline[0] != transfers:
                            ck.fail(f"rank {r} peer pipeline asked {transfers}, ran {bigp.last_pipeline}")
        bigp.close()
        # the peer transport's edge cases against NCCL's: a rank without tokens, every token to
        # one expert, capacity drops, a hidden size whose rows are not whole 16-byte packs (the
        # scalar kernels), more local experts of one token than a warp has lanes
        ck.begin("moe_peer_edges")
        cases = [("no tokens on rank 0", 8 * w, 3, None, H, lambda T: T * (r != 0)),
                 ("one expert", 8 * w, 1, None, H, None),
                 ("capacity 0.5", 8 * w, 3, 0.5, H, None),
                 ("odd hidden", 8 * w, 3, None, H + 3, None),
                 ("40 local experts", 40 * w, 36, None, H, None)]
        for what, Ee, kk, cf, Hh, tokens_of in cases:
            for dtype in (torch.float32, torch.bfloat16):
                plain = MoEDispatcher(Ee, Hh, dtype=dtype, device=dev, capacity_factor=cf)
                peer = MoEDispatcher(Ee, Hh, dtype=dtype, device=dev, capacity_factor=cf, transport="peer",
                                     max_tokens=80, top_k=kk)
                for call in range(3):
                    g.manual_seed(900 + 10 * call + r)
                    T = 37 + 11 * r + call
                    T = tokens_of(T) if tokens_of else T
                    xd = torch.randn(T, Hh, generator=g, device=dev).to(dtype)
                    if what == "one expert":
                        idx = torch.full((T, 1), 3, dtype=torch.int64, device=dev)
                    else:
                        idx = torch.rand(T, Ee, generator=g, device=dev).topk(kk, dim=-1).indices
                    wd = torch.rand(T, kk, generator=g, device=dev).to(dtype)
                    with torch.no_grad():
                        recv_ref, h_ref = plain.dispatch(xd, idx)
                        out_ref = plain.combine(recv_ref * 1.5, h_ref, wd)
                        recv, h = peer.dispatch(xd, idx)
                        ck.count()
                        if not torch.equal(recv, recv_ref) or h.dropped != h_ref.dropped:
                            ck.fail(f"rank {r} peer dispatch, {what}, {dtype} call {call}: rows or drops differ")
                        close(f"peer combine, {what}, {dtype} call {call}", peer.combine(recv * 1.5, h, wd), out_ref,
                              tol=TOL if dtype == torch.float32 else 2e-2)
                torch.cuda.synchronize()
                peer.close()
        # a bad routing on one rank: every rank raises the same typed error, nothing hangs, and a
        # good dispatch works afterwards. Over the peer transport planned on the host (a capacity)
        # and laid out on the GPUs (dropless); over NCCL with the routing worked out on the GPUs,
        # where the counts exchange carries every rank's check
        ck.begin("moe_refusals")
        refusals = [("peer, host plan", {"transport": "peer", "max_tokens": 16, "top_k": 2, "capacity_factor": 8.0}),
                    ("peer, device layout", {"transport": "peer", "max_tokens": 16, "top_k": 2}),
                    ("nccl, device routing", {"routing": "device"}),
                    ("nccl, device routing, capacity", {"routing": "device", "capacity_factor": 8.0})]
        for label, options in refusals:
            d = MoEDispatcher(8 * w, H, dtype=torch.float32, device=dev, **options)
            for what, fill, text in (("a repeated expert", 0, "same expert twice"), ("an expert id out of range", 99,
                                                                                         "outside")):
                bad = torch.zeros(4, 2, dtype=torch.int64, device=dev)
                bad[:, 1] = 1 if r == 0 else fill  # rank 1's routing is bad
                ck.count()
                try:
                    d.dispatch(torch.randn(4, H, device=dev), bad)
                    ck.fail(f"rank {r}: {what} on rank 1 raised nothing ({label})")
                except InvalidArgumentError as exc:
                    if text not in str(exc) or (r != 1 and "rank 1" not in str(exc)):
                        ck.fail(f"rank {r}: {what} on rank 1 ({label}): {exc}")
            good = torch.stack([torch.arange(4, device=dev) % (8 * w), (torch.arange(4, device=dev) + 3) % (8 * w)], 1)
            recv, h = d.dispatch(torch.ones(4, H, device=dev), good)
            ck.count()
            if recv.shape[0] != sum(h.tokens_per_expert) or not bool((recv == 1).all()):
                ck.fail(f"rank {r}: dispatch after a refused one ({label}) is wrong")
            d.combine(recv, h, torch.ones(4, 2, device=dev))
            d.close()
        # the routing worked out on the GPUs against the host's plan: fresh random routings,
        # uneven tokens (none on rank 1 once), with and without a capacity
        ck.begin("moe_device_routing")
        for cf in (None, 0.5):
            on_host = MoEDispatcher(8 * w, H, dtype=torch.float32, device=dev, capacity_factor=cf, routing="host")
            on_dev = MoEDispatcher(8 * w, H, dtype=torch.float32, device=dev, capacity_factor=cf, routing="device")
            for call in range(4):
                g.manual_seed(1300 + 10 * call + r)
                T = 0 if (call == 3 and r == 1) else 40 + 17 * r + 5 * call
                xh = torch.randn(T, H, generator=g, device=dev)
                idx = torch.rand(T, 8 * w, generator=g, device=dev).topk(3, dim=-1).indices
                wh = torch.rand(T, 3, generator=g, device=dev)
                with torch.no_grad():
                    rh, hh = on_host.dispatch(xh, idx)
                    rd, hd = on_dev.dispatch(xh, idx)
                    ck.count()
                    if not torch.equal(rh, rd) or hh.dropped != hd.dropped or hh.tokens_per_expert != hd.tokens_per_expert:
                        ck.fail(f"rank {r} device routing, capacity {cf}, call {call}: rows, counts or drops differ")
                    close(f"device routing combine, capacity {cf}, call {call}", on_dev.combine(rd * 1.5, hd, wh),
                          on_host.combine(rh * 1.5, hh, wh))
        # gradients through the peer transport's device layout against NCCL's, x and weights
        ck.begin("moe_peer_autograd")
        Eg, kg = 6 * w, 3
        for dtype, tol in ((torch.float32, TOL), (torch.bfloat16, 3e-2)):
            plain = MoEDispatcher(Eg, H, dtype=dtype, device=dev)
            peer = MoEDispatcher(Eg, H, dtype=dtype, device=dev, transport="peer", max_tokens=64, top_k=kg)
            for call in range(3):
                g.manual_seed(1200 + 10 * call + r)
                T = 21 + 9 * r + 4 * call
                x0 = torch.randn(T, H, generator=g, device=dev).to(dtype)
                idx = torch.rand(T, Eg, generator=g, device=dev).topk(kg, dim=-1).indices
                w0 = torch.rand(T, kg, generator=g, device=dev).to(dtype)
                gout = torch.randn(T, H, generator=g, device=dev).to(dtype)
                grads = []
                for d in (plain, peer):
                    xg, wg = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                    rv, hd = d.dispatch(xg, idx, wg)
                    scale = torch.arange(rv.shape[0], device=dev, dtype=dtype).remainder(5).add(1).unsqueeze(-1)
                    out = d.combine(rv * scale, hd, wg)
                    (out.float() * gout.float()).sum().backward()
                    grads.append((out.detach(), xg.grad, wg.grad))
                ck.count()
                if not isinstance(hd.state, PeerDenseState):
                    ck.fail(f"rank {r}: the dropless peer dispatch with autograd did not use the device layout")
                for name, a_, b_ in zip(("output", "x grad", "weights grad"), grads[1], grads[0]):
                    close(f"peer autograd {name} {dtype} call {call}", a_.float(), b_.float(), tol=tol)
            peer.close()

        # the low-latency (padded) dispatch and combine against NCCL's, eagerly and replayed from one
        # CUDA graph holding dispatch -> experts -> combine on static inputs refilled between replays
        ck.begin("moe_low_latency")
        El, kl, Tmax = 8 * w, 4, 48
        Hl = 128  # a multiple of 64: the experts' Triton kernels take these rows
        for dtype, tol in ((torch.float32, TOL), (torch.bfloat16, 2e-2)):
            plain = MoEDispatcher(El, Hl, dtype=dtype, device=dev)
            peer = MoEDispatcher(El, Hl, dtype=dtype, device=dev, transport="peer", max_tokens=Tmax, top_k=kl)
            experts = GroupedSwiGLU(El // w, Hl, 64, dtype=dtype, device=dev)
            T = 29 + 5 * r  # fixed per rank: the graph's shapes
            x_st = torch.empty(T, Hl, device=dev, dtype=dtype)
            idx_st = torch.empty(T, kl, device=dev, dtype=torch.int64)
            w_st = torch.empty(T, kl, device=dev, dtype=dtype)

            def fill(seed: int) -> None:
                g.manual_seed(seed)
                x_st.copy_(torch.randn(T, Hl, generator=g, device=dev))
                idx_st.copy_(torch.rand(T, El, generator=g, device=dev).topk(kl, dim=-1).indices)
                w_st.copy_(torch.rand(T, kl, generator=g, device=dev))

            def want() -> torch.Tensor:
                rv, hd = plain.dispatch(x_st, idx_st)
                return plain.combine(experts(rv, hd.tokens_per_expert), hd, w_st)

            with torch.no_grad():
                for call in range(3):  # eagerly, the halves alternating
                    fill(1500 + 10 * call + r)
                    rv, hl = peer.dispatch_low_latency(x_st, idx_st)
                    ref_rv, ref_h = plain.dispatch(x_st, idx_st)
                    got = torch.cat([rv[e, :n] for e, n in enumerate(hl.tokens_per_expert.tolist())])
                    ck.count()
                    if hl.tokens_per_expert.tolist() != ref_h.tokens_per_expert or not torch.equal(got, ref_rv):
                        ck.fail(f"rank {r} low-latency dispatch {dtype} call {call}: rows differ")
                    # bf16: only the counted rows of each block (the Triton kernels), on the handle's counts
                    counted = hl.tokens_per_expert if dtype == torch.bfloat16 else None
                    out = peer.combine_low_latency(experts.forward_padded(rv, counted), hl, w_st)
                    close(f"low-latency forward {dtype} call {call}", out, want(), tol=tol)
                    peer.check_routing(hl, idx_st)
                try:
                    def ll_forward() -> torch.Tensor:
                        rv, hl = peer.dispatch_low_latency(x_st, idx_st)
                        counted = hl.tokens_per_expert if dtype == torch.bfloat16 else None
                        return peer.combine_low_latency(experts.forward_padded(rv, counted), hl, w_st)

                    graph, out_st = captured(ll_forward)
                    for rep in range(4):
                        fill(1600 + 10 * rep + r)
                        graph.replay()
                        close(f"low-latency forward in a CUDA graph {dtype} replay {rep}", out_st, want(), tol=tol)
                    del graph
                except Exception as exc:  # noqa: BLE001 - reported as a failure, with what raised
                    ck.fail(f"rank {r} low-latency capture {dtype}: {type(exc).__name__}: {str(exc)[:300]}")
            peer.close()

    failed = report(ck, args.json, "overlap", w)
    C.destroy()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
