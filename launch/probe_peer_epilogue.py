"""Should a GEMM write its result straight into a peer GPU's memory, or write locally and let a
copy engine move it? ``torchrun --nproc-per-node 2 launch/probe_peer_epilogue.py`` (GPUs of one
node; every rank does the same towards the next rank at once, so both directions of the link
carry traffic).

For each GEMM shape, timed in the same rounds:

* ``gemm``: ``torch.matmul(a, b, out=local)``;
* ``push``: a copy engine moving the same number of bytes into the peer's buffer;
* ``gemm_into_peer``: the GEMM with ``out`` in the peer's buffer (the epilogue stores over the link);
* ``gemm_beside_push``: the GEMM into local memory while a copy engine pushes as many bytes
  on a side stream (the steady state of the copy-engine overlap: chunk i travels while chunk
  i + 1 is computed).

``epilogue_hides`` is the share of the push that the peer-writing GEMM absorbs,
``(gemm + push - gemm_into_peer) / push``; ``beside_hides`` the same for the copy engine beside
the GEMM. ``#wrong`` counts elements of the peer's result that did not land in this rank's
buffer as the peer computed them. JSON and a plot on request.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from bench.harness import time_interleaved  # noqa: E402
from bench.report import run_meta  # noqa: E402

if TYPE_CHECKING:
    from collectives.peer.memory import PeerMemory

SHAPES = "512x2048x8192,1024x2048x8192,2048x2048x8192,1024x4096x8192,2048x4096x8192,4096x4096x8192,8192x4096x8192"


def _operands(rank: int, m: int, k: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
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


def main() -> int:
    p = argparse.ArgumentParser(prog="launch/probe_peer_epilogue.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=SHAPES, help="MxKxN, comma-separated (bf16)")
    p.add_argument("-n", "--iters", type=int, default=20)
    p.add_argument("-r", "--reps", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    comm = C.init()
    if not (torch.cuda.is_available() and comm.backend_for("cuda")):
        raise C.UnsupportedError("device", "cpu", "this probe times GEMMs writing into a peer GPU's memory",
                                 "run it with torchrun on the GPUs of one node")
    from collectives.peer import _launch, peer_memory

    dev = torch.device("cuda", torch.cuda.current_device())
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    need = max(m * n * 2 for m, _, n in shapes)
    pm: PeerMemory = peer_memory(comm)
    if pm.slot_bytes < need:
        raise C.UnsupportedError("COMMOPS_PEER_BYTES", pm.slot_bytes, f"holds less than the largest result ({need} B)",
                                 f"set COMMOPS_PEER_BYTES={need} or more")
    r, w = comm.rank, comm.size
    q, src = (r + 1) % w, (r - 1) % w  # this rank writes into q's buffer; src writes into this one's
    mine = pm.slot_view(0, (pm.slot_bytes,), torch.uint8)
    theirs = _peer_bytes(pm, q, dev)
    side = torch.cuda.Stream(dev)
    records: list[dict[str, Any]] = []
    for m, k, n in shapes:
        a, b = _operands(r, m, k, n, dev)
        nbytes = m * n * 2
        local = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        staged = torch.randn(m, n, device=dev).bfloat16()  # what the copy engine pushes beside the GEMM
        peer_out = theirs[:nbytes].view(torch.bfloat16).view(m, n)
        main_s = torch.cuda.current_stream()

        def beside() -> None:
            side.wait_stream(main_s)
            _launch.copy_async(pm.slot_pointers[q], staged.data_ptr(), nbytes, side.cuda_stream)
            torch.matmul(a, b, out=local)
            main_s.wait_stream(side)

        fns: dict[str, Callable[[], object]] = {
            "gemm": lambda: torch.matmul(a, b, out=local),
            "push": lambda: _launch.copy_async(pm.slot_pointers[q], local.data_ptr(), nbytes, main_s.cuda_stream),
            "gemm_into_peer": lambda: torch.matmul(a, b, out=peer_out),
            "gemm_beside_push": beside,
        }
        t = time_interleaved(fns, comm, dev, args.iters, args.reps)
        # the check: the peer's product, written by its epilogue into this rank's buffer
        torch.matmul(a, b, out=peer_out)
        torch.cuda.synchronize()
        dist.barrier(group=comm.group)
        a_s, b_s = _operands(src, m, k, n, dev)
        ref = (a_s.double() @ b_s.double())
        got = mine[:nbytes].view(torch.bfloat16).view(m, n).double()
        wrong = int(((got - ref).abs() > 2e-2 * (ref.abs() + 1.0)).sum())
        dist.barrier(group=comm.group)
        rec: dict[str, Any] = {"M": m, "K": k, "N": n, "dtype": "bfloat16", "world": w, "bytes": nbytes,
               **{f"{name}_us": v for name, v in t.items()},
               "epilogue_hides": (t["gemm"] + t["push"] - t["gemm_into_peer"]) / t["push"],
               "beside_hides": (t["gemm"] + t["push"] - t["gemm_beside_push"]) / t["push"],
               "into_peer_over_beside": t["gemm_into_peer"] / t["gemm_beside_push"], "wrong": wrong}
        wrong_all = torch.tensor([wrong], device=dev)
        dist.all_reduce(wrong_all, group=comm.group)
        rec["wrong"] = int(wrong_all.item())
        records.append(rec)
        if r == 0:
            print(f"{m}x{k}x{n}: gemm {t['gemm']:8.1f} us | push {t['push']:7.1f} | into peer {t['gemm_into_peer']:8.1f} "
                  f"(hides {100 * rec['epilogue_hides']:5.1f}% of the push) | beside a push {t['gemm_beside_push']:8.1f} "
                  f"(hides {100 * rec['beside_hides']:5.1f}%) | #wrong {rec['wrong']}", flush=True)
    if r == 0:
        meta = run_meta("launch/probe_peer_epilogue.py", comm, True)
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump({"meta": meta, "records": records}, f, indent=1)
                f.write("\n")
        if args.plot:
            _plot(records, args.plot, f"GEMM into a peer's memory vs. beside a copy engine, {w} ranks, {meta['device']}")
    C.destroy()
    return 0


def _plot(records: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["gemm", "push", "gemm_into_peer", "gemm_beside_push"]
    labels = [f"{r['M']}x{r['K']}x{r['N']}" for r in records]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ax.bar([x + i * width for x in range(len(records))], [float(r[f"{name}_us"]) for r in records], width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(records))], labels, fontsize=8, rotation=20)
    ax.set_ylabel("us per call")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
