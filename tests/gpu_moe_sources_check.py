"""The MoE pipeline by source rank (``forward_pipelined(chunks="sources")``) on GPUs, against a
float64 MoE: ``torchrun --nproc-per-node N tests/gpu_moe_sources_check.py`` (run by
``tests/test_gpu_moe_sources.py``).

Ranks may share GPUs (``local_rank % device_count``), so that one GPU checks 2-4 ranks: the
peer transport maps a GPU's own memory from another process as it maps a peer's, and nothing
here uses NCCL (the group's NCCL communicator is never created; NCCL refuses two ranks on one
GPU). Every kernel, copy and flag of the pipeline is real; shared GPUs time nothing meaningful.

bf16 and fp16; top-1 and top-3; fresh random tokens, routing and weights in every call (more
than one tile of the layout kernels); a rank without tokens in one call; an expert that no token
chooses; ``dispatch`` and ``dispatch_low_latency`` bit for bit against recv_x by definition; a
repeated and an out-of-range expert id on one rank refused on every rank; the
sequential forward of the same dispatcher checked beside it; ``chunks="auto"`` following a tuned
table to the pipeline by source and to two token chunks over copy engines; one traced call's
timeline (``PeerRows.timeline``) in the pipeline's order. Prints one line per failure and a
summary; exits non-zero on any.

The checks are grouped in families (``families()``; ``tests/_checks.py``), which ``--json``
writes with their counts and failures, one pytest case each in ``tests/test_gpu_moe_sources.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import collectives as C  # noqa: E402
from collectives.errors import InvalidArgumentError  # noqa: E402
from overlap import ops  # noqa: E402
from overlap.moe import GroupedSwiGLU, MoEDispatcher, PeerTransport, reference_moe  # noqa: E402
from tests._checks import Checks, dtype_name, shared_gpu_ranks, write_results  # noqa: E402

TOL = 3e-2  # of the largest output element: one rounding of the activation and of the output in bf16
DTYPES = (torch.bfloat16, torch.float16)
TOP_K = (1, 3)


def _family(what: str, k: int, dtype: torch.dtype) -> str:
    return f"moe/{what}/top{k}/{dtype_name(dtype)}"


def families() -> tuple[str, ...]:
    """The families a run records checks into: per dtype and top-k the pipeline by source (with
    the layouts, the sequential forward and the traced timeline beside it), and the bad routings
    where a token has more than one expert."""
    return tuple(_family(what, k, d) for d in DTYPES for k in TOP_K
                 for what in ("sources", "bad_routing") if what == "sources" or k > 1)


def _swiglu64(m: GroupedSwiGLU, e: int, rows: torch.Tensor) -> torch.Tensor:
    a = rows.double()
    h = F.silu(a @ m.w1[e].double()) * (a @ m.w3[e].double())
    return h.to(m.w1.dtype).double() @ m.w2[e].double()  # the activation rounded once, as the kernels do


def _timeline_fails(steps: list[tuple[str, float]], r: int, w: int, where: str) -> list[str]:
    """The traced call's steps: the pipeline's order (rank r takes its peers r - 1, r - 2, ...),
    each ending no earlier than the one before it on the stream."""
    names = [name for name, _ in steps]
    times = [us for _, us in steps]
    want = ["start", "post", "layout", f"gate/up {r}"]
    for d in range(1, w):
        s = (r - d) % w
        want += [f"tokens of {s}", f"gate/up {s}"]
    want += ["partial rows back", "sum"]
    it = iter(names)
    if not all(step in it for step in want) or names[-1] != "sum":  # want, in order, within names
        return [f"{where}: timeline steps {names}, not in the order {want}"]
    if times[0] != 0.0 or any(b < a for a, b in zip(times, times[1:])):
        return [f"{where}: timeline times {times} do not start at 0 and grow"]
    return []


def _inputs(q: int, call: int, H: int, E: int, k: int, dtype: torch.dtype,
            dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank q's tokens, expert ids and weights in call ``call`` (any rank can draw any rank's):
    more than one 512-token tile of the layout kernels, rank 0 without tokens in call 1."""
    g = torch.Generator(device=dev)
    g.manual_seed(1100 + 10 * call + q)
    T = 0 if (call == 1 and q == 0) else 600 + call + 7 * q
    x = torch.randn(T, H, generator=g, device=dev).to(dtype)
    scores = torch.rand(T, E, generator=g, device=dev)
    scores[:, E - 1] = -1.0  # the last expert gets nothing
    return x, scores.topk(k, dim=-1).indices, torch.rand(T, k, generator=g, device=dev).to(dtype)


def _layout_fails(disp: MoEDispatcher, every: list[tuple[torch.Tensor, ...]], r: int, w: int, where: str) -> list[str]:
    """``dispatch`` and ``dispatch_low_latency`` against recv_x by definition (this rank's local
    experts in order, then source rank, then token), bit for bit."""
    e_loc = disp.local_experts
    want: list[list[torch.Tensor]] = [[] for _ in range(e_loc)]
    for x, idx, _ in every:
        for e in range(e_loc):
            want[e].append(x[(idx == r * e_loc + e).any(1)])
    per = [torch.cat(rows) for rows in want]
    x, idx, wt = every[r]
    fails = []
    with torch.no_grad():
        recv, h = disp.dispatch(x, idx, wt)
        if h.tokens_per_expert != [p.shape[0] for p in per] or not torch.equal(recv, torch.cat(per)):
            fails.append(f"{where}: dispatch's recv_x is not grouped by expert, source, token")
        blocks, hl = disp.dispatch_low_latency(x, idx)
        counts = hl.tokens_per_expert.tolist()
        if counts != [p.shape[0] for p in per] or not all(torch.equal(blocks[e, :c], per[e])
                                                         for e, c in enumerate(counts)):
            fails.append(f"{where}: dispatch_low_latency's blocks are not by source, token")
    return fails


def _bad_routing_fails(disp: MoEDispatcher, every: list[tuple[torch.Tensor, ...]], r: int, w: int,
                       where: str) -> list[str]:
    """The last rank's ids with an expert twice in its last token, then out of range in its
    first (layout kernels' checks): every rank raises the typed error naming it, and the next
    dispatch still works."""
    fails = []
    x, idx, wt = every[r]
    for what, text in (("repeat", "same expert twice"), ("range", "outside")):
        bad = idx.clone()
        if r == w - 1 and bad.shape[0]:
            if what == "repeat":
                bad[-1, 1] = bad[-1, 0]
            else:
                bad[0, 0] = disp.num_experts + 3
        try:
            with torch.no_grad():
                disp.dispatch(x, bad, wt)
            fails.append(f"{where}: ids with a bad {what} on rank {w - 1} raised nothing")
        except InvalidArgumentError as exc:
            if text not in str(exc) or (r != w - 1 and f"rank {w - 1}" not in str(exc)):
                fails.append(f"{where}: ids with a bad {what}: {exc}")
    return fails + _layout_fails(disp, every, r, w, f"{where} after the bad routings")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", help="write the results by family here (tests/_checks.py)")
    args = p.parse_args()
    comm, dev = shared_gpu_ranks()
    w, r = comm.size, comm.rank
    ck = Checks(families(), r)
    H, FF, E = 256, 192, 4 * w
    for dtype in DTYPES:
        for k in TOP_K:
            ck.begin(_family("sources", k, dtype))
            disp = MoEDispatcher(E, H, dtype=dtype, device=dev, transport="peer", max_tokens=720, top_k=k,
                                 pipeline_transfers="copy_engine")
            torch.manual_seed(77)  # the same experts on every rank
            whole = GroupedSwiGLU(E, H, FF, dtype=dtype, device=dev)
            mine = GroupedSwiGLU(E // w, H, FF, dtype=dtype, device=dev)
            with torch.no_grad():
                for name in ("w1", "w2", "w3"):
                    getattr(mine, name).copy_(getattr(whole, name)[r * (E // w):(r + 1) * (E // w)])
            for call in range(3):
                every = [_inputs(q, call, H, E, k, dtype, dev) for q in range(w)]  # every rank's, for recv_x
                x, idx, wt = every[r]
                T = x.shape[0]
                ck.count(2)
                ck.fail(*_layout_fails(disp, every, r, w, f"rank {r} {dtype} k={k} call {call}"))
                if call == 1 and k > 1:
                    with ck.family(_family("bad_routing", k, dtype)):
                        ck.count(2)
                        ck.fail(*_bad_routing_fails(disp, every, r, w, f"rank {r} {dtype}"))
                assert isinstance(disp.transport_impl, PeerTransport)
                peer = disp.transport_impl.rows()
                peer.trace = [] if call == 2 else None  # one call traced: its timeline is checked below
                # calls 0 and 1: chunks="auto" following a tuned table (the pipeline by source, then
                # two token chunks over copy engines); call 2 asks for the pipeline by source itself
                tuned = {0: ("sources", w), 1: (2, 2)}.get(call)
                if tuned:
                    ops.set_tuned({"meta": {"world": w}, "entries": [{
                        "op": "moe_forward", "transport": "peer", "pieces": 1, "dtype": str(dtype).removeprefix("torch."),
                        "device_type": "cuda", "tokens": 720, "hidden": H, "ffn_hidden": FF, "experts": E, "top_k": k,
                        "chunks": tuned[0], "pipeline": "copy_engine", "note": "written by this check"}]})
                try:
                    with torch.no_grad():
                        got = disp.forward_pipelined(x, idx, wt, mine, chunks="auto" if tuned else "sources")
                finally:
                    ops.set_tuned(None)
                if call == 2:
                    ck.count()
                    ck.fail(*_timeline_fails(peer.timeline(), r, w, f"rank {r} {dtype} k={k}"))
                    peer.trace = None
                with torch.no_grad():
                    seq = disp.forward(x, idx, wt, mine)
                want = reference_moe(x.double(), idx, wt.double(), lambda e, rows: _swiglu64(whole, e, rows))
                scale = want.abs().max().item() if T else 1.0
                for what, out in ((f"pipeline {tuned or 'by source'}", got), ("sequential", seq)):
                    ck.count()
                    err = (out.double() - want).abs().max().item() if T else 0.0
                    if out.shape != x.shape or not err <= TOL * max(scale, 1e-6):
                        ck.fail(f"rank {r} {what} {dtype} k={k} call {call}: max error {err:.3g} (scale {scale:.3g})")
                ck.count()
                ran = (tuned[1], "tuned table: written by this check") if tuned else (w, "by source rank (chunks='sources')")
                if disp.last_chunks != ran:
                    ck.fail(f"rank {r} call {call}: the pipeline ran {disp.last_chunks}, not {ran}")
            disp.close()
    for f in ck.failures:
        print(f, flush=True)
    print(f"rank {r}: {ck.checks} checks, {len(ck.failures)} failed", flush=True)
    if args.json:
        merged = ck.gather()  # object collectives: over Gloo, no NCCL communicator is made
        if r == 0:
            write_results(args.json, merged)
    C.destroy()
    return 1 if ck.failures else 0


if __name__ == "__main__":
    sys.exit(main())
