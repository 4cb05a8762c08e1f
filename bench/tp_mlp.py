"""Timing a tensor-parallel MLP, forward and backward, with each overlap strategy of its layers.

The module is ``RowParallelLinear(act(ColumnParallelLinear(x)))`` (``overlap.layers``, no bias),
with or without sequence parallelism; every strategy runs the same weights and inputs. Gated
(the default, Llama's MLP): the column layer is ``2 * ffn`` wide, and each rank's shard of it is
halved into the gate and the up projection, ``silu(gate) * up``; else ``silu`` of an ``ffn``-wide
layer. For each
token count the same run times one forward + backward per strategy (every strategy in the same
rounds, ``bench.harness.time_interleaved``) and compares its output and gradients (input and
both weights) with those of ``strategy="sequential"``: ``max_rel_err`` is the largest difference
over the largest magnitude of the sequential value, across the four tensors.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

import collectives as C
from overlap.layers import ColumnParallelLinear, RowParallelLinear

from .harness import _slowest, paired_ratio
from .harness import time_interleaved as _time_interleaved

__all__ = ["MLPRecord", "measure_mlp", "format_mlp_table", "plot_mlp"]


@dataclass
class MLPRecord:
    tokens: int
    hidden: int
    ffn_hidden: int
    sequence_parallel: bool
    world: int
    dtype: str
    device: str
    strategy: str         # sequential, chunked/4, copy_engine/4, auto
    time_us: float        # forward + backward
    sequential_us: float
    speedup: float        # sequential / time
    max_rel_err: float    # against the sequential strategy's output and gradients
    gated: bool = True    # the SwiGLU MLP
    speedup_paired: float | None = None  # the median over rounds of sequential / time in the same round

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class _MLP(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, sp: bool, strategy: str, chunks: int, dtype: torch.dtype,
                 device: torch.device, gated: bool) -> None:
        super().__init__()
        self.gated = gated
        self.fc1 = ColumnParallelLinear(hidden, 2 * ffn if gated else ffn, bias=False, sequence_parallel=sp,
                                        strategy=strategy, chunks=chunks, dtype=dtype, device=device)
        self.fc2 = RowParallelLinear(ffn, hidden, bias=False, sequence_parallel=sp, strategy=strategy, chunks=chunks,
                                     dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.silu(h))


def measure_mlp(comm: C.Communicator, tokens: int, hidden: int, ffn: int, dtype: torch.dtype, device: torch.device, *,
                sequence_parallel: bool = True, variants: tuple[str, ...] = ("sequential", "chunked/4", "auto"),
                iters: int = 5, reps: int = 5, seed: int = 0, gated: bool = True) -> list[MLPRecord]:
    """One record per variant ("strategy" or "strategy/chunks") at one token count (tokens of
    the whole sequence; each rank holds ``tokens / world`` of them under sequence parallelism)."""
    w, r = comm.size, comm.rank
    if tokens % w:
        raise C.InvalidArgumentError("tokens", tokens, f"is not divisible by the {w} ranks", f"use a multiple of {w}")
    gen = torch.Generator(device=device).manual_seed(seed)  # the same module and data on every rank
    mods: dict[str, _MLP] = {}
    for v in variants:
        strategy, _, chunks = v.partition("/")
        mods[v] = _MLP(hidden, ffn, sequence_parallel, strategy, int(chunks or 1), dtype, device, gated)
    first = mods[variants[0]]
    with torch.no_grad():
        for p in first.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * p.shape[-1] ** -0.5)
        for m in mods.values():
            m.load_state_dict(first.state_dict())
    x_full = torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.float32).to(dtype)
    g_full = torch.randn(tokens, hidden, generator=gen, device=device, dtype=torch.float32).to(dtype)
    rows = slice(r * tokens // w, (r + 1) * tokens // w) if sequence_parallel else slice(None)
    x, gout = x_full[rows].contiguous(), g_full[rows].contiguous()

    def step(m: _MLP) -> tuple[torch.Tensor, ...]:
        for p in m.parameters():
            p.grad = None
        xi = x.detach().requires_grad_()
        y = m(xi)
        y.backward(gout)
        return y, xi.grad, m.fc1.weight.grad, m.fc2.weight.grad  # type: ignore[return-value]

    results = {v: step(m) for v, m in mods.items()}
    ref = results["sequential"] if "sequential" in results else results[variants[0]]
    errs = {}
    for v, got in results.items():
        e = max(float((a.detach().float() - b.detach().float()).abs().max())
                / max(float(b.detach().float().abs().max()), 1e-30) for a, b in zip(got, ref))
        errs[v] = _slowest(comm, [e], device)[0]
    rounds: dict[str, list[float]] = {}
    times = _time_interleaved({v: functools.partial(step, m) for v, m in mods.items()}, comm, device, iters, reps,
                              rounds=rounds)
    base = "sequential" if "sequential" in times else variants[0]
    seq = times[base]
    name = str(dtype).removeprefix("torch.")
    return [MLPRecord(tokens, hidden, ffn, sequence_parallel, w, name, str(device), v, times[v], seq, seq / times[v],
                      errs[v], gated, paired_ratio(rounds, base, v)) for v in variants]


def format_mlp_table(records: list[MLPRecord]) -> str:
    lines = []
    for r in records:
        lines.append(f"tokens {r.tokens:>6} h {r.hidden} ffn {r.ffn_hidden} sp={int(r.sequence_parallel)} "
                     f"{'gated ' if r.gated else ''}{r.strategy:<14} {r.time_us:10.1f} us  {r.speedup:5.2f}x vs sequential"
                     + (f" ({r.speedup_paired:.3f}x paired)" if r.speedup_paired is not None else "") + "  "
                     f"max rel err {r.max_rel_err:.2e}")
    return "\n".join(lines)


def plot_mlp(records: list[MLPRecord], path: str, title: str = "") -> None:
    """PNG: speed-up over the sequential strategy per token count, one bar per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = sorted({r.tokens for r in records})
    names = list(dict.fromkeys(r.strategy for r in records))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs, ys = [], []
        for j, t in enumerate(tokens):
            hit: Any = [r for r in records if r.tokens == t and r.strategy == name]
            if hit:
                xs.append(j + i * width)
                ys.append(hit[0].speedup_paired or hit[0].speedup)
        ax.bar(xs, ys, width, label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tokens))], [str(t) for t in tokens])
    ax.set_xlabel("tokens")
    ax.set_ylabel("speed-up over sequential (fwd + bwd, paired)")
    ax.legend(fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
