"""The algorithm registry: one module per algorithm, one line here to register it.

``REGISTRY`` maps names to algorithm instances. Tests and benchmarks iterate over it (or over
:func:`for_op`), never over lists of their own, so a new algorithm is covered as soon as it is
registered.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ._base import Algorithm, ScheduledAlgorithm, busbw_factor
from ._peer import PeerAlgorithm
from ._schedule import Copy, Layout, Recv, Region, Schedule, Send, Step
from .binomial_tree import BinomialTree
from .bruck import Bruck
from .copy_engine import CopyEngine
from .grid2d import Grid2D
from .halving_doubling import HalvingDoubling
from .hierarchical import Hierarchical
from .native import Native
from .one_shot import OneShot
from .pairwise import Pairwise
from .recursive_doubling import RecursiveDoubling
from .ring import Ring
from .two_shot import TwoShot

__all__ = [
    "Algorithm", "ScheduledAlgorithm", "PeerAlgorithm", "busbw_factor", "REGISTRY", "register", "get", "for_op",
    "peer",
    "Layout", "Schedule", "Step", "Send", "Recv", "Copy", "Region",
]

REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    if algorithm.name in REGISTRY or algorithm.name == "auto":
        raise ValueError(f"algorithm name {algorithm.name!r} is taken")
    REGISTRY[algorithm.name] = algorithm
    return algorithm


def get(name: str) -> Algorithm | None:
    return REGISTRY.get(name)


def peer(name: str) -> PeerAlgorithm:
    """The registered peer-memory algorithm ``name``, whose calls take a ``collectives.peer.PeerMemory``
    (``peer("one_shot").all_reduce(pm, x)``, ``peer("copy_engine").reduce_scatter(pm, out, x)``)."""
    algorithm = REGISTRY.get(name)
    if not isinstance(algorithm, PeerAlgorithm):
        names = sorted(n for n, a in REGISTRY.items() if isinstance(a, PeerAlgorithm))
        raise UnsupportedError("algorithm", name, "is not a peer-memory algorithm", f"use one of {names}")
    return algorithm


def for_op(op: str, dtype: torch.dtype | None = None, backend: str | None = None) -> list[str]:
    """Names of the registered algorithms that run ``op`` (for ``dtype`` on ``backend`` if given)."""
    return [name for name, a in REGISTRY.items() if a.supports(op, dtype, backend)]


register(Native())
register(Ring())
register(RecursiveDoubling())
register(HalvingDoubling())
register(BinomialTree())
register(Pairwise())
register(Bruck())
register(Hierarchical())
register(Grid2D())
register(OneShot())
register(TwoShot())
register(CopyEngine())
