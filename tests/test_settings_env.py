"""The COMMOPS_ settings (collectives/_env.py): the spellings a switch takes, and what is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from collectives import _env
from collectives.errors import InvalidArgumentError, InvalidSettingError

ROOT = Path(__file__).resolve().parent.parent
ON = ["1", "true", "yes", "on", "enable", "enabled", "TRUE", " Yes ", "On\n", "ENABLED"]
OFF = ["0", "false", "no", "off", "disable", "disabled", "FALSE", " No ", "\tOff", "Disabled"]


@pytest.fixture(autouse=True)
def fresh_reads():  # noqa: ANN201
    """Each case reads the environment anew (reads are cached per process)."""
    _env._read.cache_clear()
    _env.nvtx_enabled.cache_clear()
    yield
    _env._read.cache_clear()
    _env.nvtx_enabled.cache_clear()


@pytest.mark.parametrize("raw", ON)
def test_a_switch_is_on_for_each_spelling_of_on(monkeypatch, raw) -> None:  # noqa: ANN001
    monkeypatch.setenv("COMMOPS_DEBUG", raw)
    assert _env.DEBUG.get() is True


@pytest.mark.parametrize("raw", OFF)
def test_a_switch_is_off_for_each_spelling_of_off(monkeypatch, raw) -> None:  # noqa: ANN001
    monkeypatch.setenv("COMMOPS_RECORDER", raw)
    assert _env.RECORDER.get() is False


@pytest.mark.parametrize("raw", ["maybe", "2", "-1", "nope", "y", "t", "enable d", "offf"])
def test_a_switch_refuses_anything_else_naming_variable_value_and_spellings(monkeypatch, raw) -> None:  # noqa: ANN001
    monkeypatch.setenv("COMMOPS_NATIVE", raw)
    with pytest.raises(InvalidSettingError) as caught:
        _env.NATIVE.get()
    text = str(caught.value)
    assert isinstance(caught.value, InvalidArgumentError) and isinstance(caught.value, ValueError)
    assert caught.value.argument == "COMMOPS_NATIVE" and caught.value.value == raw
    assert text.startswith(f"COMMOPS_NATIVE={raw!r}:"), text
    assert all(word in text for word in _env.TRUE_WORDS + _env.FALSE_WORDS), text
    assert "Fix:" in text


def test_an_empty_value_is_the_default(monkeypatch) -> None:  # noqa: ANN001
    for var, raw in ((_env.RECORDER, ""), (_env.DEBUG, "  "), (_env.PEER_BYTES, ""), (_env.PEER_TIMEOUT_S, " ")):
        monkeypatch.setenv(var.name, raw)
        assert var.get() == var.default and not var.is_set(), var.name
        _env._read.cache_clear()


@pytest.mark.parametrize("var, raw, kind", [(_env.PEER_BYTES, "64MB", "a whole number"),
                                             (_env.PEER_BYTES, "1.5", "a whole number"),
                                             (_env.PEER_TIMEOUT_S, "sixty", "a number"),
                                             (_env.PEER_TIMEOUT_S, "10s", "a number")],
                         ids=["bytes-64MB", "bytes-1.5", "timeout-sixty", "timeout-10s"])
def test_a_number_that_does_not_parse_names_the_variable(monkeypatch, var, raw, kind) -> None:  # noqa: ANN001
    monkeypatch.setenv(var.name, raw)
    with pytest.raises(InvalidSettingError) as caught:
        var.get()
    text = str(caught.value)
    assert caught.value.argument == var.name and text.startswith(f"{var.name}={raw!r}: is not {kind}"), text
    assert repr(var.default) in text  # the fix shows a value that parses


def test_numbers_that_parse(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("COMMOPS_PEER_BYTES", " 1048576 ")
    monkeypatch.setenv("COMMOPS_PEER_TIMEOUT_S", "2.5")
    assert _env.PEER_BYTES.get() == 1 << 20 and _env.PEER_TIMEOUT_S.get() == 2.5


@pytest.mark.parametrize("raw, tool, expected", [("1", "", True), ("Enabled", "", True), ("off", "/x.so", False),
                                                 ("DISABLE", "/x.so", False), ("auto", "", False),
                                                 (" AUTO ", "/x.so", True), ("", "/x.so", True)])
def test_nvtx_takes_a_switch_or_auto(monkeypatch, raw, tool, expected) -> None:  # noqa: ANN001
    monkeypatch.setenv("COMMOPS_NVTX", raw)
    monkeypatch.setenv("NVTX_INJECTION64_PATH", tool)
    assert _env.nvtx_enabled() is expected


def test_nvtx_refuses_anything_else(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("COMMOPS_NVTX", "always")
    with pytest.raises(InvalidSettingError) as caught:
        _env.nvtx_enabled()
    text = str(caught.value)
    assert caught.value.argument == "COMMOPS_NVTX" and "'always'" in text and "auto" in text and "disable" in text


def test_the_recorder_is_off_for_disable_in_a_fresh_process() -> None:
    """``COMMOPS_RECORDER=disable`` once left the recorder on (only 0/false/no/off were off)."""
    code = "from collectives.recorder import RECORDER; print(RECORDER.enabled)"
    env = dict(os.environ, PYTHONPATH=str(ROOT), COMMOPS_RECORDER="disable")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
