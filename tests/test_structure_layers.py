"""The library's shape, read from its source with ``ast``: layers point one way, no import cycle,
no module or class past its size, and imports inside functions only where a heavy optional
dependency is deferred.

The layers, lowest first: ``topology`` <- ``collectives`` <- ``overlap`` <- ``bench`` <- ``launch``.
A module may import its own layer and the layers below it. Inside the three library layers no
two modules import each other, directly or through others: every import that runs counts, at the
top of a module or inside a function; one under ``if TYPE_CHECKING:`` names a type for the checker
and never runs, so it counts for the direction of the layers but not as a cycle (a contract and
its callers may name each other's types). A ``__main__`` module is a program: it may import any
layer, and nothing imports it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("topology", "collectives", "overlap", "bench", "launch")
LIBRARY = LAYERS[:3]
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 300
# What an import inside a function may defer: heavy or optional, and not needed to import us.
DEFERRABLE = {"cupy", "triton", "pynvml", "matplotlib", "transformers", "mpi4py", "hypothesis",
              "torch_npu"}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the library layers."""
    out = {}
    for layer in LIBRARY:
        for path in sorted((ROOT / layer).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> Iterator[str]:
    """The modules an import statement of module ``name`` names: for ``from m import a``, ``m.a``
    where that is a module, else ``m`` (the statement then reads a name defined in ``m``)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        mod = ".".join([*base, node.module] if node.module else base)
    else:
        mod = node.module or ""
    for alias in node.names:
        sub = f"{mod}.{alias.name}"
        yield sub if sub in MODULES else mod


def _resolve(target: str) -> str | None:
    """The library module ``target`` lands in (its longest known prefix), or None if outside."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in MODULES:
            return cand
        if n == 1 and cand in LAYERS:
            return cand
    return None


def _imports(name: str, *, typing: bool = True) -> Iterator[tuple[ast.Import | ast.ImportFrom, str, bool]]:
    """(statement, imported module, inside a function) for every import in module ``name``
    (``typing=False``: leaving out those under ``if TYPE_CHECKING:``, which never run)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    inner: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner.update(id(n) for n in ast.walk(fn) if n is not fn)
    type_only: set[int] = set()
    for block in ast.walk(tree):
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test):
            type_only.update(id(n) for stmt in block.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and (typing or id(node) not in type_only):
            for target in _targets(node, name, path.name == "__init__.py"):
                yield node, target, id(node) in inner


def _layer(module: str) -> str:
    return module.split(".")[0]


def _graph() -> dict[str, set[str]]:
    """Module -> the library modules it imports when it runs (type-only imports left out)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for name in MODULES:
        for _, target, _ in _imports(name, typing=False):
            dst = _resolve(target)
            if dst is not None and dst != name and dst in MODULES:
                edges[name].add(dst)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _is_program(name: str) -> bool:
    return name.split(".")[-1] == "__main__"


def test_no_import_cycle_in_the_library() -> None:
    edges = {m: ({d for d in ds if not _is_program(d)} if not _is_program(m) else set()) for m, ds in _graph().items()}
    cycles = _cycles(edges)
    assert not cycles, "import cycles (each line one cycle's modules):\n" + "\n".join(" ".join(c) for c in cycles)


def test_layers_point_one_way() -> None:
    bad = []
    for name in MODULES:
        if _is_program(name):
            continue
        mine = LAYERS.index(_layer(name))
        for _, target, _ in _imports(name):
            top = target.split(".")[0]
            if top in LAYERS and LAYERS.index(top) > mine:
                bad.append(f"{MODULES[name].relative_to(ROOT)} imports {target} ({top} is above {_layer(name)})")
    assert not bad, "imports against the layering topology <- collectives <- overlap <- bench <- launch:\n" + \
        "\n".join(sorted(set(bad)))


def _heavy(target: str) -> bool:
    """Whether importing ``target`` loads a heavy optional dependency: it is one, or it is one of
    our modules that imports one at its top (e.g. the Triton kernels' module)."""
    if target.split(".")[0] in DEFERRABLE:
        return True
    mod = _resolve(target)
    if mod is None or mod not in MODULES:
        return False
    tree = ast.parse(MODULES[mod].read_text())
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) and any(t.split(".")[0] in DEFERRABLE
               for t in _targets(n, mod, MODULES[mod].name == "__init__.py")) for n in tree.body)


def _deferred() -> Iterator[tuple[str, ast.Import | ast.ImportFrom, str]]:
    """(module, statement, target) of every import inside a function, each statement once."""
    for name in MODULES:
        seen: set[int] = set()
        for node, target, inside in _imports(name):
            if inside and id(node) not in seen:
                seen.add(id(node))
                yield name, node, target


def test_imports_inside_functions_only_defer_heavy_dependencies() -> None:
    bad = [f"{MODULES[name].relative_to(ROOT)}:{node.lineno} imports {target} inside a function"
           for name, node, target in _deferred() if not _heavy(target)]
    assert not bad, "imports inside functions that defer nothing heavy (move them to the top):\n" + "\n".join(bad)


def test_deferred_imports_say_why() -> None:
    missing = []
    for name, node, target in _deferred():
        lines = MODULES[name].read_text().splitlines()
        near = " ".join(lines[max(0, node.lineno - 3): node.lineno])
        if "deferred" not in near:
            missing.append(f"{MODULES[name].relative_to(ROOT)}:{node.lineno} defers {target} without a reason")
    assert not missing, "a deferred import says why ('# deferred: <reason>'):\n" + "\n".join(missing)


def test_importing_a_layer_loads_nothing_above_it() -> None:
    """At run time too: importing each library layer loads no module of the layers above it."""
    code = ("import sys, importlib; layers = {layers!r}\n"
            "for i, layer in enumerate(layers[:3]):\n"
            "    for m in [m for m in sys.modules if m.split('.')[0] in layers]: del sys.modules[m]\n"
            "    importlib.import_module(layer)\n"
            "    if layer == 'topology':\n"
            "        for sub in ('cost', 'calibrate', 'simulate', 'groups', 'discover', 'model'):\n"
            "            importlib.import_module('topology.' + sub)\n"
            "    print(layer, sorted({{m.split('.')[0] for m in sys.modules}} & set(layers[i + 1:])))\n").format(layers=LAYERS)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["topology []", "collectives []", "overlap []"], out.stdout


@pytest.mark.parametrize("layer", LIBRARY + ("bench", "launch"))
def test_no_module_or_class_past_its_size(layer: str) -> None:
    big = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_MODULE_LINES:
            big.append(f"{path.relative_to(ROOT)}: {lines} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    big.append(f"{path.relative_to(ROOT)}: class {node.name} {n} lines (at most {MAX_CLASS_LINES})")
    assert not big, "\n".join(big)


def test_the_walk_sees_what_it_must() -> None:
    """The walk itself: it finds known modules, a known edge and would see a cycle and an upward import."""
    assert {"collectives", "collectives.dispatch", "topology.model", "overlap"} <= set(MODULES)
    assert "collectives.errors" in _graph()["collectives.dispatch"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    node = ast.parse("from ..errors import X").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert list(_targets(node, "collectives.peer.memory", False)) == ["collectives.errors"]
    node = ast.parse("from .. import _env, dispatch").body[0]
    assert isinstance(node, ast.ImportFrom)
    assert list(_targets(node, "collectives.algos.ring", False)) == ["collectives._env", "collectives.dispatch"]
