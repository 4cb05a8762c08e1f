"""On a CUDA GPU: NCCL's row of the dtype table (``collectives._types.BACKEND_DTYPES``) is what
NCCL through torch really moves, and what it lacks is refused by name before anything is sent.

World 1 over NCCL in a subprocess (torchrun, one rank): torch maps every dtype to an NCCL type
before launching, so a dtype it cannot map fails there even on one rank. Marker ``gpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.gpu

_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

_PROBE = r"""
import json, torch, torch.distributed as dist
import collectives as C
from collectives._types import BACKEND_DTYPES
C.init()
names = ["float64", "float32", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool",
         "uint16", "uint32", "uint64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2"]
out = {"says_moves_but_fails": [], "refuses_but_moves": [], "refused_untyped": []}
for name in names:
    dt = getattr(torch, name)
    try:
        x = torch.ones(4, device="cuda").to(dt)
        dist.broadcast(x, 0)
        dist.all_gather_into_tensor(torch.empty(4, device="cuda").to(dt), torch.ones(4, device="cuda").to(dt))
        torch.cuda.synchronize()
        works = True
    except Exception:
        works = False
    says = dt in BACKEND_DTYPES["nccl"]
    if says and not works:
        out["says_moves_but_fails"].append(name)
    if works and not says:
        out["refuses_but_moves"].append(name)
    if not says:
        try:
            C.broadcast(torch.ones(4, device="cuda").to(dt), 0)
            out["refused_untyped"].append(name + ": accepted")
        except C.InvalidArgumentError as exc:
            if name not in str(exc):
                out["refused_untyped"].append(name + ": " + str(exc))
        except Exception as exc:
            out["refused_untyped"].append(name + ": " + type(exc).__name__)
print("RESULT " + json.dumps(out))
C.destroy()
"""


def test_nccl_dtype_table_matches_nccl(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **_NO_MULTICAST)
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                          str(probe)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads(line[7:]) == {"says_moves_but_fails": [], "refuses_but_moves": [], "refused_untyped": []}
