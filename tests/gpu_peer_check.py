"""Peer-memory collectives on the GPUs of one node, checked (run by tests/test_gpu_peer.py).

    torchrun --nproc-per-node N tests/gpu_peer_check.py [--json FILE] [--quick]

With a GPU for each rank the group is NCCL's. With more ranks than GPUs the ranks share them
(``tests._checks.shared_gpu_ranks``: peer memory maps a buffer of the same GPU as it maps a
peer GPU's), the group's own traffic goes over Gloo, and the comparison with NCCL becomes a
comparison with Gloo's all-reduce of the same inputs (NCCL refuses two ranks on one GPU).

Every check uses fresh random data (``bench.reference.rank_data`` with a new seed), a float64
expected value computed from every rank's regenerated input, outputs poisoned with NaN before the
call, and the rounding bound of ``bench.reference.tolerance``. Also: every rank's result is the
same bits; the result matches NCCL's (or Gloo's) within the bound; odd sizes, unaligned views (the scalar
path) and messages larger than the slots (pieces); CUDA-graph capture and replay; 1000
back-to-back calls of alternating sizes without a host synchronisation (a race shows as a
wrong element); calls from a thread with no CUDA context of its own; a peer that never arrives
(``CollectiveTimeout`` naming it); repeated calls on the same tensors (the prepared launches); bad arguments rejected before anything is sent. Prints one line per failure and exits non-zero on any.

The checks are grouped in families (``families()``; ``tests/_checks.py``), which ``--json``
writes with their counts and failures, one pytest case each in ``tests/test_gpu_peer.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench.reference import rank_data  # noqa: E402
from collectives import _env, _native, dispatch as _dispatch  # noqa: E402
from collectives.algos import _peer as P, peer  # noqa: E402
from collectives.peer import CE_PUSHED, PeerMemory, peer_memory  # noqa: E402
from tests._checks import Checks, dtype_name, shared_gpu_ranks, write_results  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ONE_SHOT = peer("one_shot")
EPS = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}
ALL_REDUCE = ("one_shot", "two_shot", "copy_engine")  # the algorithms each size and dtype runs
RS_AG = ("one_shot", "copy_engine")  # the same, for reduce-scatter and all-gather
# the checks run once each, a family each
SINGLES = ("back_to_back", "stale_words", "other_thread", "fast_path", "prepared_repeats", "timeout")


def _op_family(op: str, algorithm: str, dtype: torch.dtype, *, pieces: bool = False) -> str:
    return f"{'pieces/' if pieces else ''}{op}/{algorithm}/{dtype_name(dtype)}"


def families(quick: bool = False) -> tuple[str, ...]:
    """The families that a run (``--quick`` or not) records checks into."""
    ops = (("all_reduce", ALL_REDUCE), ("reduce_scatter", RS_AG), ("all_gather", RS_AG))
    names = [_op_family(op, a, d) for d in DTYPES for op, algs in ops for a in algs]
    if not quick:
        names += [_op_family(op, a, d, pieces=True) for d in DTYPES for op, algs in ops for a in algs]
        names += [f"graphs/{dtype_name(d)}" for d in DTYPES]
        names += SINGLES
    return (*names, "bad_arguments")


class ValueChecks:
    """The values every path computes, against float64 references and NCCL, and the failures found."""

    def __init__(self, comm: C.Communicator, checks: Checks, *, shared: bool = False) -> None:
        self.comm = comm
        self.shared = shared  # ranks share GPUs: the group's own traffic is Gloo's, on host tensors
        self.w, self.r = comm.size, comm.rank
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.checks = checks
        self.seed = 1000

    def fresh(self, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's input for a new seed (each rank regenerates all of them)."""
        self.seed += 1
        return [rank_data(q, n, dtype, self.seed, self.dev) for q in range(self.w)]

    def bound(self, terms: list[torch.Tensor], dtype: torch.dtype, avg: bool = False) -> torch.Tensor:
        mag = sum(t.double().abs() for t in terms)
        scale = 1.0 / self.w if avg else 1.0
        # fp32 accumulation of w terms, then one rounding to dtype
        return mag * scale * (EPS[dtype] + self.w * EPS[torch.float32]) * 2 + 1e-30

    def expect(self, what: str, got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> None:
        self.checks.count()
        bad = ~((got.double() - want).abs() <= tol)
        nbad = int(bad.sum())
        if nbad:
            i = int(bad.nonzero()[0])
            self.checks.fail(f"rank {self.r} {what}: {nbad} wrong of {got.numel()}; first at {i}: "
                             f"got {float(got.view(-1)[i])} want {float(want.view(-1)[i])}")

    def same_on_all_ranks(self, what: str, t: torch.Tensor) -> None:
        self.checks.count()
        bits = t.contiguous().view(torch.uint8)
        if self.shared:
            bits = bits.cpu()
        every = [torch.empty_like(bits) for _ in range(self.w)]
        dist.all_gather(every, bits)
        if not all(torch.equal(every[0], e) for e in every):
            self.checks.fail(f"rank {self.r} {what}: ranks hold different bits")

    # -- all-reduce ------------------------------------------------------------------------------
    def all_reduce(self, algorithm: str, n: int, dtype: torch.dtype, *, offset: int = 0, avg: bool = False,
                   pm: PeerMemory | None = None, compare_nccl: bool = True) -> None:
        inputs = self.fresh(n, dtype)
        want = sum(x.double() for x in inputs)
        if avg:
            want = want / self.w
        base = torch.full((n + offset,), float("nan"), dtype=dtype, device=self.dev)
        x = base[offset:]
        x.copy_(inputs[self.r])
        what = f"all_reduce {algorithm} n={n} {dtype} offset={offset}{' avg' if avg else ''}{' pieces' if pm else ''}"
        if pm is None:
            C.all_reduce(x, op="avg" if avg else "sum", algorithm=algorithm)
        else:
            peer(algorithm).all_reduce(pm, x, avg)
        tol = self.bound(inputs, dtype, avg)
        self.expect(what, x, want, tol)
        self.same_on_all_ranks(what, x)
        if compare_nccl and not self.shared:
            y = inputs[self.r].clone()
            dist.all_reduce(y, dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM)
            self.expect(what + " vs NCCL", x, y.double(), 2 * tol)
        elif compare_nccl:  # Gloo has no AVG: its float32 sum, then the mean rounded as NCCL's is
            y = inputs[self.r].float().cpu()
            dist.all_reduce(y)
            y = (y / self.w if avg else y).to(dtype).to(self.dev)
            self.expect(what + " vs Gloo", x, y.double(), 2 * tol)

    def barrier(self) -> None:
        """Every rank here (over Gloo where ranks share GPUs, whose NCCL group is never made)."""
        if self.shared:
            dist.all_reduce(torch.zeros(1))
        else:
            dist.barrier()

    def reduce_scatter(self, m: int, dtype: torch.dtype, *, pm: PeerMemory | None = None, avg: bool = False,
                       algorithm: str = "one_shot") -> None:
        inputs = self.fresh(m * self.w, dtype)
        want = sum(x.double() for x in inputs)[self.r * m:(self.r + 1) * m]
        if avg:
            want = want / self.w
        out = torch.full((m,), float("nan"), dtype=dtype, device=self.dev)
        if pm is None:
            C.reduce_scatter_single(out, inputs[self.r], op="avg" if avg else "sum", algorithm=algorithm)
        else:
            peer(algorithm).reduce_scatter(pm, out, inputs[self.r], avg)
        tol = self.bound([x[self.r * m:(self.r + 1) * m] for x in inputs], dtype, avg)
        self.expect(f"reduce_scatter {algorithm} m={m} {dtype}{' pieces' if pm else ''}", out, want, tol)

    def all_gather(self, m: int, dtype: torch.dtype, *, pm: PeerMemory | None = None,
                   algorithm: str = "one_shot") -> None:
        inputs = self.fresh(m, dtype)
        want = torch.cat(inputs).double()
        out = torch.full((m * self.w,), float("nan"), dtype=dtype, device=self.dev)
        if pm is None:
            C.all_gather_single(out, inputs[self.r], algorithm=algorithm)
        else:
            peer(algorithm).all_gather(pm, out, inputs[self.r])
        self.expect(f"all_gather {algorithm} m={m} {dtype}{' pieces' if pm else ''}", out, want, torch.zeros_like(want))

    # -- CUDA graphs -------------------------------------------------------------------------------
    def graphs(self, n: int, dtype: torch.dtype) -> None:
        for algorithm in ("one_shot", "two_shot", "copy_engine"):
            x = torch.empty(n, dtype=dtype, device=self.dev)
            x.copy_(self.fresh(n, dtype)[self.r])
            C.all_reduce(x, algorithm=algorithm)  # buffers and kernels exist before capture
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                with torch.cuda.graph(g, stream=s):
                    C.all_reduce(x, algorithm=algorithm)
            torch.cuda.current_stream().wait_stream(s)
            for rep in range(5):
                inputs = self.fresh(n, dtype)
                x.copy_(inputs[self.r])
                g.replay()
                torch.cuda.synchronize()
                self.expect(f"graph all_reduce {algorithm} n={n} {dtype} replay {rep}", x,
                            sum(t.double() for t in inputs), self.bound(inputs, dtype))
        for algorithm in ("one_shot", "copy_engine"):
            self.graph_rs_ag(n, dtype, algorithm)

    def graph_rs_ag(self, n: int, dtype: torch.dtype, algorithm: str) -> None:
        m = max(1, n // self.w)
        inp = torch.empty(m * self.w, dtype=dtype, device=self.dev)
        out_rs = torch.empty(m, dtype=dtype, device=self.dev)
        out_ag = torch.empty(m * self.w, dtype=dtype, device=self.dev)
        C.reduce_scatter_single(out_rs, inp.normal_(), algorithm=algorithm)
        C.all_gather_single(out_ag, out_rs, algorithm=algorithm)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            C.reduce_scatter_single(out_rs, inp, algorithm=algorithm)
            C.all_gather_single(out_ag, out_rs, algorithm=algorithm)
        for rep in range(3):
            inputs = self.fresh(m * self.w, dtype)
            inp.copy_(inputs[self.r])
            out_ag.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            full = sum(t.double() for t in inputs)
            # all-gather of the rounded shards: compare with the rounded full sum shard by shard
            self.expect(f"graph reduce_scatter+all_gather {algorithm} m={m} {dtype} replay {rep}", out_ag, full,
                        self.bound(inputs, dtype))

    # -- races -----------------------------------------------------------------------------------
    def back_to_back(self, calls: int, dtype: torch.dtype) -> None:
        sizes = (8191, 3 << 20)  # 1 block and the most blocks, alternately: exercises per-block epochs
        outs = {n: torch.empty(calls // 2, n, dtype=dtype, device=self.dev) for n in sizes}
        seeds = []
        torch.cuda.synchronize()
        for i in range(calls):
            n = sizes[i % 2]
            self.seed += 1
            seeds.append(self.seed)
            x = outs[n][i // 2]
            x.copy_(rank_data(self.r, n, dtype, self.seed, self.dev))
            C.all_reduce(x, algorithm=("two_shot", "one_shot", "copy_engine")[(i // 2) % 3])
        torch.cuda.synchronize()
        wrong = 0
        for i, seed in enumerate(seeds):
            n = sizes[i % 2]
            inputs = [rank_data(q, n, dtype, seed, self.dev) for q in range(self.w)]
            want = sum(t.double() for t in inputs)
            wrong += int((~((outs[n][i // 2].double() - want).abs() <= self.bound(inputs, dtype))).sum())
        self.checks.count()
        if wrong:
            self.checks.fail(f"rank {self.r} {calls} back-to-back calls {dtype}: {wrong} wrong elements")

class Checker(ValueChecks):
    """The paths around the values: repeated calls, stale data, timeouts, other threads, bad arguments."""

    # -- the fast path of repeated calls -------------------------------------------------------------
    def fast_path(self) -> None:
        n, dtype = 12_345, torch.bfloat16
        for rep in range(3):  # the first call resolves the signature, the others repeat it
            self.all_reduce("one_shot", n, dtype, compare_nccl=False)
        self.checks.count()
        named = [dict(zip(_dispatch._FAST_KEY, k)) for k in self.comm._fast]
        keys = [k for k in named if (k["op"], k["algorithm"], k["numel"]) == ("all_reduce", "one_shot", n)]
        if not keys:
            self.checks.fail(f"rank {self.r}: no fast-path entry after repeated one_shot calls")
        seq = self.comm.seq
        self.all_reduce("one_shot", n, dtype, compare_nccl=False)
        if self.comm.seq != seq + 1:
            self.checks.fail(f"rank {self.r}: a fast-path call did not count in comm.seq")
        seen: list[str] = []

        def hook(event: str, call: object, detail: object) -> None:
            seen.append(event)

        C.add_trace_hook(hook)
        try:
            self.all_reduce("one_shot", n, dtype, compare_nccl=False)
        finally:
            C.remove_trace_hook(hook)
        if seen != ["start", "end"]:
            self.checks.fail(f"rank {self.r}: with a trace hook the call went around it ({seen})")

    def prepared_repeats(self) -> None:
        """The fast path's prepared launches (``PeerAlgorithm.runner``): the same tensors called again
        and again with fresh data (a stale parameter block would reduce an old address or size),
        aligned and not, in place and not, above the low-latency limit, then after the grid
        changes (the blocks must be dropped) and back."""
        pm = peer_memory(self.comm)
        grid = pm.block_bytes
        cases = ((4, 0, "one_shot"), (12_345, 0, "one_shot"), (1001, 1, "one_shot"), (70_001, 0, "two_shot"),
                 (300_000, 0, "one_shot"))  # words; whole packs; unaligned; two-shot; above the words' limit
        for dtype in (torch.bfloat16, torch.float32):
            for n, offset, algorithm in cases:
                x = torch.empty(n + offset, dtype=dtype, device=self.dev)[offset:]
                for rep in range(6):
                    if rep == 4:
                        pm.block_bytes = grid // 2
                    inputs = self.fresh(n, dtype)
                    x.copy_(inputs[self.r])
                    C.all_reduce(x, algorithm=algorithm)
                    self.expect(f"prepared all_reduce {algorithm} n={n} {dtype} offset={offset} call {rep}", x,
                                sum(t.double() for t in inputs), self.bound(inputs, dtype))
                pm.block_bytes = grid
            for m in (3000, 4097):  # words; an odd count (scalar entry points)
                out = torch.empty(m, dtype=dtype, device=self.dev)
                full = torch.empty(m * self.w, dtype=dtype, device=self.dev)
                for rep in range(5):
                    inputs = self.fresh(m * self.w, dtype)
                    full.copy_(inputs[self.r])
                    out.fill_(float("nan"))
                    C.reduce_scatter_single(out, full, algorithm="one_shot")
                    mine = [t[self.r * m:(self.r + 1) * m] for t in inputs]
                    self.expect(f"prepared reduce_scatter m={m} {dtype} call {rep}", out,
                                sum(t.double() for t in mine), self.bound(mine, dtype))
                    parts = self.fresh(m, dtype)
                    out.copy_(parts[self.r])
                    full.fill_(float("nan"))
                    C.all_gather_single(full, out, algorithm="one_shot")
                    self.expect(f"prepared all_gather m={m} {dtype} call {rep}", full, torch.cat(parts).double(),
                                torch.zeros((), device=self.dev, dtype=torch.float64))
        self.checks.count()
        kept = pm.state(P.PeerState).ready
        if not any(kept):
            self.checks.fail(f"rank {self.r}: repeated calls on the same tensors kept no prepared launch")
        # the compiled runner's kept launches are one-kernel graphs (the calls above ran through them)
        if _native.status() == "loaded" and _env.GRAPH_LAUNCH.get():
            self.checks.count()
            kinds = {len(e) for ready in kept for e in ready.values()}
            if kinds != {6}:
                self.checks.fail(f"rank {self.r}: kept launches of lengths {sorted(kinds)}, not one-kernel "
                                     f"graphs ({len(P._GRAPHS_FAILED)} failures: {P._GRAPHS_FAILED[:1]})")

    def stale_words(self) -> None:
        """A larger one-shot call leaves raw data in the slots whose 8-byte words carry, in their
        high half, the number of the low-latency call two calls later (the same set); with a
        late peer that call must still wait for the peer's own words. (With the words in the
        slots, it summed the stale data.)"""
        pm = PeerMemory(self.comm, slot_bytes=8 << 20)
        n_big, n_small = 1 << 18, 4096  # 512 KB (above the low-latency limit) and 8 KB of bf16
        tiny = torch.ones(8, dtype=torch.bfloat16, device=self.dev)
        ONE_SHOT.all_reduce(pm, tiny)  # kernels compiled, the first call behind us
        torch.cuda.synchronize()
        target = int(pm._calls[0].item()) + 3  # the number of the third call from here
        big = torch.randn(n_big, device=self.dev).to(torch.bfloat16)
        words = big.view(torch.int16).view(-1, 4)
        for col, half in ((2, target & 0xFFFF), (3, (target >> 16) & 0xFFFF)):  # bits 32-63: the number
            words[:, col] = half - (1 << 16) if half >= 1 << 15 else half
        ONE_SHOT.all_reduce(pm, big)  # raw data into the peers' slots of this set
        ONE_SHOT.all_reduce(pm, tiny)  # the other set
        inputs = self.fresh(n_small, torch.bfloat16)
        x = inputs[self.r].clone()
        torch.cuda.synchronize()
        self.barrier()
        if self.r == self.w - 1:
            torch.cuda._sleep(50_000_000)  # a late peer: tens of milliseconds
        ONE_SHOT.all_reduce(pm, x)
        torch.cuda.synchronize()
        self.expect("one_shot low-latency words after stale raw data, a late peer", x,
                    sum(t.double() for t in inputs), self.bound(inputs, torch.bfloat16))
        self.barrier()
        pm.close()

    # -- faults and bad arguments ------------------------------------------------------------------
    def timeout(self) -> None:
        pm = PeerMemory(self.comm, slot_bytes=1 << 20, timeout_s=0.5)
        x = torch.randn(4096, device=self.dev)
        raised = None
        if self.r == 0:  # rank 0 calls, the others never do
            t0 = time.perf_counter()
            ONE_SHOT.all_reduce(pm, x)
            torch.cuda.synchronize()
            waited = time.perf_counter() - t0
            try:
                pm.check()
            except C.CollectiveTimeout as exc:
                raised = exc
            self.checks.count()
            missing = sorted(set(range(1, self.w)))
            if raised is None:
                self.checks.fail("rank 0: no CollectiveTimeout after a peer skipped the call")
            elif raised.missing[0] not in missing or not 0.4 < waited < 10:
                self.checks.fail(f"rank 0: timeout named {raised.missing} after {waited:.2f} s; want one of "
                                 f"{missing} after about 0.5 s")
            try:
                ONE_SHOT.all_reduce(pm, x)  # the next call refuses to run
                self.checks.fail("rank 0: a call after a timeout ran")
            except C.CollectiveTimeout:
                pass
        self.barrier()
        pm.close()
        # The copy-engine path: its copy streams wait with stream memory operations, which the
        # kernels' bounded waits must release when a peer never comes.
        pm = PeerMemory(self.comm, slot_bytes=1 << 20, timeout_s=0.5)
        pm.ce_chunk_bytes = pm.ce_all_reduce_chunk_bytes = 64 << 10
        y = torch.randn(1 << 20, device=self.dev)
        if self.r == 0:
            t0 = time.perf_counter()
            peer("copy_engine").all_reduce(pm, y)
            torch.cuda.synchronize()
            waited = time.perf_counter() - t0
            self.expect_timeout(pm, "a peer skipped a copy-engine call", waited,
                                lambda exc: bool(exc.missing) and waited <= 20)
        self.barrier()
        pm.close()
        # An operator's copy-engine section: its stream waits (no kernel) are bounded by the
        # section's watchdog alone. Every rank opens; rank 0's copy stream waits for a flag
        # that no peer ever signals.
        pm = PeerMemory(self.comm, slot_bytes=1 << 20, timeout_s=0.5)
        side = torch.cuda.Stream(self.dev)
        pm.copy_engines.open()
        if self.r == 0:
            t0 = time.perf_counter()
            side.wait_stream(torch.cuda.current_stream())
            pm.copy_engines.wait(side.cuda_stream, 3, CE_PUSHED, 1)
            torch.cuda.current_stream().wait_stream(side)
        pm.copy_engines.close()
        torch.cuda.synchronize()
        if self.r == 0:
            waited = time.perf_counter() - t0
            self.expect_timeout(pm, "a section's stream wait was never signalled", waited,
                                lambda exc: bool(exc.missing) and 0.4 < waited < 10 and "copy-engine section" in str(exc))
        self.barrier()
        pm.close()
        # Outside a section nothing watches a stream wait, so copy_engines.wait's default there is
        # its bounded kernel: a flag never signalled must time out, not hang the stream.
        pm = PeerMemory(self.comm, slot_bytes=1 << 20, timeout_s=0.5)
        if self.r == 0:
            t0 = time.perf_counter()
            pm.copy_engines.wait(torch.cuda.current_stream().cuda_stream, 2, CE_PUSHED, 1)
            torch.cuda.synchronize()
            waited = time.perf_counter() - t0
            self.expect_timeout(pm, "a wait outside any section was never signalled", waited,
                                lambda exc: bool(exc.missing) and 0.4 < waited < 10)
        self.barrier()
        pm.close()
        # Plain barriers (the MoE transport's) and closed sections leave nothing open: idle for
        # longer than the timeout, the watchdog must not release anything.
        pm = PeerMemory(self.comm, slot_bytes=1 << 20, timeout_s=0.5)
        for _ in range(3):
            pm.barrier()
        pm.barrier(clear=True)
        pm.copy_engines.open()
        pm.copy_engines.close()
        torch.cuda.synchronize()
        time.sleep(1.2)
        z = torch.ones(64, device=self.dev)
        self.checks.count()
        try:
            pm.check()
            ONE_SHOT.all_reduce(pm, z)
            torch.cuda.synchronize()
            if not torch.equal(z, torch.full_like(z, float(self.w))):
                self.checks.fail(f"rank {self.r}: an all-reduce after idle barriers gave {z[:4].tolist()}")
        except C.CollectiveTimeout as exc:
            self.checks.fail(f"rank {self.r}: idle after barriers and a closed section, yet: {exc}")
        self.barrier()
        pm.close()

    def expect_timeout(self, pm: PeerMemory, after: str, waited: float, good: Any) -> None:
        """``pm.check()`` raises a ``CollectiveTimeout`` that ``good`` accepts, ``after`` a call no
        peer joined (``waited`` seconds until the call was over)."""
        self.checks.count()
        try:
            pm.check()
            self.checks.fail(f"rank {self.r}: no CollectiveTimeout after {after}")
        except C.CollectiveTimeout as exc:
            if not good(exc):
                self.checks.fail(f"rank {self.r}: after {after}, a timeout named {exc.missing} after "
                                 f"{waited:.2f} s: {exc}")

    def other_thread(self) -> None:
        """Calls from a thread that has made no CUDA call of its own (as autograd's device thread
        runs a backward): the driver-level launches and copies must still find the context."""
        def body() -> None:
            torch.cuda.set_device(self.dev)  # a no-op on device 0: the thread has no context yet
            for algorithm in ("one_shot", "two_shot", "copy_engine"):
                self.all_reduce(algorithm, 70_001, torch.bfloat16, compare_nccl=False)
            self.reduce_scatter(4097, torch.bfloat16)
            self.all_gather(4097, torch.bfloat16)
            torch.cuda.synchronize()

        errors: list[BaseException] = []
        t = threading.Thread(target=lambda: _capture(body, errors))
        t.start()
        t.join(120)
        self.checks.count()
        if t.is_alive():
            self.checks.fail(f"rank {self.r}: collectives from a new thread did not finish in 120 s")
        elif errors:
            self.checks.fail(f"rank {self.r}: collectives from a new thread raised {errors[0]!r}")

    def bad_arguments(self) -> None:
        cases = [
            ("float64", lambda: C.all_reduce(torch.ones(8, dtype=torch.float64, device=self.dev), algorithm="one_shot")),
            ("op=max", lambda: C.all_reduce(torch.ones(8, device=self.dev), op="max", algorithm="two_shot")),
            ("two_shot reduce_scatter", lambda: C.reduce_scatter_single(torch.ones(8, device=self.dev),
                                                                        torch.ones(8 * self.w, device=self.dev),
                                                                        algorithm="two_shot")),
        ]
        for name, fn in cases:
            self.checks.count()
            try:
                fn()
                self.checks.fail(f"rank {self.r} bad argument {name}: no error")
            except C.UnsupportedError as exc:
                if "Fix:" not in str(exc):
                    self.checks.fail(f"rank {self.r} bad argument {name}: error without a fix: {exc}")


def _capture(fn: Any, errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as exc:  # reported by the caller
        errors.append(exc)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", help="write the results by family here (tests/_checks.py)")
    p.add_argument("--quick", action="store_true", help="fewer sizes (for compute-sanitizer)")
    args = p.parse_args()
    shared = torch.cuda.device_count() < int(os.environ.get("WORLD_SIZE", "1"))
    comm = shared_gpu_ranks()[0] if shared else C.init()
    checks = Checks(families(args.quick), comm.rank)
    ck = Checker(comm, checks, shared=shared)
    t0 = time.perf_counter()
    sizes = [1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 127, 1000, 4095, 4097, 65535, 65537, (1 << 20) + 3, 5_000_001]
    if args.quick:
        sizes = [1, 17, 4097]
    for dtype in DTYPES:
        for n in sizes:
            for algorithm in ALL_REDUCE:
                with checks.family(_op_family("all_reduce", algorithm, dtype)):
                    ck.all_reduce(algorithm, n, dtype)
            for algorithm in RS_AG:
                with checks.family(_op_family("reduce_scatter", algorithm, dtype)):
                    ck.reduce_scatter(n, dtype, algorithm=algorithm)
                with checks.family(_op_family("all_gather", algorithm, dtype)):
                    ck.all_gather(n, dtype, algorithm=algorithm)
        for algorithm in ALL_REDUCE:
            with checks.family(_op_family("all_reduce", algorithm, dtype)):
                ck.all_reduce(algorithm, 1001, dtype, offset=1)  # unaligned: the scalar entry points
                ck.all_reduce(algorithm, 70_001, dtype, avg=True)
        with checks.family(_op_family("reduce_scatter", "one_shot", dtype)):
            ck.reduce_scatter(4097, dtype, avg=True)
        with checks.family(_op_family("reduce_scatter", "copy_engine", dtype)):
            ck.reduce_scatter(4097, dtype, avg=True, algorithm="copy_engine")
    if not args.quick:
        pm = PeerMemory(comm, slot_bytes=1 << 20)  # pieces: messages up to 8x the slots
        pm.ce_chunk_bytes = pm.ce_all_reduce_chunk_bytes = 64 << 10  # copy engine: many chunks, the ring wraps
        for dtype in DTYPES:
            for n in (1 << 20, 2_000_003, 4 << 20):
                for algorithm in ALL_REDUCE:
                    with checks.family(_op_family("all_reduce", algorithm, dtype, pieces=True)):
                        ck.all_reduce(algorithm, n, dtype, pm=pm)
                for algorithm in RS_AG:  # copy engine: the ring wraps several times
                    with checks.family(_op_family("reduce_scatter", algorithm, dtype, pieces=True)):
                        ck.reduce_scatter(n // comm.size + 1, dtype, pm=pm, algorithm=algorithm)
                    with checks.family(_op_family("all_gather", algorithm, dtype, pieces=True)):
                        ck.all_gather(n // comm.size + 1, dtype, pm=pm, algorithm=algorithm)
        pm.close()
        for dtype in DTYPES:
            with checks.family(f"graphs/{dtype_name(dtype)}"):
                ck.graphs(100_003, dtype)
                ck.graph_rs_ag(8192, dtype, "one_shot")  # whole packs, small: the low-latency words
        with checks.family("back_to_back"):
            ck.back_to_back(1000, torch.bfloat16)
        with checks.family("stale_words"):
            ck.stale_words()
        with checks.family("other_thread"):
            ck.other_thread()
        with checks.family("fast_path"):
            ck.fast_path()
        with checks.family("prepared_repeats"):
            ck.prepared_repeats()
        with checks.family("timeout"):
            ck.timeout()
    with checks.family("bad_arguments"):
        ck.bad_arguments()
    torch.cuda.synchronize()
    every = checks.gather()
    flat = [f"{family}: {f}" for family, rec in every.items() for f in rec["failures"]]
    if comm.rank == 0:
        for f in flat[:50]:
            print("FAIL", f)
        print(f"peer-memory checks: {sum(rec['checks'] for rec in every.values())} run on {comm.size} ranks"
              f"{' sharing GPUs' if shared else ''}, "
              f"{len(flat)} failed, {time.perf_counter() - t0:.1f} s", flush=True)
        if args.json:
            write_results(args.json, every)
    C.destroy()
    return 1 if flat else 0


if __name__ == "__main__":
    raise SystemExit(main())
