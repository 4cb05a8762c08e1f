"""Fixtures: pools of ranks (``tests.mp.World``) shared across the session, one per world size."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest

from tests.mp import World

_WORLDS: dict[int, World] = {}


def get_world(size: int) -> World:
    w = _WORLDS.get(size)
    if w is None or w.broken:
        w = _WORLDS[size] = World(size)
    return w


@pytest.fixture(scope="session")
def worlds() -> Iterator[Callable[[int], World]]:
    yield get_world
    for w in _WORLDS.values():
        w.request_close()
    until = time.monotonic() + 5.0  # one deadline for every pool: they exit together
    for w in _WORLDS.values():
        w.close(until)
    _WORLDS.clear()


# world 5 (about a minute of the conformance matrix on two cores) under -m slow; 3 is the default's odd size
@pytest.fixture(params=[1, 2, 3, 4, pytest.param(5, marks=pytest.mark.slow)], ids=lambda n: f"world{n}")
def world(request: pytest.FixtureRequest, worlds: Callable[[int], World]) -> World:
    return worlds(request.param)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (none on this machine); run with -m gpu on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("OMP_NUM_THREADS", "1")
