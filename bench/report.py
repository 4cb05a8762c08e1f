"""Reports of benchmark records: an nccl-tests-style table, JSON, CSV and two plots.

The plots are for reading at a glance: sizes labelled 1K/1M/1G (powers of 1024, the units of
``-b``/``-e`` and of nccl-tests), times in µs, log scales on both axes so that the small sizes,
where the algorithms differ most, do not sit flat against zero, the spread of the timed loops as
a band, and one fixed style per algorithm (colour, marker and, past ten, line style) in every
panel and both plots. Legends sit below their panel: inside, ten lines always have one covered.
One ratio is drawn and printed, under one name everywhere: "time / native's time" (below 1:
faster than the backend's own collective); its inverse is never shown as a speed-up.
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Sequence
from typing import Any

from .harness import Record

__all__ = ["format_table", "write_json", "write_csv", "plot", "plot_vs_native", "Progress"]


def _label(r: Record) -> str:
    return r.algorithm + ("+graph" if r.graph else "") + (f"({r.chosen})" if r.chosen else "")


def format_table(records: Sequence[Record]) -> str:
    """One row per (size, algorithm); ``time/native`` is the time over native's at that size and
    mode, paired by round where they were timed in the same rounds (``Record.vs_native``); the
    fastest row of each size and mode with no wrong value is marked ``<- fastest``."""
    head = (f"{'size(B)':>12} {'count':>11} {'type':>8} {'algorithm':<28} {'time(us)':>10} {'min(us)':>10} "
            f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>6} {'time/native':>11}  fastest")
    lines = [head, "-" * len(head)]
    native = {(r.op, r.bytes, r.graph): r.time_us for r in records if r.algorithm == "native"}
    fastest: dict[tuple[str, int, bool], Record] = {}  # per size and mode, of the rows with no wrong value
    for r in records:
        key = (r.op, r.bytes, r.graph)
        if not r.wrong and (key not in fastest or r.time_us < fastest[key].time_us):
            fastest[key] = r
    prev = None
    for r in records:
        if prev is not None and r.bytes != prev:
            lines.append("")
        prev = r.bytes
        base = native.get((r.op, r.bytes, r.graph)) or native.get((r.op, r.bytes, False))
        vs = r.vs_native if r.vs_native is not None else (r.time_us / base if base else None)
        ratio = f"{vs:11.2f}" if vs is not None else f"{'-':>11}"
        wrong = "-" if r.wrong is None else str(r.wrong)
        lines.append(f"{r.bytes:>12} {r.count:>11} {r.dtype:>8} {_label(r):<28} {r.time_us:>10.1f} {r.time_us_min:>10.1f} "
                     f"{r.algbw_GBps:>11.3f} {r.busbw_GBps:>11.3f} {wrong:>6} {ratio}"
                     + ("  <- fastest" if fastest.get((r.op, r.bytes, r.graph)) is r else ""))
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


# Line styles for the plots, one per algorithm, the same in every panel and in both plots: a
# colour (tab10's ten) and a marker (nine, so that colour and marker repeat together only after 90
# algorithms), and from the eleventh algorithm on a dashed or dash-dotted line too, so that even
# in grey print two algorithms never look alike. Native is always the thick black line: the
# reference every other line is read against.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">")
_LINES = ("-", "--", "-.")
_NATIVE = {"color": "black", "ls": "--", "lw": 2.0, "marker": None}


def _styles(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """Matplotlib keyword arguments per algorithm name, in order of first appearance."""
    import matplotlib

    colours = matplotlib.color_sequences["tab10"]
    names = [a for a in dict.fromkeys(r.algorithm for r in records) if a != "native"]
    out: dict[str, dict[str, Any]] = {"native": dict(_NATIVE)}
    for i, name in enumerate(names):
        out[name] = {"color": colours[i % len(colours)], "marker": _MARKERS[i % len(_MARKERS)],
                     "ls": _LINES[(i // len(colours)) % len(_LINES)], "lw": 1.4}
    return out


def _size_text(nbytes: float) -> str:
    """8 -> '8', 1024 -> '1K', 3 << 20 -> '3M' (powers of 1024, as nccl-tests and ``-b``/``-e``)."""
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nbytes >= 1 << shift:
            v = nbytes / (1 << shift)
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{nbytes:.0f}"


def _size_axis(ax: Any, sizes: Sequence[int]) -> None:
    """A log2 size axis labelled 1K/1M/1G: a labelled tick every 1, 2, 5 or 10 powers of two (the
    fewest that keeps at most 12 labels, on steps that land on 1K, 1M and 1G), an unlabelled one
    at every power of two."""
    import math

    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    lo = math.floor(math.log2(max(1, min(sizes))))
    hi = math.ceil(math.log2(max(1, max(sizes))))
    step = next((k for k in (1, 2, 5, 10) if (hi - lo) // k + 1 <= 12), 10)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator([2.0 ** e for e in range(lo, hi + 1) if e % step == 0 or step == 1]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _size_text(v)))
    ax.xaxis.set_minor_locator(FixedLocator([2.0 ** e for e in range(lo, hi + 1)]))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(2.0 ** lo / 1.2, 2.0 ** hi * 1.2)
    ax.set_xlabel("message size (bytes; 1K = 1024, 1M = 1024², 1G = 1024³)")


def _number_text(v: float) -> str:
    """0.0005 -> '0.0005', 20 -> '20', 20000 -> '20,000': plain numbers, not 2e+04."""
    return f"{v:,.0f}" if v >= 1000 else f"{v:g}"


def _log_y(ax: Any) -> None:
    """Log y labelled with plain numbers at 1, 2 and 5 of each decade (at 1 only where the data
    span more than three decades: the labels would crowd); call after drawing."""
    import math

    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    wide = lo > 0 and math.log10(hi / lo) > 3
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _number_text(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _legend(ax: Any, n: int) -> None:
    # below the panel, not on it: with ten lines, a legend inside always covers some of them
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=min(n, 4), fontsize=8, frameon=False)


def plot(records: Sequence[Record], path: str, title: str = "") -> None:
    """PNG: per op, bus bandwidth and time per call against size, one line per algorithm (and per
    graph mode: dotted, hollow markers), both on log scales so that small sizes show.

    A line is the median over the timed loops; its shaded band runs from the fastest loop to the
    slowest (``time_us_min`` to ``time_us_max``; in bandwidth, the same loops' bandwidths).
    Needs matplotlib (the ``plot`` extra): raises ``ModuleNotFoundError`` without it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in records))
    styles = _styles(records)
    fig, axes = plt.subplots(len(ops), 2, figsize=(14, 6.2 * len(ops)), squeeze=False, layout="constrained")
    for (ax_bw, ax_t), op in zip(axes, ops):
        mine = [r for r in records if r.op == op]
        lines = list(dict.fromkeys((r.algorithm, r.graph) for r in mine))
        for name, graph in lines:
            rs = sorted((r for r in mine if (r.algorithm, r.graph) == (name, graph)), key=lambda r: r.bytes)
            x = [r.bytes for r in rs]
            style = dict(styles[name], label=name + (" (CUDA graph)" if graph else ""), ms=5)
            if graph:
                style.update(ls=":", mfc="none")
            # bandwidth is bytes over time, so a loop's bandwidth is the median's scaled by the time ratio
            bw_lo = [r.busbw_GBps * r.time_us / r.time_us_max if r.time_us_max > 0 else 0.0 for r in rs]
            bw_hi = [r.busbw_GBps * r.time_us / r.time_us_min if r.time_us_min > 0 else 0.0 for r in rs]
            ax_bw.plot(x, [r.busbw_GBps for r in rs], **style)
            ax_bw.fill_between(x, bw_lo, bw_hi, color=style["color"], alpha=0.09, lw=0)
            ax_t.plot(x, [r.time_us for r in rs], **style)
            ax_t.fill_between(x, [r.time_us_min for r in rs], [r.time_us_max for r in rs],
                              color=style["color"], alpha=0.09, lw=0)
        sizes = [r.bytes for r in mine]
        for ax in (ax_bw, ax_t):
            _size_axis(ax, sizes)
            _log_y(ax)
            ax.grid(True, which="major", alpha=0.35)
            ax.grid(True, which="minor", alpha=0.1)
            _legend(ax, len(lines))
        ax_bw.set_ylabel("bus bandwidth (GB/s)")
        ax_bw.set_title(f"{op}: bus bandwidth (higher is better)")
        ax_t.set_ylabel("time per call (µs)")
        ax_t.set_title(f"{op}: time per call (lower is better)")
    fig.suptitle(f"{title}\nlines: median of the timed loops; bands: fastest to slowest loop" if title else
                 "lines: median of the timed loops; bands: fastest to slowest loop")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_vs_native(records: Sequence[Record], path: str, title: str = "") -> None:
    """PNG: each algorithm's time / native's time in the same mode, against size, one panel per op
    and mode (below 1: faster than the backend's own collective).

    No band here: a ratio of two medians has no fastest and slowest loop of its own (the time
    panel of :func:`plot` shows each side's spread). Needs matplotlib (the ``plot`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r.op for r in records))
    modes = sorted({r.graph for r in records})
    styles = _styles(records)
    fig, axes = plt.subplots(len(ops), len(modes), figsize=(8 * len(modes), 5.6 * len(ops)), squeeze=False,
                             layout="constrained")
    for ax, (op, graph) in zip(axes.flat, [(o, g) for o in ops for g in modes]):
        mine = [r for r in records if r.op == op and r.graph == graph]
        base = {r.bytes: r.time_us for r in mine if r.algorithm == "native"}
        names = [a for a in dict.fromkeys(r.algorithm for r in mine) if a != "native"]
        for name in names:
            rs = sorted((r for r in mine if r.algorithm == name and r.bytes in base), key=lambda r: r.bytes)
            ax.plot([r.bytes for r in rs], [r.time_us / base[r.bytes] for r in rs], **dict(styles[name], label=name, ms=5))
        ax.axhline(1.0, **dict(_NATIVE, marker=None, label="native (= 1)"))
        _size_axis(ax, [r.bytes for r in mine])
        _log_y(ax)
        ax.set_ylabel("time / native's time (below 1: faster)")
        ax.set_title(f"{op}, {'CUDA graph' if graph else 'eager'}: time / native's time")
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.1)
        _legend(ax, len(names) + 1)
    fig.suptitle(title)
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
