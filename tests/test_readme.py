"""The README's test command is exactly what CI runs, and the documented files exist."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command() -> None:
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    assert len(ci) == 1
    assert ci[0].strip() in (ROOT / "README.md").read_text()


def test_launch_scripts_named_in_the_readme_exist() -> None:
    for name in ("bench_allreduce.py", "bench_collectives.py", "bench_dispatch.py"):
        assert (ROOT / "launch" / name).is_file(), name


def test_the_model_zoo_table_is_the_committed_runs() -> None:
    """The README's zoo table is what ``launch/model_zoo.py --from`` makes of the committed records."""
    import json

    from bench.model_zoo import ZooRecord, format_table

    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- zoo table -->\n", 1)[1].split("<!-- end of zoo table -->", 1)[0].rstrip("\n")
    records, versions = [], set()
    for name in ("model_zoo_cpu_tp_ep.json", "model_zoo_cpu_grid.json"):
        data = json.loads((ROOT / "bench" / "results" / name).read_text())
        versions.add(data["meta"]["transformers"])
        records += [ZooRecord(**r) for r in data["records"]]
    assert table == format_table(records, ", ".join(sorted(versions)))
