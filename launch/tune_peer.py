"""Sweep the peer-memory grid: ``torchrun --nproc-per-node N launch/tune_peer.py --json FILE``.

For each message size, each peer-memory algorithm and each grid configuration (``block_bytes``,
bytes per thread block, and ``max_blocks``; the copy engine's chunk size), the time of one call in eager mode and replayed
from a CUDA graph, beside NCCL's in the same run: what ``PeerMemory``'s grid and ``auto``'s
thresholds are set from. Times are medians of ``--reps`` loops of calls timed with CUDA events.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench.cli import parse_size, sizes  # noqa: E402
from bench.harness import time_fn  # noqa: E402
from collectives import _native, dispatch as _dispatch  # noqa: E402
from collectives.algos import peer  # noqa: E402
from collectives.dispatch import dispatch_tensors  # noqa: E402
from collectives.peer import PeerMemory, _launch  # noqa: E402
from collectives.recorder import RECORDER  # noqa: E402


def _time(comm: C.Communicator, dev: torch.device, fn, iters: int, reps: int,  # type: ignore[no-untyped-def]
          graph: bool) -> float:
    """Median seconds per call (the collectives benchmark's timing, ``bench.harness.time_fn``)."""
    return time_fn(fn, comm, dev, iters, reps, graph, warmup=1) / 1e6


def _host_us(fn, calls: int = 300) -> float:  # type: ignore[no-untyped-def]
    """Host microseconds to enqueue one call: ``calls`` back-to-back calls, fewer than the launch
    queue holds, timed before synchronising (the GPU does not hold the host back)."""
    samples = []
    for _ in range(7):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def host_costs(comm: C.Communicator, pm: PeerMemory, dev: torch.device) -> dict[str, float]:
    """Per-call cost of each layer on an 8-byte bf16 all-reduce, and a profile of the dispatch path."""
    x = torch.randn(4, device=dev).to(torch.bfloat16)
    sum_op = C.ReduceOp.SUM
    out = {
        "nccl": _host_us(lambda: dist.all_reduce(x)),
        "commops_auto": _host_us(lambda: C.all_reduce(x)),
        "commops_one_shot": _host_us(lambda: C.all_reduce(x, algorithm="one_shot")),
        # the verb's layers: the dispatcher with the communicator in hand, then without the
        # flight recorder's entry
        "dispatch_tensors": _host_us(lambda: dispatch_tensors(comm, "all_reduce", x, x, sum_op, "auto", False)),
        "peer_memory_one_shot": _host_us(lambda: peer("one_shot").all_reduce(pm, x)),
        # the floor under any torch op on this host: an in-place add of 8 bytes, one launch
        "torch_add_": _host_us(lambda: x.add_(0)),
    }
    # the same verb through the Python fast path instead of the compiled one (collectives/_native.py)
    out["native"] = _native.status()  # type: ignore[assignment]
    compiled = _dispatch._native_dispatch, _dispatch._native_verb
    _dispatch._native_dispatch = _dispatch._native_verb = None
    try:
        out["commops_auto_python"] = _host_us(lambda: C.all_reduce(x))
    finally:
        _dispatch._native_dispatch, _dispatch._native_verb = compiled
    keep = RECORDER.enabled
    RECORDER.enabled = False
    try:
        out["dispatch_tensors_unrecorded"] = _host_us(
            lambda: dispatch_tensors(comm, "all_reduce", x, x, sum_op, "auto", False))
    finally:
        RECORDER.enabled = keep
    # the layers under the verb: the runner the dispatcher keeps (a prepared launch once it has
    # seen this tensor), and that launch alone
    run = peer("one_shot").runner(pm, "all_reduce")
    run(x, x)
    run(x, x)
    out["peer_memory_runner"] = _host_us(lambda: run(x, x))
    fn, blocks, prepared, name = run.ready[x.data_ptr()]  # type: ignore[attr-defined]  # the block run() keeps
    stream = _launch.current_stream(dev.index)
    out["launch_only"] = _host_us(lambda: _launch.launch(fn, blocks, stream, prepared.params, name))
    try:
        import torch.distributed._symmetric_memory as symm_mem  # deferred: a private torch module, an optional anchor

        gname = comm.group.group_name
        t = symm_mem.empty(4, dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(t, gname)
        out["symm_mem_two_shot"] = _host_us(lambda: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", gname))
        out["symm_mem_one_shot"] = _host_us(lambda: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", gname))
    except Exception as exc:  # an anchor, reported as missing rather than failing the sweep
        out["symm_mem_error"] = repr(exc)[:200]  # type: ignore[assignment]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        C.all_reduce(x)
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    if comm.rank == 0:
        print(buf.getvalue()[:6000], flush=True)
    return out


def link_rates(comm: C.Communicator, pm: PeerMemory, dev: torch.device, nbytes: int = 256 << 20) -> dict[str, float]:
    """GB/s each way with every rank pushing to its peers at once: by SM stores (the all-gather
    kernel, per grid size) and by the copy engines (cudaMemcpyAsync into the peers' slots)."""
    import cupy  # deferred: CuPy only where peer memory runs

    out: dict[str, float] = {}
    m = nbytes // 2
    src = torch.randn(m, device=dev).to(torch.bfloat16)
    dst = torch.empty(m * comm.size, dtype=torch.bfloat16, device=dev)
    keep = pm.max_blocks
    for mb in (32, 64, 128):
        pm.max_blocks = mb
        t = _time(comm, dev, lambda: peer("one_shot").all_gather(pm, dst, src), 3, 5, False)
        out[f"sm_push_{mb}_blocks_GBps"] = nbytes * (comm.size - 1) / t / 1e9
    pm.max_blocks = keep
    chunk = min(pm.slot_bytes // 2 // comm.size, nbytes)
    raw = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    rt = cupy.cuda.runtime
    peers = [q for q in range(comm.size) if q != comm.rank]

    def ce() -> None:
        stream = torch.cuda.current_stream().cuda_stream
        for off in range(0, nbytes, chunk):
            for q in peers:
                rt.memcpyAsync(pm.slot_pointers[q] + comm.rank * chunk, raw.data_ptr() + off, chunk, 3, stream)

    t = _time(comm, dev, ce, 3, 5, False)
    out["copy_engine_GBps"] = nbytes * len(peers) / t / 1e9

    def ce_pull() -> None:
        stream = torch.cuda.current_stream().cuda_stream
        for off in range(0, nbytes, chunk):
            for q in peers:
                rt.memcpyAsync(raw.data_ptr() + off, pm.slot_pointers[q] + comm.rank * chunk, chunk, 3, stream)

    t = _time(comm, dev, ce_pull, 3, 5, False)
    out["copy_engine_pull_GBps"] = nbytes * len(peers) / t / 1e9
    side = torch.cuda.Stream()
    half = pm.slot_bytes // 2

    def ce_both() -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        for off in range(0, nbytes, chunk):
            for q in peers:
                rt.memcpyAsync(pm.slot_pointers[q] + comm.rank * chunk, raw.data_ptr() + off, chunk, 3,
                               main.cuda_stream)
                rt.memcpyAsync(raw.data_ptr() + off, pm.slot_pointers[q] + half + comm.rank * chunk, chunk, 3,
                               side.cuda_stream)
        main.wait_stream(side)

    t = _time(comm, dev, ce_both, 3, 5, False)
    out["copy_engine_push_and_pull_GBps"] = 2 * nbytes * len(peers) / t / 1e9
    return out


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/tune_peer.py", description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("1G"))
    p.add_argument("-f", "--step-factor", type=int, default=4)
    p.add_argument("--configs", default="2K:128,8K:128,32K:128,32K:64",
                   help="comma-separated block_bytes:max_blocks grid configurations to try")
    p.add_argument("--ce-chunks", default="4M,8M,16M", help="copy-engine chunk sizes to try (messages >= 8 MB)")
    p.add_argument("-r", "--reps", type=int, default=5)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    comm = C.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    choices = [(parse_size(c.split(":")[0]), int(c.split(":")[1])) for c in args.configs.split(",")]
    ce_chunks = [parse_size(c) for c in args.ce_chunks.split(",")]
    pm = PeerMemory(comm)
    host = host_costs(comm, pm, dev)
    if comm.rank == 0:
        print("host us per call:", json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in host.items()}),
              flush=True)
    links = link_rates(comm, pm, dev)
    if comm.rank == 0:
        print("links GB/s each way:", json.dumps({k: round(v, 1) for k, v in links.items()}), flush=True)
    rows = []
    for nbytes in sizes(args.min_bytes, args.max_bytes, args.step_factor):
        n = max(1, nbytes // 2)
        x = torch.randn(n, device=dev).to(torch.bfloat16)
        iters = 50 if nbytes <= (4 << 20) else 10 if nbytes <= (64 << 20) else 3
        row: dict[str, object] = {"bytes": n * 2}
        for graph in (False, True):
            tag = "graph" if graph else "eager"

            def us(fn, graph=graph):  # type: ignore[no-untyped-def]
                return _time(comm, dev, fn, iters, args.reps, graph) * 1e6

            row[f"nccl_{tag}_us"] = us(lambda: dist.all_reduce(x))
            for bb, mb in choices:
                pm.block_bytes, pm.max_blocks = bb, mb
                for algo in ("one_shot", "two_shot"):
                    row[f"{algo}_{bb >> 10}K:{mb}_{tag}_us"] = us(lambda: peer(algo).all_reduce(pm, x))
            if nbytes >= (8 << 20):
                pm.ce_max_chunks = 1 << 30  # exactly cb per chunk
                for cb in ce_chunks:
                    pm.ce_chunk_bytes = pm.ce_all_reduce_chunk_bytes = cb  # (two ranks: the one-shot's)
                    try:
                        row[f"copy_engine_{cb >> 20}M_{tag}_us"] = us(lambda: peer("copy_engine").all_reduce(pm, x))
                    except C.UnsupportedError as exc:  # too few ring slots for this chunk
                        row[f"copy_engine_{cb >> 20}M_{tag}_us"] = str(exc)[:80]  # type: ignore[assignment]
        pm.check()
        rows.append(row)
        if comm.rank == 0:
            print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if comm.rank == 0:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                                               "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                                               "gpu": torch.cuda.get_device_name(), "world": comm.size,
                                               "host_us_per_call": host, "links": links, "rows": rows}, indent=1))
    pm.close()
    C.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
