"""``torch.compile`` for the tests: compile with ``fullgraph`` after ``torch._dynamo.explain`` has
shown one graph and no break, and say which ops Dynamo traced into it."""

from __future__ import annotations

from typing import Any

import torch
from torch.library import opcheck


def opcheck_failures(cases: list[tuple[str, tuple[Any, ...]]],
                     test_utils: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """``torch.library.opcheck`` of ``torch.ops.commops.<name>`` on each ``(name, args)``, with
    ``test_utils[name]``'s checks where given (else opcheck's default set): what failed."""
    failed = []
    for name, args in cases:
        chosen = (test_utils or {}).get(name)
        result = opcheck(getattr(torch.ops.commops, name), args) if chosen is None else \
            opcheck(getattr(torch.ops.commops, name), args, test_utils=chosen)
        bad = {k: v for k, v in result.items() if v != "SUCCESS"}
        if bad:
            failed.append(f"{name}: {bad}")
    return failed


def traced_ops(gm: Any) -> set[str]:
    """The functions a Dynamo graph calls, ops by packet name (``commops.all_reduce``)."""
    return {str(n.target).removesuffix(".default") for n in gm.graph.nodes if n.op == "call_function"}


def compile_checked(fn: Any, backend: str, *args: Any, **kwargs: Any) -> tuple[Any, set[str]]:
    """``torch.compile(fn, fullgraph=True, backend=backend)`` and the ops traced from it.

    ``explain`` runs ``fn`` once on ``args`` (tensors cloned, so that an in-place program leaves
    them as they were): a collective program must be called alike on every rank. Dynamo's
    caches are reset before and after, so each case compiles afresh.
    """
    torch._dynamo.reset()
    copies = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    explained = torch._dynamo.explain(fn)(*copies, **kwargs)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1, explained.graph_count
    traced = traced_ops(explained.graphs[0])
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend=backend), traced
