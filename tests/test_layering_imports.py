"""Layers point one way: topology <- collectives <- overlap <- bench <- launch.

Read from the source (every import statement, those inside functions included), so that a cycle
cannot hide behind an import deferred into a function. A ``__main__`` module is a program that
nothing imports: it may use any layer. In ``topology/`` an import inside a function is for
deferring a heavy optional dependency and says so (``# deferred: <reason>``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> the packages it must never import
FORBIDDEN = {
    "topology": {"collectives", "overlap", "bench", "launch"},
    "collectives": {"overlap", "bench", "launch"},
    "overlap": {"bench", "launch"},
}


def _modules(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if p.name != "__main__.py")


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module]
    return []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_up(package: str) -> None:
    bad = []
    for path in _modules(package):
        for node in ast.walk(ast.parse(path.read_text())):
            for name in _imported(node):
                if name.split(".")[0] in FORBIDDEN[package]:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {name}")
    assert not bad, "\n".join(bad)


def test_topology_defers_imports_only_with_a_reason() -> None:
    bad = []
    for path in _modules("topology"):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    near = lines[node.lineno - 1] + lines[node.lineno - 2]
                    if "# deferred:" not in near:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "imports inside functions without '# deferred: <reason>': " + ", ".join(bad)


def test_importing_topology_loads_no_collectives() -> None:
    code = ("import sys, topology, topology.cost, topology.calibrate, topology.simulate, topology.groups; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('collectives', 'overlap', 'bench')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
