"""A GEMM whose result goes to a peer GPU: stored there by its epilogue, or written locally and
moved by a copy engine beside the next GEMM.

For one GEMM shape, timed in the same rounds (``bench.harness.time_interleaved``), every rank
towards the next rank at once, so both directions of the link carry traffic:

* ``gemm``: ``torch.matmul(a, b, out=local)``;
* ``push``: a copy engine moving the same number of bytes into the peer's buffer;
* ``gemm_into_peer``: the GEMM with ``out`` in the peer's buffer (its epilogue stores over the link);
* ``gemm_beside_push``: the GEMM into local memory while a copy engine pushes as many bytes on a
  side stream: the steady state of the copy-engine overlap (``overlap/_copy_engine.py``), where
  chunk i travels while chunk i + 1 is computed.

``epilogue_hides`` is the share of the push the peer-writing GEMM absorbs,
``(gemm + push - gemm_into_peer) / push``; ``beside_hides`` the same for the copy engine beside
the GEMM. ``wrong`` counts elements of the previous rank's product that did not land in this
rank's buffer as a float64 product of its operands says (summed over ranks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

import collectives as C
from collectives.peer import PeerMemory

from .harness import time_interleaved

__all__ = ["EpilogueRecord", "measure_epilogue", "format_epilogue", "plot_epilogue"]


@dataclass
class EpilogueRecord:
    M: int
    K: int
    N: int
    dtype: str
    world: int
    bytes: int              # the GEMM's result, what crosses the link
    gemm_us: float
    push_us: float
    gemm_into_peer_us: float
    gemm_beside_push_us: float
    epilogue_hides: float   # share of push_us that gemm_into_peer absorbs
    beside_hides: float     # share of push_us that gemm_beside_push absorbs
    wrong: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _operands(rank: int, m: int, k: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``a [m, k]`` and ``b [k, n]`` (bf16), the same wherever they are made."""
    g = torch.Generator(device=device)
    g.manual_seed(1_000_003 * rank + m * 7 + k * 11 + n * 13)
    a = torch.randn(m, k, generator=g, device=device).bfloat16()
    b = (torch.randn(k, n, generator=g, device=device) / k ** 0.5).bfloat16()
    return a, b


def _peer_bytes(pm: PeerMemory, peer: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``peer``'s slot buffer as mapped in this process (CUDA IPC): what a
    kernel writes there travels over the link."""
    import cupy

    size = pm.slot_bytes
    mem = cupy.cuda.UnownedMemory(pm.slot_pointers[peer], size, pm, device.index)
    return torch.from_dlpack(cupy.ndarray((size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0)))


def measure_epilogue(comm: C.Communicator, pm: PeerMemory, m: int, k: int, n: int, device: torch.device, *,
                     iters: int = 20, reps: int = 5) -> EpilogueRecord:
    """One shape (bf16) on the GPUs of one node; ``pm``'s slot buffer must hold ``m * n * 2`` bytes."""
    nbytes = m * n * 2
    if nbytes > pm.slot_bytes:
        raise C.UnsupportedError("COMMOPS_PEER_BYTES", pm.slot_bytes, f"holds less than the {m}x{n} result ({nbytes} B)",
                                 f"set COMMOPS_PEER_BYTES={nbytes} or more")
    r, w = comm.rank, comm.size
    q, src = (r + 1) % w, (r - 1) % w  # this rank writes into q's buffer; src writes into this one's
    a, b = _operands(r, m, k, n, device)
    local = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    staged = torch.randn(m, n, device=device).bfloat16()  # what the copy engine pushes beside the GEMM
    peer_out = _peer_bytes(pm, q, device)[:nbytes].view(torch.bfloat16).view(m, n)
    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)

    def beside() -> None:
        side.wait_stream(main)
        pm.copy_engines.copy(side.cuda_stream, pm.slot_pointers[q], staged.data_ptr(), nbytes)
        torch.matmul(a, b, out=local)
        main.wait_stream(side)

    fns: dict[str, Callable[[], object]] = {
        "gemm": lambda: torch.matmul(a, b, out=local),
        "push": lambda: pm.copy_engines.copy(main.cuda_stream, pm.slot_pointers[q], local.data_ptr(), nbytes),
        "gemm_into_peer": lambda: torch.matmul(a, b, out=peer_out),
        "gemm_beside_push": beside,
    }
    t = time_interleaved(fns, comm, device, iters, reps)
    # the check: the previous rank's product, stored by its epilogue into this rank's buffer
    torch.matmul(a, b, out=peer_out)
    torch.cuda.synchronize(device)
    dist.barrier(group=comm.group)
    a_s, b_s = _operands(src, m, k, n, device)
    ref = a_s.double() @ b_s.double()
    got = pm.slot_view(0, (m, n), torch.bfloat16).double()
    bad = int(((got - ref).abs() > 2e-2 * (ref.abs() + 1.0)).sum())  # read before anyone writes again
    dist.barrier(group=comm.group)
    wrong = torch.tensor([bad], device=device)
    dist.all_reduce(wrong, group=comm.group)
    return EpilogueRecord(m, k, n, "bfloat16", w, nbytes, t["gemm"], t["push"], t["gemm_into_peer"],
                          t["gemm_beside_push"], (t["gemm"] + t["push"] - t["gemm_into_peer"]) / t["push"],
                          (t["gemm"] + t["push"] - t["gemm_beside_push"]) / t["push"], int(wrong.item()))


def format_epilogue(r: EpilogueRecord) -> str:
    return (f"{r.M}x{r.K}x{r.N}: gemm {r.gemm_us:8.1f} us | push {r.push_us:7.1f} | into peer "
            f"{r.gemm_into_peer_us:8.1f} (hides {100 * r.epilogue_hides:5.1f}% of the push) | beside a push "
            f"{r.gemm_beside_push_us:8.1f} (hides {100 * r.beside_hides:5.1f}%) | #wrong {r.wrong}")


def plot_epilogue(records: list[EpilogueRecord], path: str, title: str = "") -> None:
    """PNG: the four times per shape, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["gemm_us", "push_us", "gemm_into_peer_us", "gemm_beside_push_us"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(names)
    xs = range(len(records))
    for i, name in enumerate(names):
        values: list[Any] = [getattr(r, name) for r in records]
        ax.bar([x + i * width for x in xs], values, width, label=name.removesuffix("_us"))
    ax.set_xticks([x + 0.4 - width / 2 for x in xs], [f"{r.M}x{r.K}x{r.N}" for r in records], fontsize=8, rotation=20)
    ax.set_ylabel("us per call")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
