"""The node's bytecode cache (node/bytecode.py): when the environment forbids writing .pyc
files, a second start loads its modules from our cache instead of compiling them again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = (
    "import sys; from flashrt_ros.node.bytecode import enable; "
    "print(repr(enable(package='probe_pkg'))); import probe_pkg; print(probe_pkg.VALUE)"
)


def start(tmp: Path, **env: str) -> list[str]:
    full = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX", "FLASHRT_PYCACHE")
    }
    full.update(env, PYTHONPATH=f"{tmp / 'src'}{os.pathsep}{ROOT}")
    r = subprocess.run(
        [sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


def package(tmp: Path) -> Path:
    src = tmp / "src" / "probe_pkg"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("VALUE = 41 + 1\n")
    return src


def pycs(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.pyc"))


def test_no_bytecode_allowed_then_the_second_start_reuses_our_cache(tmp_path):
    src = package(tmp_path)
    cache = tmp_path / "cache"
    out = start(tmp_path, PYTHONDONTWRITEBYTECODE="1", FLASHRT_PYCACHE=str(cache))
    assert "bytecode cache" in out[0] and out[1] == "42"
    first = [p for p in pycs(cache) if "probe_pkg" in str(p)]
    assert len(first) == 1, pycs(cache)
    assert not (src / "__pycache__").exists()  # nothing written beside the sources
    stamp = first[0].stat().st_mtime_ns
    out = start(tmp_path, PYTHONDONTWRITEBYTECODE="1", FLASHRT_PYCACHE=str(cache))
    assert out[1] == "42"
    assert first[0].stat().st_mtime_ns == stamp  # loaded, not rewritten


def test_a_changed_source_is_recompiled_not_served_stale(tmp_path):
    src = package(tmp_path)
    cache = tmp_path / "cache"
    assert start(tmp_path, PYTHONDONTWRITEBYTECODE="1", FLASHRT_PYCACHE=str(cache))[1] == "42"
    (src / "__init__.py").write_text("VALUE = 'changed, and longer than before'\n")
    out = start(tmp_path, PYTHONDONTWRITEBYTECODE="1", FLASHRT_PYCACHE=str(cache))
    assert out[1] == "changed, and longer than before"


def test_off_switch_and_writable_installs_are_left_alone(tmp_path):
    package(tmp_path)
    cache = tmp_path / "cache"
    out = start(tmp_path, PYTHONDONTWRITEBYTECODE="1", FLASHRT_PYCACHE="0")
    assert out[0] == "''" and not cache.exists()
    # bytecode may be written beside the sources: Python's own cache is used, ours is not made
    out = start(tmp_path, FLASHRT_PYCACHE=str(cache))
    assert out[0] == "''" and not cache.exists()
    assert pycs(tmp_path / "src")


def test_an_unwritable_cache_folder_is_reported_and_nothing_breaks(tmp_path):
    package(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    out = start(tmp_path, PYTHONDONTWRITEBYTECODE="1", FLASHRT_PYCACHE=str(blocker / "sub"))
    assert "no bytecode cache" in out[0] and out[1] == "42"
