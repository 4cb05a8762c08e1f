"""The GPU check scripts' results by family, and how their pytest cases read them back.

A check script (``tests/gpu_*_check.py``, run under torchrun) declares its families statically:
a module-level ``families(...)`` built from the same lists its loops go over, importable without
a GPU, so that pytest parametrizes one case per family at collection time. Each rank records
into a ``Checks``: ``with checks.family(name):`` names the family of the checks inside it (or
``checks.begin(name)``, of those that follow, for sections in a row that a block would have to
re-indent), ``count()`` counts a check and ``fail(message)`` records a failure. At the end ``gather()``
(collective) merges every rank's records and rank 0 writes them to the script's ``--json`` path
with ``write_results``::

    {family: {"checks": n, "per_rank": [n0, n1, ...], "failures": [message, ...]}, ...}

The scripts keep their summary lines and exit codes for people and ``launch/gpu_suite.sh``.
``run_script`` runs a script once under torchrun into a fresh JSON file, and
``ScriptRun.assert_family`` fails a case whose family ran no check on some rank or recorded a
failure, and every case of a run that crashed, timed out or left its family out, with the
tail of the script's output.

Rejected: grepping the output for " 0 failed" (one verdict for hundreds of checks, and a line
printed by the ranks that did not crash still matches); one file per rank (rank 0's gathered
file is either complete or absent; a reader of per-rank files must know how many to expect).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["NO_MULTICAST", "Checks", "ScriptRun", "dtype_name", "merge", "report", "run_script",
           "same_bits_on_every_rank", "shared_gpu_ranks", "write_results"]

ROOT = Path(__file__).resolve().parent.parent

# NVLink multicast stays off in every GPU test process (as in launch/gpu_suite.sh)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

Results = dict[str, dict[str, Any]]


def shared_gpu_ranks() -> tuple[Any, torch.device]:
    """A check script's start under torchrun: this rank's GPU (``LOCAL_RANK`` modulo the GPUs, so
    that ranks may share one), the default group over Gloo and NCCL (NCCL only made if a check
    uses it), and its communicator and device."""
    import collectives as C  # deferred: the pytest side of this module needs none of the library

    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl")
    return C.get_communicator(None), torch.device("cuda", torch.cuda.current_device())


def same_bits_on_every_rank(ck: Checks, what: str, t: torch.Tensor) -> None:
    """A check (in ``ck``'s current family) that ``t`` holds the same bits on every rank of the
    default group (collective)."""
    ck.count()
    bits = t.detach().contiguous().view(torch.uint8).cpu()
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, bits)
    if any(not torch.equal(bits, b) for b in every):  # type: ignore[arg-type]
        ck.fail(f"{what}: differs between ranks")


def check_arguments(families: Sequence[str], argv: Sequence[str] | None = None, *, verbose: bool = False
                    ) -> argparse.Namespace:
    """A GPU check script's command line: ``--json`` (where ``report`` writes), ``--only`` (as
    ``args.only``, the set of families to run: every one of ``families`` by default) and, with
    ``verbose``, ``-v``."""
    p = argparse.ArgumentParser()
    p.add_argument("--json", help="write the results by family here (tests/_checks.py)")
    if verbose:
        p.add_argument("-v", "--verbose", action="store_true", help="print each call's progress (to find a hang)")
    p.add_argument("--only", help="comma-separated families to run (default: all)")
    args = p.parse_args(argv)
    args.only = set(args.only.split(",")) if args.only else set(families)
    return args


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as family names spell it: ``fp32``, ``fp16``, ``bf16``, else torch's name."""
    name = str(dtype).removeprefix("torch.")
    return _SHORT.get(name, name)


class Checks:
    """One rank's checks, counted and failed by family.

    Args:
        families: every family the script may record into, in the order to report them
            (the script's static ``families(...)``); a name outside them raises ``KeyError``.
        rank: this process's rank (reported by ``gather``).
    """

    def __init__(self, families: Iterable[str], rank: int) -> None:
        names = list(families)
        if len(set(names)) != len(names):
            raise ValueError(f"families declared twice: {sorted({n for n in names if names.count(n) > 1})}")
        self.rank = rank
        self._checks = dict.fromkeys(names, 0)
        self._failures: dict[str, list[str]] = {n: [] for n in names}
        self._current: str | None = None

    @contextmanager
    def family(self, name: str) -> Iterator[None]:
        """The checks and failures recorded inside the block belong to ``name`` (blocks nest; the
        innermost wins). Not thread-local: a thread the block starts and joins records into it."""
        outer = self._current
        self.begin(name)
        try:
            yield
        finally:
            self._current = outer

    def begin(self, name: str) -> None:
        """The checks and failures recorded from here on belong to ``name``, until the next
        ``begin`` or the end of the ``family`` block around it."""
        if name not in self._checks:
            raise KeyError(f"family {name!r} is not among the declared families {list(self._checks)}")
        self._current = name

    def count(self, n: int = 1) -> None:
        """``n`` more checks ran in the current family."""
        self._checks[self._family()] += n

    def fail(self, *messages: str) -> None:
        """Failures of the current family (any number; a check may fail more than once)."""
        self._failures[self._family()].extend(messages)

    def _family(self) -> str:
        if self._current is None:
            raise RuntimeError("a check was recorded outside any family: wrap it in `with checks.family(name):`")
        return self._current

    @property
    def checks(self) -> int:
        """This rank's checks, every family's."""
        return sum(self._checks.values())

    @property
    def failures(self) -> list[str]:
        """This rank's failures, family by family."""
        return [m for ms in self._failures.values() for m in ms]

    def results(self) -> Results:
        """This rank's records: ``{family: {"checks": n, "failures": [...]}}``, every declared family."""
        return {f: {"checks": n, "failures": list(self._failures[f])} for f, n in self._checks.items()}

    def gather(self, group: dist.ProcessGroup | None = None) -> Results:
        """Every rank's records merged (``merge``). Collective over ``group``: every rank calls it;
        object collectives, so on Gloo where the group has it (no NCCL communicator is made)."""
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, self.results(), group=group)
        return merge(every)


def merge(every: Sequence[Mapping[str, Mapping[str, Any]]]) -> Results:
    """Ranks' records (``Checks.results``, in rank order) as one: per family the total checks,
    the checks of each rank (0 where a rank lacks the family) and the failures, rank by rank."""
    out: Results = {}
    for mine in every:
        for f in mine:
            out.setdefault(f, {"checks": 0, "per_rank": [], "failures": []})
    for f, merged in out.items():
        for mine in every:
            rec = mine.get(f, {"checks": 0, "failures": []})
            merged["checks"] += rec["checks"]
            merged["per_rank"].append(rec["checks"])
            merged["failures"].extend(rec["failures"])
    return out


def write_results(path: str | os.PathLike[str], results: Results) -> None:
    """``results`` as JSON at ``path``, renamed into place: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(path)


def report(ck: Checks, json_path: str | None, what: str, world: int) -> int:
    """The end of a check script (collective): every rank's records gathered; rank 0 prints the
    first failures and a summary line and writes them to ``json_path``. The number of failures."""
    every = ck.gather()
    flat = [f"{family}: {f}" for family, rec in every.items() for f in rec["failures"]]
    if ck.rank == 0:
        for f in flat[:40]:
            print("FAIL", f)
        print(f"{what} checks: {ck.checks} per rank on {world} ranks, {len(flat)} failed", flush=True)
        if json_path:
            write_results(json_path, every)
    return len(flat)


@dataclass(frozen=True)
class ScriptRun:
    """How one torchrun of a check script ended, and the results it wrote."""

    script: str
    nproc: int
    timeout: float
    returncode: int | None  # None: killed at the time limit
    stdout: str
    stderr: str
    results: Results | None  # None: no results file, or not one that parses (see ``unread``)
    unread: str = ""  # why ``results`` is None

    def problem(self, family: str) -> str | None:
        """What is wrong with ``family`` in this run, or ``None`` if it passed."""
        what = f"{self.script} on {self.nproc} ranks"
        if self.returncode is None:
            return f"{what}: killed after its {self.timeout:.0f} s limit{self._tail()}"
        if self.results is None:
            return f"{what}: exit {self.returncode}, no results ({self.unread}){self._tail()}"
        rec = self.results.get(family)
        if rec is None:
            return f"{what} (exit {self.returncode}) reported no family {family!r}{self._tail()}"
        if rec["failures"]:
            shown = "\n".join(rec["failures"][:50])
            more = f"\n... and {len(rec['failures']) - 50} more" if len(rec["failures"]) > 50 else ""
            return f"{family}: {len(rec['failures'])} failed of {rec['checks']} checks:\n{shown}{more}"
        per_rank = list(rec["per_rank"]) + [0] * (self.nproc - len(rec["per_rank"]))
        idle = [q for q, n in enumerate(per_rank) if n < 1]
        if idle:
            return f"{family}: no check ran on rank(s) {idle} (checks by rank: {per_rank})"
        if self.returncode != 0 and not any(r["failures"] for r in self.results.values()):
            return f"{what}: exit {self.returncode} though no check failed{self._tail()}"
        return None

    def assert_family(self, family: str) -> None:
        """Fails the calling test with ``problem(family)``, if there is one."""
        import pytest  # the reading side only: the scripts import this module where pytest may be absent

        problem = self.problem(family)
        if problem is not None:
            pytest.fail(problem, pytrace=False)

    def _tail(self) -> str:
        return f"\n--- stdout (tail) ---\n{self.stdout[-4000:]}\n--- stderr (tail) ---\n{self.stderr[-6000:]}"


def run_script(script: str, nproc: int, json_path: Path, *, env: Mapping[str, str] | None = None,
               timeout: float = 900, args: Sequence[str] = ()) -> ScriptRun:
    """``script`` (relative to the repository) under torchrun with ``nproc`` ranks, its results
    asked for at ``json_path``. At ``timeout`` seconds, or if the caller is interrupted, torchrun
    and every rank it started are ended (``_end``)."""
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script,
           "--json", str(json_path), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    returncode: int | None
    try:
        out, err = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        _end(proc)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired as exc:  # something still holds the pipes: keep what came
            out, err = (_text(exc.stdout), _text(exc.stderr))
        returncode = None
    except BaseException:  # interrupted (Ctrl-C, pytest-timeout): leave no rank behind
        _end(proc)
        raise
    results, unread = None, ""
    if not json_path.exists():
        unread = f"{json_path.name} was not written"
    else:
        try:
            results = json.loads(json_path.read_text())
        except ValueError as exc:
            unread = f"{json_path.name} does not parse: {exc}"
    return ScriptRun(script, nproc, timeout, returncode, out, err, results, unread)


def _end(proc: subprocess.Popen[str]) -> None:
    """Ends torchrun and its ranks. The ranks run in sessions of their own (torch's elastic agent
    starts them so), so neither a signal to torchrun's process group nor torchrun's SIGKILL
    reaches them: SIGTERM to torchrun first (it stops its ranks), then SIGKILL to whatever of the
    tree, listed before, is left."""
    tree = [proc.pid, *_descendants(proc.pid)]
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (Linux's /proc), children before grandchildren."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        except (OSError, IndexError):
            continue  # gone meanwhile
        parent[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [q for q, pp in parent.items() if pp in frontier]
        found += frontier
    return found


def _text(data: str | bytes | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
