"""Expert-parallel mixture of experts: dispatch and combine over a transport, the experts, the layer.

    from overlap.moe import MoEDispatcher, MoELayer, GroupedSwiGLU, reference_moe
    disp = MoEDispatcher(num_experts=64, hidden=4096)                  # transport "nccl"
    disp = MoEDispatcher(64, 4096, transport=PeerOptions(max_tokens=4096, top_k=2))

Design note. One module per part: ``dispatcher.py`` (``MoEDispatcher``: the checks, the shared
flow, autograd), ``transport.py`` (the contract a transport fills, and the registry),
``nccl.py`` and ``peer.py`` (the transports; ``peer_rows.py`` and ``peer_plan.py`` hold the
peer transport's buffers, kernels and host plan), ``routing.py`` and ``exchange.py`` (the
routing and the all-to-all row moves the transports share), ``handles.py``, ``experts.py``
(``GroupedSwiGLU``; its Triton kernels in ``_grouped_gemm.py``), ``layer.py`` (``MoELayer``),
``reference.py`` (the single-process definition every path is checked against) and
``tuned.py`` (``chunks="auto"``'s table). The transports are registered here, one line each:
a new one is a module and a line.
"""

from .dispatcher import MoEDispatcher
from .experts import GroupedSwiGLU
from .handles import DispatchHandle, LowLatencyHandle, TransportState
from .layer import MoELayer, register_block, routed_block
from .nccl import NcclOptions, NcclTransport
from .peer import PeerOptions, PeerTransport
from .reference import reference_moe
from .routing import DEVICE_ROUTING_MIN_PAIRS, sorted_pairs
from .transport import (
    NoOptions,
    Transport,
    TransportArguments,
    TransportOptions,
    TransportSetup,
    register_transport,
    registered_transports,
    unregister_transport,
)
from .tuned import MOE_TUNE_MIN_SPEEDUP

__all__ = [
    "MoEDispatcher", "MoELayer", "register_block", "routed_block", "GroupedSwiGLU", "reference_moe", "DispatchHandle", "LowLatencyHandle",
    "TransportState", "Transport", "TransportSetup", "TransportOptions", "TransportArguments", "NoOptions",
    "NcclOptions", "NcclTransport", "PeerOptions", "PeerTransport", "register_transport", "unregister_transport",
    "registered_transports", "sorted_pairs", "DEVICE_ROUTING_MIN_PAIRS", "MOE_TUNE_MIN_SPEEDUP",
]

register_transport("nccl", NcclTransport, NcclOptions)
register_transport("peer", PeerTransport, PeerOptions)
