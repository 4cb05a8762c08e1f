"""The command line behind ``launch/bench_*.py``: nccl-tests' flags plus ``--algorithms``.

Run under a launcher (``torchrun --nproc-per-node N`` or ``mpiexec -n N``); rank 0 prints the
table and writes the files.

Every run leaves a record by default, as nccl-tests-style tools' users expect: rank 0 makes a new
folder ``commops-results/<op>-<YYYYmmdd-HHMMSS>`` under the current directory (``--out DIR``
for another, ``--out none`` for none) and writes ``results.json`` (the records and the run's
metadata) and ``plot.png`` into it, the plot skipped with a note where matplotlib is missing,
so that a bare install still measures. The folder is made before the sweep, so that a folder
that cannot be made fails the run in its first second, not after it; a run that dies half-way
leaves it empty. ``--json``/``--csv``/``--plot`` write their files as well, where they say.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

import collectives as C
from collectives.bootstrap import launcher_environment

from .harness import Record, bind_to_core, prepare, sweep
from .report import Progress, format_table, plot, plot_vs_native, tuned_table, write_csv, write_json

__all__ = ["parse_size", "sizes", "build_parser", "record_folder", "main", "main_all_reduce"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
DTYPES = {"float": torch.float32, "float32": torch.float32, "double": torch.float64, "float64": torch.float64,
          "half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "int32": torch.int32, "int": torch.int32, "int64": torch.int64}


def where(comm: C.Communicator, dtype: str | None) -> tuple[bool, torch.device, torch.dtype]:
    """A GPU benchmark's (cuda, device, dtype): the current CUDA device where the group has a CUDA
    backend and a GPU is there, else the CPU; the dtype named (``DTYPES``), by default bf16 on
    GPUs and float32 on CPUs."""
    cuda = bool(comm.backend_for("cuda")) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return cuda, device, DTYPES[dtype or ("bf16" if cuda else "float")]


def parse_size(text: str) -> int:
    """'8', '1K', '16M', '1G' (powers of 1024, as nccl-tests) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGB]?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"size {text!r}: use a number with an optional K, M or G suffix (e.g. 64K)")
    return int(m.group(1)) * _UNITS[m.group(2)]


def sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    if factor < 2:
        raise argparse.ArgumentTypeError("--step-factor must be at least 2")
    out = []
    s = max(1, min_bytes)
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def _ops(text: str) -> list[str]:
    ops = list(C.DATA_OPS) if text == "all" else [o.strip() for o in text.split(",")]
    bad = [o for o in ops if o not in C.DATA_OPS]
    if bad:
        raise argparse.ArgumentTypeError(f"--op {bad}: use {', '.join(C.DATA_OPS)}, a comma-separated list, or 'all'")
    return ops


def build_parser(op: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=f"Benchmark {'collectives' if op is None else op}: every algorithm against native.")
    if op is None:
        p.add_argument("--op", required=True, type=_ops, help=f"one of {', '.join(C.DATA_OPS)}, a comma-separated list, or 'all'")
    p.add_argument("-b", "--min-bytes", type=parse_size, default=parse_size("8"))
    p.add_argument("-e", "--max-bytes", type=parse_size, default=parse_size("64M"))
    p.add_argument("-f", "--step-factor", type=int, default=2)
    p.add_argument("-d", "--dtype", default="float", choices=sorted(DTYPES))
    p.add_argument("-n", "--iters", type=int, default=20, help="calls per timed loop")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed calls first")
    p.add_argument("-r", "--reps", type=int, default=5, help="timed loops; the table shows their median")
    p.add_argument("-t", "--min-loop-ms", type=float, default=0.0,
                   help="more calls per loop for fast sizes, until a loop lasts about this long (0: -n calls)")
    p.add_argument("-c", "--check", type=int, default=1, help="1: count #wrong on fresh data before timing")
    p.add_argument("-a", "--algorithms", default="all",
                   help="comma-separated names, 'all' (default), 'auto', or anchors: symm_mem_one_shot, symm_mem_two_shot")
    p.add_argument("-G", "--graph", choices=["0", "1", "both"], default="0", help="CUDA graph capture of the timed loop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the records and metadata here (as --out's results.json)")
    p.add_argument("--csv", metavar="PATH", help="also write the records here as CSV")
    p.add_argument("--plot", metavar="PATH", help="also draw the bandwidth and time plot here (as --out's plot.png)")
    p.add_argument("--out", metavar="DIR",
                   help="folder for this run's record: results.json (records and metadata) and plot.png (with "
                        "matplotlib). Default: a new commops-results/<op>-<YYYYmmdd-HHMMSS> under the current "
                        "directory. 'none': no record (--json/--csv/--plot still write theirs); ./none for a "
                        "folder of that name")
    p.add_argument("--plot-vs-native", metavar="PATH",
                   help="plot each algorithm's time / native's time, one panel per op and graph mode")
    p.add_argument("--tune", metavar="PATH", help="write the measured-fastest algorithm per size (for COMMOPS_TUNED)")
    p.add_argument("--backend", default=None, help="force a backend (default: nccl on GPUs, else gloo)")
    p.add_argument("--cpu-bind", choices=["core", "none"], default=None,
                   help="core (the default with a GPU): under torchrun, each local rank on a CPU core of its own, "
                        "where there are enough (bench.harness.bind_to_core); none (the default without)")
    return p


def _meta(args: argparse.Namespace, comm: C.Communicator, device: torch.device, op: str) -> dict[str, object]:
    meta: dict[str, object] = {
        "op": op, "command": " ".join(shlex.quote(a) for a in sys.argv), "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "world": comm.size, "backend": comm.backend, "torch": torch.__version__, "python": platform.python_version(),
        "host": platform.node(), "cpus": os.cpu_count(), "args": {k: v for k, v in vars(args).items()},
    }
    if device.type == "cuda":
        meta["cuda"] = torch.version.cuda
        meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        meta["gpu"] = torch.cuda.get_device_name(device)
    nodes = comm.topology.nodes()
    meta["nodes"] = len(nodes)
    meta["topology"] = nodes
    meta["calibration"] = os.environ.get("COMMOPS_CALIBRATION", "")
    launcher = "mpiexec" if any(k in os.environ for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")) else "torchrun"
    meta["launcher"] = launcher
    # threads per rank: torchrun sets OMP_NUM_THREADS=1 where it is unset, mpiexec leaves it
    meta["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    meta["torch_threads"] = torch.get_num_threads()
    return meta


RESULTS_ROOT = "commops-results"
_HOW_TO_PLOT = "pip install matplotlib, or the project's plot extra: pip install -e '.[plot]'"


def record_folder(out: str | None, name: str, now: datetime.datetime) -> str | None:
    """Make the folder a run's record goes into and return its path, or None for ``out="none"``.

    Args:
        out: ``--out``: a folder (made if missing, reused if there: its ``results.json`` and
            ``plot.png`` are replaced), "none", or None for the default: a new folder
            ``commops-results/<name>-<YYYYmmdd-HHMMSS>`` under the current directory, ``-2``,
            ``-3``, ... appended where that exists (two runs in one second keep both records).
        name: what the default folder is named after (the op).
        now: the run's start, for the default folder's name.
    Raises:
        SystemExit: the folder cannot be made (naming the folder and the two ways out).
    """
    if out is not None and out.lower() == "none":
        return None
    base = out if out is not None else os.path.join(RESULTS_ROOT, f"{name}-{now:%Y%m%d-%H%M%S}")
    try:
        if out is not None:
            os.makedirs(out, exist_ok=True)
            return out
        os.makedirs(RESULTS_ROOT, exist_ok=True)
        for i in itertools.count(1):
            path = base if i == 1 else f"{base}-{i}"
            try:
                os.mkdir(path)  # not makedirs(exist_ok=True): a folder that is there is another run's
                return path
            except FileExistsError:
                pass
    except OSError as exc:
        raise SystemExit(f"--out {base}: cannot make this folder ({exc.strerror}); "
                         "give a writable one with --out DIR, or --out none for no record") from exc
    raise AssertionError("itertools.count() ended")


def _title(records: Sequence[Record], world: int, where: str) -> str:
    """The plots' title, from the records (what ran), not from the flags: the backend is the one
    that moved the tensors (a CPU run of a "cpu:gloo,cuda:nccl" group says gloo)."""
    ops = ", ".join(dict.fromkeys(r.op for r in records))
    backends = "/".join(dict.fromkeys(r.backend for r in records))
    dtypes = "/".join(dict.fromkeys(r.dtype for r in records))
    return f"{ops}, {world} ranks, {backends} ({where}), {dtypes}"


def _no_matplotlib(exc: ModuleNotFoundError) -> bool:
    return (exc.name or "").split(".")[0] == "matplotlib"


def main(argv: Sequence[str] | None = None, op: str | None = None) -> int:
    args = build_parser(op).parse_args(argv)
    started = time.monotonic()
    ops = [op] if op else args.op
    core = None
    launch = launcher_environment()
    if (args.cpu_bind or ("core" if torch.cuda.is_available() else "none")) == "core" \
            and launch is not None and launch.launcher == "torchrun":  # (under MPI the local ranks come with init)
        core = bind_to_core(launch.local_rank, launch.local_world_size)  # before init: torch's and NCCL's threads too
    comm = C.init(backend=args.backend)
    device = torch.device("cuda", torch.cuda.current_device()) if comm.backend_for("cuda") and torch.cuda.is_available() \
        else torch.device("cpu")
    dtype = DTYPES[args.dtype]
    modes = {"0": (False,), "1": (True,), "both": (False, True)}[args.graph]
    if device.type != "cuda" and any(modes):
        raise SystemExit("--graph needs CUDA tensors (a GPU backend)")
    lead = comm.rank == 0
    folder = record_folder(args.out, ops[0] if len(ops) == 1 else "collectives", datetime.datetime.now()) \
        if lead else None
    comm.topology  # noqa: B018 - discovery is collective: every rank, before rank 0 writes the metadata
    records = []
    for one in ops:
        algos = prepare(one, [a.strip() for a in args.algorithms.split(",")], comm, dtype, device,
                        say=lambda msg: print(msg, flush=True) if lead else None, skip_unsupported=len(ops) > 1)
        if lead:
            print(f"# commops {one} benchmark: {comm.size} ranks, backend {comm.backend_for(device.type) or comm.backend}, "
                  f"device {device.type}, "
                  f"dtype {args.dtype}, iters {args.iters} x reps {args.reps}, warmup {args.warmup}", flush=True)
            print(f"# algorithms: {', '.join(algos)}", flush=True)
        done = sweep(comm, one, algos, sizes(args.min_bytes, args.max_bytes, args.step_factor), dtype, device,
                     graph_modes=modes, progress=Progress(lead), iters=args.iters, warmup=args.warmup, reps=args.reps,
                     check=bool(args.check), seed=args.seed, min_loop_s=args.min_loop_ms / 1e3)
        if lead:
            print(format_table(done), flush=True)
        records += done
    if lead:
        meta = _meta(args, comm, device, ",".join(ops))
        meta["cpu_core_rank0"] = core
        title = _title(records, comm.size, str(meta.get("gpu", device.type)))
        written: list[str] = []
        if folder is not None:
            written.append(os.path.join(folder, "results.json"))
            write_json(records, written[-1], meta)
            try:
                plot(records, os.path.join(folder, "plot.png"), title)
                written.append(os.path.join(folder, "plot.png"))
            except ModuleNotFoundError as exc:
                if not _no_matplotlib(exc):
                    raise
                print(f"# plot.png skipped: matplotlib is not installed ({_HOW_TO_PLOT})", flush=True)
        if args.json:
            write_json(records, args.json, meta)
        if args.csv:
            write_csv(records, args.csv)
        if args.tune:
            with open(args.tune, "w") as f:
                json.dump(tuned_table(records, meta), f, indent=1)
                f.write("\n")
        written += [p for p in (args.json, args.csv, args.tune) if p]
        for flag, path, draw in (("--plot", args.plot, plot), ("--plot-vs-native", args.plot_vs_native, plot_vs_native)):
            if not path:
                continue
            try:
                draw(records, path, title)
            except ModuleNotFoundError as exc:
                if not _no_matplotlib(exc):
                    raise
                raise SystemExit(f"{flag} {path}: needs matplotlib, which is not installed ({_HOW_TO_PLOT}); "
                                 f"wrote {', '.join(written) or 'nothing'}") from exc
            written.append(path)
        if written:
            print("# wrote " + ", ".join(written), flush=True)
        print(f"# ran in {time.monotonic() - started:.0f} s", flush=True)
        if folder is not None:  # the last line: where the record is
            print(f"# record of this run: {folder}{os.sep}", flush=True)
    bad = sum(r.wrong or 0 for r in records)
    dist.barrier()
    del comm
    C.destroy()
    return 1 if bad else 0


def main_all_reduce() -> int:
    """The main job (``launch/bench_allreduce.py``; the ``commops-bench-allreduce`` command)."""
    return main(op="all_reduce")


if __name__ == "__main__":
    sys.exit(main())
