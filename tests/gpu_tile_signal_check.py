"""The ``tile_signal`` overlap strategy on GPUs against float64: ``torchrun --nproc-per-node N
tests/gpu_tile_signal_check.py`` (run by ``tests/test_gpu_tile_signal.py``).

Ranks may share GPUs (``local_rank % device_count``), as in ``gpu_norm_check.py``: peer memory
maps a GPU's own memory from another process as it maps a peer's, and nothing here uses NCCL.

Families:

- ``rs/<dtype>``, ``ar/<dtype>``: ``gemm_reduce_scatter`` and ``gemm_all_reduce`` through
  ``overlap`` (``strategy="tile_signal"``) at shapes of one to several groups a block, 1-8
  chunks, ``b`` contiguous and as a linear layer's transposed weight; every rank's result
  against the float64 sum of every rank's product (each rank's operands regenerated from its
  seed), the all-reduce's the same bits on every rank.
- ``ring``: a small peer memory, 8 chunks asked: at 2 ranks (4 MiB) the ring slots are reused
  within a call (every chunk at the all-reduce); at 3 or more (32 MiB) every group of a block
  has a slot of its own, as the strategy requires there.
- ``graph``: both captured in one CUDA graph after an eager call, replayed 50 times with new data.
- ``soak``: 1,000 back-to-back all-reduces with new operands every call, checked afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
import overlap  # noqa: E402
from collectives.peer import PeerMemory  # noqa: E402
from overlap import _tile_signal  # noqa: E402
from tests._checks import (Checks, check_arguments, dtype_name, report, same_bits_on_every_rank,  # noqa: E402
                           shared_gpu_ranks)

DTYPES = (torch.bfloat16, torch.float16)
TOL = 2e-2  # of the largest expected magnitude: the peers' partial sums arrive rounded to the dtype
SOAK = 1000


def families() -> tuple[str, ...]:
    return tuple(f"{op}/{dtype_name(d)}" for op in ("rs", "ar") for d in DTYPES) + ("ring", "graph", "soak")


def _operands(q: int, m: int, k: int, n: int, seed: int, dtype: torch.dtype,
              dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank q's ``a [m, k]``; ``b [k, n]``, the same on every rank."""
    g = torch.Generator(device=dev).manual_seed(seed * 131 + q)
    a = torch.randn(m, k, generator=g, device=dev).to(dtype)
    g.manual_seed(seed * 131 + 127)
    return a, (torch.randn(k, n, generator=g, device=dev) / k ** 0.5).to(dtype)


def _want(world: int, m: int, k: int, n: int, seed: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    total = torch.zeros(m, n, dtype=torch.float64, device=dev)
    for q in range(world):
        a, b = _operands(q, m, k, n, seed, dtype, dev)
        total += a.double() @ b.double()
    return total


def _close(ck: Checks, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    bound = TOL * float(want.abs().max().clamp_min(1e-30))
    bad = int(((got.double() - want).abs() > bound).sum()) + int(got.isnan().sum())
    if bad:
        ck.fail(f"{what}: {bad} of {got.numel()} elements beyond {bound:.3g}")


def _shapes(world: int) -> list[tuple[int, int, int, int]]:
    """(M, K, N, chunks): whole tiles of 128 rows per rank."""
    t = 128 * world
    return [(t, 64, 256, 1), (4 * t, 192, 520, 3), (8 * t, 512, 1032, 8), (2 * t, 1000, 8, 2)]


def check_op(ck: Checks, op: str, world: int, dtype: torch.dtype, dev: torch.device) -> None:
    rank = dist.get_rank()
    for i, (m, k, n, chunks) in enumerate(_shapes(world)):
        for transposed in (False, True):
            seed = 20 * i + transposed + (op == "ar") * 7
            a, b = _operands(rank, m, k, n, seed, dtype, dev)
            if transposed:
                b = b.t().contiguous().t()  # [K, N] as the transpose of a weight [N, K]
            if op == "ar":
                got = overlap.gemm_all_reduce(a, b, strategy="tile_signal", chunks=chunks)
            else:
                got = overlap.gemm_reduce_scatter(a, b, scatter_dim=0, strategy="tile_signal", chunks=chunks)
            torch.cuda.synchronize()
            ck.count()
            want = _want(world, m, k, n, seed, dtype, dev)
            if op == "rs":
                want = want[rank * (m // world):(rank + 1) * (m // world)]
            where = f"{op} {m}x{k}x{n} chunks={chunks} {'weight.t()' if transposed else 'b'} {dtype_name(dtype)}"
            _close(ck, where, got, want)
            if op == "ar":
                same_bits_on_every_rank(ck, where, got)


def check_ring(ck: Checks, world: int, dev: torch.device) -> None:
    comm, rank = C.get_communicator(), dist.get_rank()
    pm = PeerMemory(comm, slot_bytes=(4 if world == 2 else 32) << 20)  # at 3+: a block's groups at once
    try:
        m, k, n = 16 * 128 * world, 256, 1024
        for op in ("rs", "ar"):
            a, b = _operands(rank, m, k, n, 900 + (op == "ar"), torch.bfloat16, dev)
            run = _tile_signal.gemm_all_reduce if op == "ar" else _tile_signal.gemm_reduce_scatter
            got = run(pm, a, b, 8)
            torch.cuda.synchronize()
            ck.count()
            lay = next(lay for key, lay in _tile_signal._LAYOUTS[pm].items() if key[0] == op)
            if world == 2 and lay.ring >= lay.per_block:
                ck.fail(f"{op}: ring {lay.ring} >= {lay.per_block} groups a block: no slot was reused")
            if world > 2 and lay.ring < lay.per_block:  # the design note's rule at 3 ranks or more
                ck.fail(f"{op}: ring {lay.ring} < {lay.per_block} groups a block at {world} ranks")
            want = _want(world, m, k, n, 900 + (op == "ar"), torch.bfloat16, dev)
            if op == "rs":
                want = want[rank * (m // world):(rank + 1) * (m // world)]
            _close(ck, f"ring {op}", got, want)
    finally:
        pm.close()


def check_graph(ck: Checks, world: int, dev: torch.device, replays: int = 50) -> None:
    rank, dtype = dist.get_rank(), torch.bfloat16
    m, k, n = 4 * 128 * world, 256, 512
    a, b = _operands(rank, m, k, n, 0, dtype, dev)
    overlap.gemm_all_reduce(a, b, strategy="tile_signal", chunks=4)  # eager first: layouts, kernels
    overlap.gemm_reduce_scatter(a, b, scatter_dim=0, strategy="tile_signal", chunks=2)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ar = overlap.gemm_all_reduce(a, b, strategy="tile_signal", chunks=4)
        rs = overlap.gemm_reduce_scatter(a, b, scatter_dim=0, strategy="tile_signal", chunks=2)
    for rep in range(replays):
        na, nb = _operands(rank, m, k, n, 1000 + rep, dtype, dev)
        a.copy_(na), b.copy_(nb)
        graph.replay()
        torch.cuda.synchronize()
        ck.count()
        want = _want(world, m, k, n, 1000 + rep, dtype, dev)
        _close(ck, f"replay {rep} ar", ar, want)
        _close(ck, f"replay {rep} rs", rs, want[rank * (m // world):(rank + 1) * (m // world)])


def check_soak(ck: Checks, world: int, dev: torch.device) -> None:
    rank, dtype = dist.get_rank(), torch.bfloat16
    m, k, n = 2 * 128 * world, 128, 256
    ins = [_operands(rank, m, k, n, 5000 + j, dtype, dev) for j in range(SOAK)]
    torch.cuda.synchronize()
    outs = [overlap.gemm_all_reduce(a, b, strategy="tile_signal", chunks=2) for a, b in ins]  # back to back
    torch.cuda.synchronize()
    wrong = 0
    for j, got in enumerate(outs):
        before = len(ck.failures)
        _close(ck, f"soak call {j}", got, _want(world, m, k, n, 5000 + j, dtype, dev))
        wrong += len(ck.failures) > before
    ck.count()
    if wrong:
        ck.fail(f"soak: {wrong} of {SOAK} calls wrong")


def main() -> int:
    args = check_arguments(families())
    only = args.only
    comm, dev = shared_gpu_ranks()
    ck = Checks(families(), comm.rank)
    for op in ("rs", "ar"):
        for dtype in DTYPES:
            name = f"{op}/{dtype_name(dtype)}"
            if name in only:
                with ck.family(name):
                    check_op(ck, op, comm.size, dtype, dev)
    for name, fn in (("ring", check_ring), ("graph", check_graph), ("soak", check_soak)):
        if name in only:
            with ck.family(name):
                fn(ck, comm.size, dev)
    failed = report(ck, args.json, "tile-signalled GEMM + collective", comm.size)
    C.destroy()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
