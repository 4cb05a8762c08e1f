"""Anchors that are not commops algorithms: torch's symmetric-memory all-reduce kernels.

``torch.ops.symm_mem.one_shot_all_reduce_out`` and ``two_shot_all_reduce_`` (multicast off), run
on a buffer already in symmetric memory, which is their best case: a caller whose tensor lives
elsewhere copies it in first. Each anchor says why it cannot run where it cannot (an older torch,
a CPU group), and the benchmark prints that instead of a column.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["ANCHORS", "unavailable", "build"]

ANCHORS = ("symm_mem_one_shot", "symm_mem_two_shot")
_OP = {"symm_mem_one_shot": "one_shot_all_reduce_out", "symm_mem_two_shot": "two_shot_all_reduce_"}


def unavailable(name: str, op: str, dtype: torch.dtype, device: torch.device) -> str:
    """Why anchor ``name`` cannot measure ``op`` here, or ``""``."""
    if op != "all_reduce":
        return f"{name} is an all-reduce"
    if device.type != "cuda":
        return f"{name} needs CUDA tensors"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"{name} reduces bf16 and fp32 only"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as exc:
        return f"torch {torch.__version__} has no symmetric memory ({exc})"
    if not hasattr(torch.ops.symm_mem, _OP[name]):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.{_OP[name]}"
    return ""


def build(name: str, group: Any, numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(input in symmetric memory, output, the call) for one all-reduce of ``numel`` elements."""
    symm_mem = importlib.import_module("torch.distributed._symmetric_memory")
    g = group if group is not None else dist.group.WORLD
    assert g is not None
    gname = g.group_name
    inp = symm_mem.empty(numel, dtype=dtype, device=device)
    symm_mem.rendezvous(inp, gname)
    if name == "symm_mem_one_shot":
        out = torch.empty(numel, dtype=dtype, device=device)
        return inp, out, lambda: torch.ops.symm_mem.one_shot_all_reduce_out(inp, "sum", gname, out)
    return inp, inp, lambda: torch.ops.symm_mem.two_shot_all_reduce_(inp, "sum", gname)
