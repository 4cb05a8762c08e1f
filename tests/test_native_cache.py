"""Where the compiled fast path is loaded from: nothing another local user could plant or change.

Each case plants a shared object whose constructor creates a marker file the moment the dynamic
loader maps it (before Python asks it for anything), at every name the loader could pick: the
current ``_fastpath_<tag>_<sha256><suffix>`` and the older ``_fastpath_<tag><suffix>``. The
loading decision runs for real (``_native.load``, the C compiler, the import); the marker must
never appear, and the module that serves must be the one built from ``_fastpath.c``.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from collectives import _native
from collectives.errors import UnsafePathError

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")


def _stem() -> str:
    """The object's name before its hash, as the module docstring defines it."""
    cc = _native._compiler()
    tag = hashlib.sha256(_native._SOURCE.read_bytes() + sys.version.encode() + " ".join(cc).encode()).hexdigest()[:16]
    return f"_fastpath_{tag}"


def _planted(where: Path, marker: Path) -> Path:
    """A shared object that creates ``marker`` when loaded, named after its own sha256."""
    src = where / "planted.c"
    src.write_text('#include <fcntl.h>\n#include <unistd.h>\n'
                   '__attribute__((constructor)) static void planted(void) {\n'
                   f'    int fd = open("{marker}", O_CREAT | O_WRONLY, 0600);\n'
                   '    if (fd >= 0) close(fd);\n}\n')
    out = where / "planted.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(out)], check=True, capture_output=True)
    return out


def _plant(directory: Path, obj: Path) -> list[Path]:
    """Copies of ``obj`` (mode 0700, ours) at every name a loader could take; their paths."""
    data = obj.read_bytes()
    names = [f"{_stem()}_{hashlib.sha256(data).hexdigest()}{SUFFIX}", f"{_stem()}{SUFFIX}"]
    paths = [directory / n for n in names]
    for p in paths:
        p.write_bytes(data)
        os.chmod(p, 0o700)
    return paths


@pytest.fixture
def fresh(monkeypatch, tmp_path):  # noqa: ANN001, ANN201
    """A process that has not tried the fast path yet, its cache at ``tmp_path/cache``; returns
    (cache, marker, planted object)."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(_native, "_STATE", {"module": None, "why": "", "tried": False})
    monkeypatch.setattr(_native, "_WARNED", set(), raising=False)
    cache = tmp_path / "cache"
    monkeypatch.setattr(_native, "_cache_dir", lambda: cache)
    marker = tmp_path / "planted-code-ran"
    return cache, marker, _planted(tmp_path, marker)


def _loaded_real() -> bool:
    module = _native._STATE["module"]
    return _native.status() == "loaded" and module is not None and hasattr(module, "fast_dispatch")


def test_a_new_cache_is_private_and_a_good_object_is_reused(fresh) -> None:  # noqa: ANN001
    cache, _, _ = fresh
    first = _native.build()
    assert (os.stat(cache).st_mode & 0o777) == 0o700
    assert first.name == f"{_stem()}_{hashlib.sha256(first.read_bytes()).hexdigest()}{SUFFIX}"
    assert (os.stat(first).st_mode & 0o077) == 0  # nobody else may change it
    mtime = os.stat(first).st_mtime_ns
    assert _native.build() == first and os.stat(first).st_mtime_ns == mtime  # reused, not rebuilt
    assert not list(cache.glob("*.so.tmp")) and not list(cache.glob("tmp*"))


@pytest.mark.parametrize("mode", [0o720, 0o702, 0o777], ids=lambda m: f"{m:o}")
def test_a_group_or_world_writable_object_is_refused_and_rebuilt(fresh, mode) -> None:  # noqa: ANN001
    cache, marker, planted = fresh
    cache.mkdir(mode=0o700)
    for p in _plant(cache, planted):
        os.chmod(p, mode)
    with pytest.warns(RuntimeWarning, match=f"has mode {mode:o}"):
        _native.load()
    assert not marker.exists() and _loaded_real()


@as_root
def test_an_object_of_another_user_is_refused_and_rebuilt(fresh) -> None:  # noqa: ANN001
    cache, marker, planted = fresh
    cache.mkdir(mode=0o700)
    for p in _plant(cache, planted):
        os.chown(p, NOBODY, NOBODY)
    with pytest.warns(RuntimeWarning, match=f"belongs to uid {NOBODY}"):
        _native.load()
    assert not marker.exists() and _loaded_real()


def test_a_symlinked_object_is_refused_and_its_target_left_alone(fresh, tmp_path) -> None:  # noqa: ANN001
    cache, marker, planted = fresh
    cache.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    targets = _plant(elsewhere, planted)
    for t in targets:
        (cache / t.name).symlink_to(t)
    before = [t.read_bytes() for t in targets]
    with pytest.warns(RuntimeWarning, match="symbolic link"):
        _native.load()
    assert not marker.exists() and _loaded_real()
    assert [t.read_bytes() for t in targets] == before


def test_an_object_whose_bytes_do_not_match_its_name_is_refused(fresh) -> None:  # noqa: ANN001
    cache, marker, planted = fresh
    good = _native.build()
    good.write_bytes(planted.read_bytes())  # altered after the build; still ours, mode 0700
    older = cache / f"{_stem()}{SUFFIX}"  # and at the older name, which states no hash
    older.write_bytes(planted.read_bytes())
    os.chmod(older, 0o700)
    with pytest.warns(RuntimeWarning, match="sha256"):
        _native.load()
    assert not marker.exists() and _loaded_real()


def test_the_import_itself_refuses_a_bad_object(fresh, tmp_path) -> None:  # noqa: ANN001
    """The gate is at the import too: what build() returned is checked again as it is opened."""
    cache, marker, planted = fresh
    cache.mkdir(mode=0o700)
    named, _ = _plant(cache, planted)
    os.chmod(named, 0o722)
    with pytest.raises(UnsafePathError, match="has mode 722"):
        _native._import(named)
    named.write_bytes(b"\0" + planted.read_bytes())
    os.chmod(named, 0o700)
    with pytest.raises(UnsafePathError, match="sha256"):
        _native._import(named)
    assert not marker.exists()


def _bad_directory(kind: str, cache: Path, tmp_path: Path) -> str:
    if kind == "mode":
        cache.mkdir()
        os.chmod(cache, 0o777)
        return "has mode 777"
    if kind == "owner":
        cache.mkdir(mode=0o700)
        os.chown(cache, NOBODY, NOBODY)
        return f"belongs to uid {NOBODY}"
    real = tmp_path / "real-cache"
    real.mkdir(mode=0o700)
    cache.symlink_to(real)
    return "symbolic link"


@pytest.mark.parametrize("kind", ["mode", pytest.param("owner", marks=as_root), "link"])
def test_a_bad_cache_directory_is_not_used_and_the_build_goes_elsewhere(fresh, tmp_path, kind) -> None:  # noqa: ANN001
    cache, marker, planted = fresh
    why = _bad_directory(kind, cache, tmp_path)
    _plant(cache, planted)
    listed = sorted(os.listdir(cache))
    before = set(Path(tempfile.gettempdir()).glob("commops-native-*"))
    with pytest.warns(RuntimeWarning, match=why) as seen:
        _native.load()
    assert not marker.exists() and _loaded_real()
    message = str(seen[0].message)
    assert str(cache) in message and "instead, for this process only" in message, message
    assert sorted(os.listdir(cache)) == listed  # nothing built or removed there
    assert set(Path(tempfile.gettempdir()).glob("commops-native-*")) == before  # the private build is gone


def test_a_refused_directory_is_warned_about_once(fresh) -> None:  # noqa: ANN001
    cache, _, _ = fresh
    cache.mkdir()
    os.chmod(cache, 0o777)
    with pytest.warns(RuntimeWarning):
        _native._build_and_import()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hasattr(_native._build_and_import(), "fast_dispatch")
