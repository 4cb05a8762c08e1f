"""A rank whose process exits mid-job: the others raise ``RankLeft`` naming it, within seconds,
with Gloo's own text beside ours, catchable as torch's ``DistBackendError``/``RuntimeError``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import collectives as C
from tests.mp import RankFailure, World


def body_one_rank_exits(rank: int, size: int, algorithm: str, out_dir: str) -> None:
    x = torch.full((1000,), float(rank + 1), dtype=torch.float64)
    C.all_reduce(x, algorithm=algorithm)  # a good call first: connections are up
    assert x.eq(size * (size + 1) / 2).all()
    if rank == size - 1:
        time.sleep(0.2)
        os._exit(3)  # no goodbye: like a crash
    t0 = time.monotonic()
    report: dict = {"raised": None}
    try:
        with C.call_timeout(60):
            for _ in range(50):  # the first calls may still complete between the living ranks
                C.all_reduce(torch.ones(1000, dtype=torch.float64), algorithm=algorithm)
    except Exception as exc:  # noqa: BLE001 - the finding
        report = {"raised": type(exc).__name__, "gone": getattr(exc, "gone", None), "message": str(exc),
                  "runtime_error": isinstance(exc, RuntimeError),
                  "dist_backend_error": isinstance(exc, torch.distributed.DistBackendError)}
    report["seconds"] = time.monotonic() - t0
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_others_name_the_rank_that_left(tmp_path: Path, algorithm: str) -> None:
    world = World(3)
    try:
        with pytest.raises(RankFailure) as failed:
            world.run(body_one_rank_exits, algorithm, str(tmp_path), timeout=120)
        assert set(failed.value.failures) == {2}, failed.value
    finally:
        world.close()
    for r in (0, 1):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert report["raised"] == "RankLeft", report
        assert report["gone"] == [2], report
        assert report["runtime_error"] and report["dist_backend_error"], report
        assert "Backend:" in report["message"] and "rank(s) [2] left" in report["message"], report
        assert report["seconds"] < 10, report
