"""``launch/train.py`` as users run it (torchrun, 2 Gloo ranks, on the CPU even where there are GPUs): a dense model over TP=2 and a MoE
model over EP=2 each train on the synthetic data and their loss falls."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent


# the MoE run (about 25 s) under -m slow: expert parallelism's training parity is in test_models_parallelize.py
@pytest.mark.parametrize("flags", [["--model", "llama", "--tp", "2"],
                                   pytest.param(["--model", "qwen3_moe", "--ep", "2"], marks=pytest.mark.slow)],
                         ids=["llama-tp2", "qwen3_moe-ep2"])
def test_train_runs_and_the_loss_falls(flags: list[str], tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "launch/train.py", *flags, "--steps", "25", "--seq", "64", "--batch", "4",
                          "--log-every", "5", "--json", str(out), "--backend", "gloo"],
                         cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "tokens/s" in res.stdout and "# loss: first 5 steps" in res.stdout, res.stdout[-2000:]
    rec = json.loads(out.read_text())
    losses = rec["losses"]
    assert len(losses) == 25 and rec["world"] == 2 and rec["parallel"]["family"] in ("llama", "qwen3_moe")
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    assert all(r > 0 for r in rec["tokens_per_s"])
