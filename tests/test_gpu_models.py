"""On CUDA GPUs (world 1 on one GPU): ``launch/train.py`` trains the default model for 50 steps over
NCCL with a falling loss, dense and MoE. Marker ``gpu``; the same runs on Gloo in
``tests/test_launch_train.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests._checks import NO_MULTICAST

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_train_50_steps_on_nccl(model: str, tmp_path: Path) -> None:
    n = torch.cuda.device_count()
    out = tmp_path / "train.json"
    flags = ["--ep", str(n)] if model == "qwen3_moe" else ["--tp", str(n)]
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                          "launch/train.py", "--model", model, *flags, "--steps", "50", "--json", str(out)],
                         cwd=ROOT, env={**os.environ, **NO_MULTICAST}, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["backend"].endswith("nccl") or "nccl" in rec["backend"], rec["backend"]
    losses = rec["losses"]
    assert len(losses) == 50 and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
