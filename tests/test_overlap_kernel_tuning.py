"""The kernels' launch configurations (``overlap/_kernel_tuning.py``): a kernel table's entry for
the shape class first, the cost model elsewhere, and the table agreed across ranks."""

from __future__ import annotations

import json

import pytest
import torch

from overlap import _kernel_tuning as T

CPU = torch.device("cpu")


def _entry(rows_class: int, config: list[int], device: str = "cpu", N: int = 2048, K: int = 7168) -> dict:
    return {"kernel": "fp8_swiglu", "device": device, "dtype": "e4m3", "N": N, "K": K, "experts": 8,
            "rows_class": rows_class, "config": config, "us": 10.0, "default_us": 12.0}


@pytest.fixture(autouse=True)
def _no_table():  # noqa: ANN202
    T.set_kernel_table(None)
    yield
    T.set_kernel_table(None)


def test_the_entry_nearest_in_rows_class_is_taken_for_its_device_and_shape() -> None:
    T.set_kernel_table({"entries": [_entry(4, [64, 4, 3]), _entry(11, [128, 8, 4]), _entry(4, [64, 8, 4], "other")]})
    # 8 experts x 2**5 rows: class 5, nearest 4
    assert T.pick("fp8_swiglu", 8 * 32, 8, 2048, 7168, "e4m3", CPU, (128, 8, 3)) == (64, 4, 3)
    assert "kernel table" in T.last_pick("fp8_swiglu")[1]
    assert T.pick("fp8_swiglu", 8 * 3000, 8, 2048, 7168, "e4m3", CPU, (128, 8, 3)) == (128, 8, 4)
    # another N: no entry of this shape, so the cost model
    got = T.pick("fp8_swiglu", 8 * 3000, 8, 1024, 7168, "e4m3", CPU, (128, 8, 3))
    assert "cost model" in T.last_pick("fp8_swiglu")[1] and got == (128, 8, 3)


def test_the_cost_model_takes_the_small_tile_for_few_rows_per_expert() -> None:
    # 16 rows per expert: a 128-row tile is 7/8 padding, a 64-row tile 3/4; as many tiles -> 64
    cfg, why = T.model_pick("fp8_swiglu", 16 * 32, 32, 2048, 132, (128, 8, 3))
    assert cfg[0] == 64 and "BM=64" in why
    # 3000 rows per expert: 64-row tiles fill the waves a little better, but each costs its fixed part
    assert T.model_pick("fp8_swiglu", 3000 * 8, 8, 1024, 132, (128, 8, 3))[0] == (128, 8, 3)
    # thousands of rows per expert: the same work either way, so the default's tile
    cfg, _ = T.model_pick("fp8_swiglu", 4096 * 32, 32, 2048, 132, (128, 8, 3))
    assert cfg == (128, 8, 3)
    assert T.rows_class(0, 4) == 0 and T.rows_class(4 * 1000, 4) == 10


def test_the_table_comes_from_the_variable_and_the_ranks_compare_it(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps({"entries": [_entry(0, [64, 4, 4])]}))
    monkeypatch.setenv("COMMOPS_KERNELS_TUNED", str(path))
    assert T.pick("fp8_swiglu", 1, 8, 2048, 7168, "e4m3", CPU, (128, 8, 3)) == (64, 4, 4)
    from collectives import _env

    assert _env.KERNELS_TUNED in _env.VARIABLES  # (the ranks' agreement: tests/test_collectives_settings.py)


def test_kernels_with_a_measured_default_keep_it_without_an_entry() -> None:
    # the bf16 grouped GEMMs' defaults were measured by hand: no cost model's guess replaces them
    assert T.pick("gmm", 16 * 32, 32, 2048, 7168, "bfloat16", CPU, (128, 256, 8, 3)) == (128, 256, 8, 3)
    assert "measured by hand" in T.last_pick("gmm")[1]
    T.set_kernel_table({"entries": [{**_entry(4, [64, 128, 4, 4]), "kernel": "gmm", "dtype": "bfloat16"}]})
    assert T.pick("gmm", 16 * 8, 8, 2048, 7168, "bfloat16", CPU, (128, 256, 8, 3)) == (64, 128, 4, 4)
