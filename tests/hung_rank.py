"""The target of the signal-dump test (``tests/test_faults_recorder.py``), run under torchrun with
2 ranks and ``COMMOPS_TRACE_DIR`` set: rank 0 writes its pid to ``pid0`` there, then enters an
all-reduce (no bound: it waits inside Gloo); rank 1 enters it only once ``go`` appears there."""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import collectives as C  # noqa: E402

trace = Path(os.environ["COMMOPS_TRACE_DIR"])
comm = C.init()
C.all_reduce(torch.ones(4))
if comm.rank == 0:
    (trace / "pid0").write_text(str(os.getpid()))
    C.all_reduce(torch.ones(4))
else:
    deadline = time.monotonic() + 120
    while not (trace / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    C.all_reduce(torch.ones(4))
C.destroy()
