"""Overlap strategies for the GEMM + collective operators: one module per strategy behind one
contract (``base.OverlapStrategy``), registered by name here. ``overlap/ops.py`` looks a
strategy up by the name the caller (or ``auto``, or a tuned table) gives and never tests the
name itself; a new strategy is a module and one ``register_strategy`` line."""

from __future__ import annotations

from .base import OverlapStrategy
from .chunked import Chunked
from .copy_engine import CopyEngine
from .sequential import Sequential
from .tile_signal import TileSignal

__all__ = ["OverlapStrategy", "REGISTRY", "register_strategy", "unregister_strategy"]

REGISTRY: dict[str, OverlapStrategy] = {}


def register_strategy(strategy: OverlapStrategy) -> OverlapStrategy:
    """Make ``strategy`` available to every operator under ``strategy.name``."""
    if strategy.name in REGISTRY or strategy.name == "auto":
        raise ValueError(f"overlap strategy name {strategy.name!r} is taken")
    REGISTRY[strategy.name] = strategy
    return strategy


def unregister_strategy(name: str) -> None:
    """Remove a registered strategy (tests register their own and remove them)."""
    REGISTRY.pop(name, None)


register_strategy(Sequential())
register_strategy(Chunked())
register_strategy(CopyEngine())
register_strategy(TileSignal())
