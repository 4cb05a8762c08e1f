"""Every Python snippet in the README is a whole program that runs as written.

Each ```python block starts with the command that runs it (``# name.py: torchrun
--nproc-per-node 2 name.py``); here each is saved under that name in a fresh directory and run
so, at 2 Gloo ranks on this machine's CPU, with the repository importable as it is after
``pip install -e .``. A snippet that asserts (the overlap and MoE ones compare against the plain
program) fails the test when its numbers are wrong.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
HEAD = re.compile(r"# (\w+\.py): torchrun --nproc-per-node (\d+) \1")


def test_every_snippet_says_how_it_runs() -> None:
    assert len(BLOCKS) >= 5
    for block in BLOCKS:
        assert HEAD.match(block), f"a README snippet does not start with its command:\n{block[:200]}"


# compiled.py compiles a forward and backward with Inductor: 40-90 s on two cores, the compile
# tests (tests/test_compile_*.py) cover the same ops in the default run
SLOW = {"compiled.py"}


def _name(block: str) -> str:
    return (HEAD.match(block) or [None, "unnamed"])[1]  # type: ignore[return-value]


@pytest.mark.parametrize("block", [pytest.param(b, marks=pytest.mark.slow) if _name(b) in SLOW else b for b in BLOCKS],
                         ids=[_name(b) for b in BLOCKS])
def test_snippet_runs_as_written(block: str, tmp_path: Path) -> None:
    head = HEAD.match(block)
    assert head, block[:200]
    name, ranks = head.group(1), head.group(2)
    (tmp_path / name).write_text(block)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", ranks,
                           name], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
