"""Reports of benchmark records: an nccl-tests-style table, JSON, CSV and a busbw plot."""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Sequence
from typing import Any

from .harness import Record

__all__ = ["format_table", "write_json", "write_csv", "plot", "Progress"]


def _label(r: Record) -> str:
    return r.algorithm + ("+graph" if r.graph else "") + (f"({r.chosen})" if r.chosen else "")


def format_table(records: Sequence[Record]) -> str:
    """One row per (size, algorithm); ``vs native`` is time / native's time at that size and mode."""
    head = (f"{'size(B)':>12} {'count':>11} {'type':>8} {'algorithm':<28} {'time(us)':>10} {'min(us)':>10} "
            f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6} {'vs native':>9}")
    lines = [head, "-" * len(head)]
    native = {(r.op, r.bytes, r.graph): r.time_us for r in records if r.algorithm == "native"}
    prev = None
    for r in records:
        if prev is not None and r.bytes != prev:
            lines.append("")
        prev = r.bytes
        base = native.get((r.op, r.bytes, r.graph)) or native.get((r.op, r.bytes, False))
        ratio = f"{r.time_us / base:9.2f}" if base else f"{'-':>9}"
        wrong = "-" if r.wrong is None else str(r.wrong)
        lines.append(f"{r.bytes:>12} {r.count:>11} {r.dtype:>8} {_label(r):<28} {r.time_us:>10.1f} {r.time_us_min:>10.1f} "
                     f"{r.algbw_GBps:>11.3f} {r.busbw_GBps:>11.3f} {wrong:>6} {ratio}")
    bad = sum(r.wrong or 0 for r in records)
    lines.append(f"# out-of-bounds values: {bad}  ({'OK' if bad == 0 else 'FAILED'})")
    return "\n".join(lines)


def run_meta(script: str, comm: Any, cuda: bool) -> dict[str, Any]:
    """What a benchmark's JSON says about its run: command line, date, world, backend, torch,
    device and, on CUDA, NCCL's version."""
    import os
    import sys
    import time

    import torch

    meta: dict[str, Any] = {"command": " ".join([script, *sys.argv[1:]]), "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "world": comm.size, "backend": comm.backend, "torch": torch.__version__,
                            "device": torch.cuda.get_device_name() if cuda else f"cpu:{os.cpu_count()}"}
    if cuda:
        meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return meta


def write_json(records: Sequence[Record], path: str, meta: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "records": [r.as_dict() for r in records]}, f, indent=1)
        f.write("\n")


def write_csv(records: Sequence[Record], path: str) -> None:
    rows = [r.as_dict() for r in records]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["op"])
        w.writeheader()
        w.writerows(rows)


def plot(records: Sequence[Record], path: str, title: str = "") -> None:
    """PNG: busbw against size (log2 x) and time against size (log-log), one line per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_bw, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    for key in dict.fromkeys((r.op, _label(r).split("(")[0]) for r in records):
        rs = sorted((r for r in records if (r.op, _label(r).split("(")[0]) == key), key=lambda r: r.bytes)
        name = key[1] if len({r.op for r in records}) == 1 else f"{key[0]} {key[1]}"
        style = "--" if key[1].startswith("native") else "-"
        ax_bw.plot([r.bytes for r in rs], [r.busbw_GBps for r in rs], style, marker="o", ms=3, label=name)
        ax_t.plot([r.bytes for r in rs], [r.time_us for r in rs], style, marker="o", ms=3, label=name)
    ax_bw.set_xscale("log", base=2)
    ax_bw.set_xlabel("message size (bytes)")
    ax_bw.set_ylabel("bus bandwidth (GB/s)")
    ax_t.set_xscale("log", base=2)
    ax_t.set_yscale("log")
    ax_t.set_xlabel("message size (bytes)")
    ax_t.set_ylabel("time per call (us, median)")
    for ax in (ax_bw, ax_t):
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_vs_native(records: Sequence[Record], path: str, title: str = "") -> None:
    """PNG: each algorithm's time over native's in the same mode, one panel per op and mode
    (below 1 is faster than the backend's own collective)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in records))
    modes = sorted({r.graph for r in records})
    fig, axes = plt.subplots(len(ops), len(modes), figsize=(7 * len(modes), 4.2 * len(ops)), squeeze=False)
    for ax, (op, graph) in zip(axes.flat, [(o, g) for o in ops for g in modes]):
        mine = [r for r in records if r.op == op and r.graph == graph]
        base = {r.bytes: r.time_us for r in mine if r.algorithm == "native"}
        for name in dict.fromkeys(r.algorithm for r in mine if r.algorithm != "native"):
            rs = sorted((r for r in mine if r.algorithm == name and r.bytes in base), key=lambda r: r.bytes)
            ax.plot([r.bytes for r in rs], [r.time_us / base[r.bytes] for r in rs], marker="o", ms=3, label=name)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("time / native's time")
        ax.set_title(f"{op}, {'CUDA graph' if graph else 'eager'}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class Progress:
    """A one-line progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled and sys.stderr.isatty()

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        width = 30
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {what:<40}")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def tuned_table(records: Sequence[Record], meta: dict[str, Any]) -> dict[str, Any]:
    """The measured-fastest algorithm per (op, dtype, size), as ``algorithm="auto"`` reads it (``COMMOPS_TUNED``).

    Only eager records of explicit algorithms count ("auto" is what the table steers); each entry
    covers sizes up to its own, so a size between two measured ones takes the larger one's choice.
    """
    best: dict[tuple[str, str, int], Record] = {}
    native: dict[tuple[str, str, int], Record] = {}
    for r in records:
        if r.graph or r.algorithm == "auto":
            continue
        key = (r.op, r.dtype, r.bytes)
        if r.algorithm == "native":
            native[key] = r
        if key not in best or r.time_us < best[key].time_us:
            best[key] = r
    entries = []
    for key in sorted(best):
        r = best[key]
        base = native.get(key)
        note = f"{r.time_us:.0f} us" + (f", native {base.time_us:.0f} us" if base is not None else "")
        entries.append({"op": r.op, "dtype": r.dtype, "max_bytes": r.bytes, "algorithm": r.algorithm, "note": note})
    keep = ("world", "nodes", "backend", "date", "command", "torch", "nccl", "gpu")
    return {"meta": {k: meta[k] for k in keep if k in meta}, "entries": entries}
