"""``forward_pipelined(chunks="auto")`` over the peer transport: the tuned table's choice of pipeline.

Design note. ``launch/bench_moe.py --tune`` writes, per measured layer, the pipeline (token chunks
or "sources") that measured faster than the sequential forward, paired in the same rounds, or one
chunk; the table is read through ``overlap.set_tuned`` or ``COMMOPS_OVERLAP_TUNED`` like the
overlap operators' (``overlap/ops.py`` keeps it). A choice is keyed by what every rank shares:
the world size, the peer transport's ``max_tokens`` (not this call's token count, which may
differ between ranks), the layer's shape and dtype, and how the pipeline moves its rows, so that
every rank picks the same. A layer the table has not measured runs one chunk, and says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..ops import tuned_table
from .experts import GroupedSwiGLU

__all__ = ["MOE_TUNE_MIN_SPEEDUP", "TunedLayer", "TunedChoices"]

# A pipeline replaces the sequential forward in a tuned table only when it measured at least this
# much faster, paired in the same rounds, so that auto never trades the sequential forward for a
# measured tie. The host's noise is large: unpaired, one layer's sequential forward took 2006 and
# 1765 us in two runs on 2xH200 the same day (gpu_2xh200_moe, gpu_2xh200_moe_pipeline). The
# overlap operators' tables take 3% (bench.gemm_collective.TUNE_MARGIN); 5% here until paired MoE
# runs show how steady the ratio is.
MOE_TUNE_MIN_SPEEDUP = 1.05


@dataclass(frozen=True)
class TunedLayer:
    """What a table's ``moe_forward`` entry is looked up by, of one dispatcher.

    Attributes:
        world: the group's size.
        transport: the transport's registered name.
        max_tokens: the most tokens of one dispatch (the same on every rank).
        hidden, num_experts: the dispatcher's.
        pipeline_transfers: how its pipelines over token chunks move rows ("auto", "sm",
            "copy_engine").
    """

    world: int
    transport: str
    max_tokens: int
    hidden: int
    num_experts: int
    pipeline_transfers: str


def _from_moe_table(table: dict[str, Any], disp: TunedLayer, x: torch.Tensor, k: int, experts: Any
                    ) -> tuple[int | str, str]:
    """The tuned table's choice for this layer, tokens and experts (see ``forward_pipelined``)."""
    if table.get("meta", {}).get("world", disp.world) != disp.world:
        return 1, f"one chunk: the tuned table was measured at {table['meta']['world']} ranks, not {disp.world}"
    if not isinstance(experts, GroupedSwiGLU):
        return 1, f"one chunk: the tuned table measured GroupedSwiGLU experts, not {type(experts).__name__}"
    want = {"op": "moe_forward", "transport": disp.transport, "dtype": str(x.dtype).removeprefix("torch."),
            "device_type": x.device.type, "tokens": disp.max_tokens, "hidden": disp.hidden,
            "ffn_hidden": experts.w1.shape[2], "experts": disp.num_experts, "top_k": k}
    for e in table.get("entries", []):
        if all(e.get(f) == v for f, v in want.items()):
            # a pipeline over token chunks moves its rows as the dispatcher's pipeline_transfers says
            how = "sm" if disp.pipeline_transfers == "auto" else disp.pipeline_transfers
            if e["chunks"] != "sources" and e.get("pipeline", how) != how:
                return 1, (f"one chunk: the tuned table's {e['chunks']} chunks ran over {e['pipeline']}, this "
                           f"dispatcher's pipeline_transfers is {disp.pipeline_transfers!r}")
            chunks = e["chunks"] if e["chunks"] == "sources" else int(e["chunks"])
            return chunks, f"tuned table: {e['note']}"
    return 1, (f"one chunk: the tuned table has no measurement of this layer (max_tokens {disp.max_tokens}, hidden "
               f"{disp.hidden}, ffn {experts.w1.shape[2]}, {disp.num_experts} experts, top-{k}, {want['dtype']})")


class TunedChoices:
    """One dispatcher's choices from the tuned table, each looked up once per shape (and anew
    when ``overlap.set_tuned`` puts another table in place)."""

    def __init__(self) -> None:
        self._table: Any = None
        self._chosen: dict[tuple[Any, ...], tuple[int | str, str]] = {}

    def choose(self, layer: TunedLayer, x: torch.Tensor, k: int, experts: Any) -> tuple[int | str, str]:
        """(chunks or "sources", why) for ``x [tokens, hidden]`` routed to ``k`` experts each."""
        table = tuned_table()
        if table is None:
            return 1, ("one chunk: no tuned table (launch/bench_moe.py --tune writes one; overlap.set_tuned or "
                       "COMMOPS_OVERLAP_TUNED reads it)")
        if table is not self._table:  # another table since (overlap.set_tuned): choose anew
            self._table = table
            self._chosen.clear()
        key = (x.dtype, x.device.type, k, layer.pipeline_transfers,
               tuple(experts.w1.shape) if isinstance(experts, GroupedSwiGLU) else None)
        found = self._chosen.get(key)
        if found is None:
            found = self._chosen[key] = _from_moe_table(table, layer, x, k, experts)
        return found
