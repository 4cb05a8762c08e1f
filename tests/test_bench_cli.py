"""The benchmark's pure parts: sizes, counts, busbw factors (nccl-tests' numbers), reports."""

from __future__ import annotations

import argparse
import csv
import json

import pytest
import torch

from bench.cli import parse_size, sizes
from bench.harness import Record, element_count
from bench.reference import count_wrong
from bench.report import format_table, plot, write_csv, write_json
from collectives.algos import REGISTRY, busbw_factor


def test_sizes_follow_nccl_tests_units() -> None:
    assert [parse_size(s) for s in ("8", "1K", "16M", "1G", "64KB")] == [8, 1024, 16 << 20, 1 << 30, 64 << 10]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("12X")
    assert sizes(1024, 16384, 2) == [1024, 2048, 4096, 8192, 16384]
    assert sizes(8, 100, 4) == [8, 32]


def test_element_counts() -> None:
    assert element_count("all_reduce", 8, torch.bfloat16, 2) == 4
    assert element_count("all_gather", 1000, torch.float32, 3) == 249  # 250 elements, down to a multiple of 3
    assert element_count("reduce_scatter", 2, torch.float32, 4) == 4  # at least one element per rank


@pytest.mark.parametrize("op,world,factor", [("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_gather", 4, 0.75),
                                             ("reduce_scatter", 8, 0.875), ("all_to_all", 2, 0.5), ("broadcast", 5, 1.0),
                                             ("reduce", 3, 1.0)])
def test_busbw_factors_are_nccl_tests(op: str, world: int, factor: float) -> None:
    assert busbw_factor(op, world) == pytest.approx(factor)
    for algo in REGISTRY.values():
        if op in algo.ops:
            assert algo.busbw_factor(op, world) == pytest.approx(factor)


def test_count_wrong_counts_nan_and_far_values() -> None:
    ref = torch.arange(5, dtype=torch.float64)
    out = ref.clone()
    out[1] = float("nan")
    out[3] += 0.5
    assert count_wrong(out, ref, 0.1) == 2
    assert count_wrong(ref, ref, 0.0) == 0


def _records() -> list[Record]:
    rs = []
    for nbytes, t_native, t_ring in ((1024, 100.0, 50.0), (2048, 120.0, 240.0)):
        for algo, t in (("native", t_native), ("ring", t_ring)):
            rs.append(Record("all_reduce", algo, "float32", nbytes, nbytes // 4, 4, "gloo", "cpu", False, t, t * 0.9,
                             t * 1.1, nbytes / t / 1e3, nbytes / t / 1e3 * 1.5, 0))
    return rs


def test_reports(tmp_path) -> None:  # noqa: ANN001
    rs = _records()
    table = format_table(rs)
    lines = [ln.split() for ln in table.splitlines() if ln.strip().startswith(("1024", "2048"))]
    assert [(ln[3], ln[9]) for ln in lines] == [("native", "1.00"), ("ring", "0.50"), ("native", "1.00"), ("ring", "2.00")]
    # the fastest of each size: ring at half native's time at 1024 B, native at 2048 B
    assert [ln[3] for ln in lines if ln[-1] == "fastest"] == ["ring", "native"]
    assert "out-of-bounds values: 0" in table
    write_json(rs, str(tmp_path / "r.json"), {"command": "x"})
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["command"] == "x" and len(data["records"]) == 4 and data["records"][1]["algorithm"] == "ring"
    write_csv(rs, str(tmp_path / "r.csv"))
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == 4 and rows[3]["time_us"] == "240.0"
    plot(rs, str(tmp_path / "r.png"), "t")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_symm_mem_anchors_say_why_they_cannot_run_here() -> None:
    from bench import anchors

    assert "all-reduce" in anchors.unavailable("symm_mem_two_shot", "all_gather", torch.float32, torch.device("cpu"))
    assert "CUDA" in anchors.unavailable("symm_mem_one_shot", "all_reduce", torch.float32, torch.device("cpu"))
    assert "bf16 and fp32" in anchors.unavailable("symm_mem_one_shot", "all_reduce", torch.float64, torch.device("cuda"))


def test_plot_vs_native_draws_one_panel_per_op_and_mode(tmp_path) -> None:  # noqa: ANN001
    from bench.report import plot_vs_native

    recs = [Record("all_reduce", a, "float32", b, b // 4, 2, "nccl", "cuda:0", g, t, t, t, 1.0, 1.0, 0)
            for a, t in (("native", 10.0), ("one_shot", 5.0)) for b in (8, 1024) for g in (False, True)]
    path = tmp_path / "r.png"
    plot_vs_native(recs, str(path), "t")
    assert path.stat().st_size > 1000


def test_peer_epilogue_report_and_plot(tmp_path) -> None:  # noqa: ANN001
    # the probe's records as the GPU run writes them: one line each with both shares, and a plot
    from bench.peer_epilogue import EpilogueRecord, format_epilogue, plot_epilogue

    recs = [EpilogueRecord(512, 2048, 8192, "bfloat16", 2, 512 * 8192 * 2, 27.6, 25.4, 49.3, 34.2,
                           (27.6 + 25.4 - 49.3) / 25.4, (27.6 + 25.4 - 34.2) / 25.4, 0),
            EpilogueRecord(8192, 4096, 8192, "bfloat16", 2, 8192 * 8192 * 2, 818.6, 346.7, 876.4, 804.3,
                           (818.6 + 346.7 - 876.4) / 346.7, (818.6 + 346.7 - 804.3) / 346.7, 3)]
    line = format_epilogue(recs[0])
    assert "512x2048x8192" in line and "hides  14.6% of the push" in line and "hides  74.0%" in line
    assert line.endswith("#wrong 0") and format_epilogue(recs[1]).endswith("#wrong 3")
    plot_epilogue(recs, str(tmp_path / "e.png"), "t")
    assert (tmp_path / "e.png").stat().st_size > 1000


def test_paired_ratio_pairs_rounds() -> None:
    # a drift that slows both variants in round 2 cancels in the pairs, not in the medians
    from bench.harness import paired_ratio

    rounds = {"auto": [10.0, 30.0, 10.5], "sequential": [10.0, 29.0, 10.0], "gemm": [1.0, 1.0]}
    assert paired_ratio(rounds, "auto", "sequential") == pytest.approx(30.0 / 29.0)
    assert paired_ratio(rounds, "sequential", "sequential") == 1.0
    with pytest.raises(ValueError):  # rounds that do not line up are an error, not a silent truncation
        paired_ratio(rounds, "gemm", "sequential")


def body_side_by_side(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    import bench.harness as H
    import collectives as C

    comm = C.get_communicator()
    timed: list[str] = []
    loops = H._time_loops

    def logged(case, iters, reps, graph):  # noqa: ANN001, ANN202
        timed.append(case.algorithm)
        return loops(case, iters, reps, graph)

    H._time_loops = logged
    try:
        recs = H.measure_side_by_side(comm, "all_reduce", ["ring", "native", "auto"], 4 * 333, torch.float32,
                                      torch.device("cpu"), iters=2, warmup=1, reps=4)
    finally:
        H._time_loops = loops
    return {"rounds": [timed[i:i + 3] for i in range(0, len(timed), 3)],
            "records": [(r.algorithm, r.count, r.wrong, r.chosen is not None, r.time_us_min <= r.time_us <= r.time_us_max)
                        for r in recs]}


def test_algorithms_of_one_size_are_timed_side_by_side_in_rounds(worlds) -> None:  # noqa: ANN001
    for out in worlds(3).run(body_side_by_side):
        assert [sorted(r) for r in out["rounds"]] == [["auto", "native", "ring"]] * 4  # one loop of each per round
        assert len({tuple(r) for r in out["rounds"]}) > 1  # not always in the same order
        assert out["records"] == [("ring", 333, 0, False, True), ("native", 333, 0, False, True),
                                  ("auto", 333, 0, True, True)]


def test_bind_to_core_spreads_local_ranks_and_spares_cpu_0(monkeypatch) -> None:  # noqa: ANN001
    import bench.harness as H

    bound: list[set[int]] = []
    monkeypatch.setattr(H.os, "sched_setaffinity", lambda pid, cpus: bound.append(set(cpus)))
    cpus = range(32)
    assert [H.bind_to_core(r, 2, cpus) for r in range(2)] == [1, 16] and bound == [{1}, {16}]
    assert [H.bind_to_core(r, 4, range(4, 12)) for r in range(4)] == [4, 6, 8, 10]  # no CPU 0 to spare
    assert [H.bind_to_core(r, 2, [0, 1]) for r in range(2)] == [0, 1]  # CPU 0 too: no core to spare
    n = len(bound)
    assert H.bind_to_core(0, 4, [0, 1]) is None and len(bound) == n  # fewer cores than ranks: nothing bound


def body_sweep_batches(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    import bench.harness as H
    import collectives as C

    comm = C.get_communicator()
    timed: list[tuple[int, str]] = []
    loops = H._time_loops

    def logged(case, iters, reps, graph):  # noqa: ANN001, ANN202
        timed.append((case.total, case.algorithm))
        return loops(case, iters, reps, graph)

    H._time_loops = logged
    try:
        recs = H.sweep(comm, "all_reduce", ["ring", "native"], [8, 64, 4096], torch.float32, torch.device("cpu"),
                       iters=2, warmup=1, reps=3, together_bytes=64)
    finally:
        H._time_loops = loops
    return {"timed": timed, "records": [(r.bytes, r.algorithm, r.wrong) for r in recs]}


def test_sweep_times_small_sizes_in_the_same_rounds(worlds) -> None:  # noqa: ANN001
    for out in worlds(2).run(body_sweep_batches):
        assert out["records"] == [(8, "ring", 0), (8, "native", 0), (64, "ring", 0), (64, "native", 0),
                                  (4096, "ring", 0), (4096, "native", 0)]
        small, large = out["timed"][:12], out["timed"][12:]
        rounds = [small[i:i + 4] for i in range(0, 12, 4)]  # 8 and 64 bytes: one loop of each job per round
        assert all(sorted(r) == [(2, "native"), (2, "ring"), (16, "native"), (16, "ring")] for r in rounds)
        assert sorted(large) == [(1024, "native")] * 3 + [(1024, "ring")] * 3


def body_prepare_refused(rank: int, world: int) -> dict:  # type: ignore[type-arg]
    import bench.harness as H
    import collectives as C
    from topology import Topology

    comm = C.get_communicator()
    comm.set_topology(Topology.from_nodes([[0, 1], [2]]))  # two nodes of unequal size: no grid
    said: list[str] = []
    try:
        cpu = torch.device("cpu")
        ar = H.prepare("all_reduce", ["all"], comm, torch.float32, cpu, say=said.append)
        a2a = H.prepare("all_to_all", ["all"], comm, torch.float32, cpu, say=said.append)
        raised = []
        for op, name in (("all_reduce", "grid2d"), ("all_to_all", "hierarchical")):
            try:
                H.prepare(op, [name], comm, torch.float32, cpu)
            except C.UnsupportedError as exc:
                raised.append(str(exc))
    finally:
        comm.set_topology(None)
    return {"all_reduce": ar, "all_to_all": a2a, "said": said, "raised": raised}


def test_prepare_leaves_out_what_this_group_refuses_and_says_why(worlds) -> None:  # noqa: ANN001
    from collectives.algos import for_op

    for out in worlds(3).run(body_prepare_refused):
        assert "grid2d" not in out["all_reduce"] and "hierarchical" in out["all_reduce"]
        assert set(out["all_reduce"]) == (set(for_op("all_reduce", torch.float32, "gloo")) - {"grid2d"}) | {"auto"}
        assert "hierarchical" not in out["all_to_all"] and "pairwise" in out["all_to_all"]
        assert [s.split(":")[0] for s in out["said"]] == ["# grid2d not measured for all_reduce",
                                                          "# hierarchical not measured for all_to_all"], out["said"]
        assert all("[2, 1] ranks" in s for s in out["said"]), out["said"]
        assert len(out["raised"]) == 2 and "'grid2d'" in out["raised"][0] and "hierarchical" in out["raised"][1]
        assert all("equal size" in s and "Fix:" in s for s in out["raised"]), out["raised"]


# The main job's record of a run (bench/cli.py): run in a pool of ranks, cwd a fresh folder that
# every rank shares, so that a folder made by any rank but 0 would show as a second one.
_TINY = ["-b", "1K", "-e", "2K", "-n", "2", "-w", "1", "-r", "2", "-a", "native,ring"]


def body_main(rank: int, world: int, cwd: str, argv: list[str], hide_matplotlib: bool) -> dict:  # type: ignore[type-arg]
    import contextlib
    import io
    import os
    import sys

    import bench.cli as cli
    import collectives

    titles: list[str] = []
    real_plot, real_destroy = cli.plot, collectives.destroy

    def plot(records, path, title=""):  # noqa: ANN001, ANN202
        titles.append(title)
        return real_plot(records, path, title)

    hidden = {k: v for k, v in sys.modules.items() if k == "matplotlib" or k.startswith("matplotlib.")}
    here = os.getcwd()
    out = io.StringIO()
    cli.plot = plot
    collectives.destroy = lambda group=None: None  # main ends by destroying the group: this pool's
    if hide_matplotlib:
        sys.modules.update(dict.fromkeys(hidden or ["matplotlib"]))  # a None entry: "import matplotlib" fails
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out):
            rc = cli.main(argv, op="all_reduce")
    finally:
        os.chdir(here)
        cli.plot, collectives.destroy = real_plot, real_destroy
        if hide_matplotlib:
            for k in hidden or ["matplotlib"]:
                sys.modules.pop(k, None)
            sys.modules.update(hidden)
    return {"rc": rc, "stdout": out.getvalue(), "titles": titles}


def _files(root) -> list[str]:  # noqa: ANN001
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_main_job_records_its_run_in_a_new_folder_by_default(worlds, tmp_path) -> None:  # noqa: ANN001
    import re

    outs = worlds(2).run(body_main, str(tmp_path), _TINY, False)
    files = _files(tmp_path)
    assert len(files) == 4, files  # commops-results/, its one folder (rank 0's only), and two files in it
    folder = files[1]
    assert re.fullmatch(r"commops-results/all_reduce-\d{8}-\d{6}", folder), files
    assert files[2:] == [f"{folder}/plot.png", f"{folder}/results.json"]
    data = json.loads((tmp_path / folder / "results.json").read_text())
    assert [(r["bytes"], r["algorithm"]) for r in data["records"]] == [(1024, "native"), (1024, "ring"),
                                                                        (2048, "native"), (2048, "ring")]
    assert all(r["wrong"] == 0 and r["time_us_min"] <= r["time_us"] <= r["time_us_max"] for r in data["records"])
    # each round's time, and the ratio to native paired by round (native's own: exactly 1)
    for r in data["records"]:
        rounds = r["time_us_rounds"]
        assert min(rounds) == r["time_us_min"] and max(rounds) == r["time_us_max"], r
    by = {(r["bytes"], r["algorithm"]): r for r in data["records"]}
    for size in (1024, 2048):
        ring, native = by[size, "ring"], by[size, "native"]
        paired = [t / b for t, b in zip(ring["time_us_rounds"], native["time_us_rounds"], strict=True)]
        assert len(paired) == 2 and native["vs_native"] == 1.0, (ring, native)  # -r 2: two rounds
        assert abs(ring["vs_native"] - (paired[0] + paired[1]) / 2) < 1e-12, (ring, native)
    assert data["meta"]["world"] == 2 and data["meta"]["op"] == "all_reduce" and data["meta"]["backend"] == "gloo"
    assert (tmp_path / folder / "plot.png").read_bytes()[:4] == b"\x89PNG"
    lead, other = outs
    assert lead["rc"] == 0 and other["rc"] == 0
    assert f"# wrote {folder}/results.json, {folder}/plot.png" in lead["stdout"]
    assert lead["stdout"].rstrip().endswith(f"# record of this run: {folder}/")
    assert "# wrote" not in other["stdout"] and other["titles"] == []
    # the title names what moved the tensors (the records' backend), never a backend that did not run
    assert lead["titles"] == ["all_reduce, 2 ranks, gloo (cpu), float32"]


def test_main_job_with_out_none_writes_nothing(worlds, tmp_path) -> None:  # noqa: ANN001
    outs = worlds(2).run(body_main, str(tmp_path), [*_TINY, "--out", "none"], False)
    assert _files(tmp_path) == []
    assert all(o["rc"] == 0 and "# wrote" not in o["stdout"] and "record of this run" not in o["stdout"] for o in outs)
    assert "out-of-bounds values: 0  (OK)" in outs[0]["stdout"]


def test_main_job_without_matplotlib_keeps_the_json_and_says_how_to_plot(worlds, tmp_path) -> None:  # noqa: ANN001
    # --out DIR is made where it is missing; --json still writes its own file too
    argv = [*_TINY, "--out", str(tmp_path / "run" / "a"), "--json", str(tmp_path / "extra.json")]
    lead, other = worlds(2).run(body_main, str(tmp_path), argv, True)
    assert _files(tmp_path) == ["extra.json", "run", "run/a", "run/a/results.json"]
    assert len(json.loads((tmp_path / "run" / "a" / "results.json").read_text())["records"]) == 4
    notes = [ln for ln in lead["stdout"].splitlines() if "plot.png skipped" in ln]
    assert len(notes) == 1 and "pip install matplotlib" in notes[0] and "[plot]" in notes[0], lead["stdout"]
    assert "plot.png skipped" not in other["stdout"]


def test_record_folder_is_new_unless_named(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    import datetime

    from bench.cli import record_folder

    monkeypatch.chdir(tmp_path)
    now = datetime.datetime(2026, 12, 2, 13, 5, 9)
    first, second = record_folder(None, "all_reduce", now), record_folder(None, "all_reduce", now)
    assert (first, second) == ("commops-results/all_reduce-20261202-130509", "commops-results/all_reduce-20261202-130509-2")
    assert record_folder("none", "all_reduce", now) is None and record_folder("None", "x", now) is None
    assert record_folder("mine", "all_reduce", now) == "mine" and record_folder("mine", "all_reduce", now) == "mine"
    assert sorted(_files(tmp_path)) == ["commops-results", first, second, "mine"]
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="--out file/sub: cannot make this folder.*--out none"):
        record_folder("file/sub", "all_reduce", now)


def test_plot_styles_and_size_labels_read_at_a_glance() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import _size_axis, _size_text, _styles

    assert [_size_text(n) for n in (8, 512, 1024, 3 << 10, 1 << 20, 64 << 20, 1 << 30)] == \
        ["8", "512", "1K", "3K", "1M", "64M", "1G"]
    names = ["native"] + [f"a{i}" for i in range(14)]
    recs = [Record("all_reduce", a, "float32", 8, 2, 2, "gloo", "cpu", False, 1.0, 1.0, 1.0, 1.0, 1.0, 0) for a in names]
    styles = _styles(recs)
    assert len({(s["color"], s["marker"], s["ls"]) for s in styles.values()}) == len(names)  # 15 lines, 15 looks
    assert len({s["marker"] for s in styles.values()}) > 1 and len({s["ls"] for s in styles.values()}) > 1
    fig, ax = plt.subplots()
    _size_axis(ax, [8, 1 << 30])
    fmt = ax.xaxis.get_major_formatter()
    assert [fmt(t) for t in ax.get_xticks()] == ["32", "1K", "32K", "1M", "32M", "1G"]
    plt.close(fig)


def test_paired_hidden_share_takes_each_rounds_own_smaller_term() -> None:
    from bench.harness import paired_hidden_share

    # round 0: seq 10, variant 7, terms 4 and 2+1=3 -> 3/3 = 100%; round 1: seq 12, variant 10,
    # terms 8 and 5+3=8 -> 2/8 = 25%; round 2: seq 9, variant 9 -> 0%. Median: 25%.
    rounds = {"seq": [10.0, 12.0, 9.0], "v": [7.0, 10.0, 9.0], "a": [4.0, 8.0, 3.0],
              "b1": [2.0, 5.0, 1.0], "b2": [1.0, 3.0, 1.0]}
    assert paired_hidden_share(rounds, "seq", "v", (("a",), ("b1", "b2"))) == 25.0
    # a term that took no time gives 0 for that round, not a division by zero
    rounds["a"][1] = 0.0
    assert paired_hidden_share(rounds, "seq", "v", (("a",), ("b1", "b2"))) == 0.0
