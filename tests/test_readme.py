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
