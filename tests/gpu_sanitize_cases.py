"""Small cases for compute-sanitizer (``launch/gpu_suite.sh OUT sanitize``) beyond
``gpu_peer_check.py --quick``: the MoE pipeline over copy engines (row kernels reading through
per-rank bases, ``PeerMemory.kernel``) and the copy-engine all-reduce in many small chunks (at
two ranks the one shot, its ramp and a ring that wraps), each against the plain result.

    torchrun --nproc-per-node 2 tests/gpu_sanitize_cases.py
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import collectives as C
from collectives.algos import peer
from collectives.peer import PeerMemory
from overlap.moe import MoEDispatcher


def _experts(rows: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
    return rows * 1.5


def main() -> int:
    comm = C.init()
    r = comm.rank
    dev = torch.device("cuda", torch.cuda.current_device())
    fails = 0
    E, H, k = 8, 64, 3
    d = MoEDispatcher(E, H, dtype=torch.float32, device=dev, transport="peer", max_tokens=64, top_k=k,
                      pipeline_transfers="copy_engine")
    g = torch.Generator(device=dev)
    for call in range(2):
        g.manual_seed(10 * call + r)
        T = 37 + 5 * r + call
        x = torch.randn(T, H, generator=g, device=dev)
        idx = torch.rand(T, E, generator=g, device=dev).topk(k, dim=-1).indices
        w = torch.rand(T, k, generator=g, device=dev)
        with torch.no_grad():
            want = d.forward(x, idx, w, _experts)
            for chunks in (2, 3):
                got = d.forward_pipelined(x, idx, w, _experts, chunks=chunks)
                fails += int(not torch.allclose(got, want, rtol=1e-5, atol=1e-5))
    d.close()
    pm = PeerMemory(comm, slot_bytes=1 << 20)
    pm.ce_chunk_bytes = pm.ce_all_reduce_chunk_bytes = 64 << 10
    for n in (300_001, 1 << 18):
        y = torch.randn(n, device=dev)
        ref = y.clone()
        dist.all_reduce(ref)
        peer("copy_engine").all_reduce(pm, y)
        torch.cuda.synchronize()
        fails += int(not torch.allclose(y, ref, rtol=1e-5, atol=1e-5))
    pm.close()
    print(f"rank {r}: sanitizer cases, {fails} failed", flush=True)
    C.destroy()
    return 1 if fails else 0


if __name__ == "__main__":
    raise SystemExit(main())
