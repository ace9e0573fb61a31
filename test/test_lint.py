"""The repository passes its own linter and formatter (ruff, configured in ruff.toml), so a
commit that breaks either fails `make test`, not only `make lint`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["flashrt_ros", "test", "bench", "tools", "launch", "setup.py"]  # the Makefile's LINT_PATHS


def ruff() -> list[str]:
    exe = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(exe).exists():
        pytest.fail("ruff is not installed: `make setup` installs it (requirements.txt)")
    return [exe]


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_finds_nothing(args):
    paths = [p for p in PATHS if (ROOT / p).exists()]
    r = subprocess.run([*ruff(), *args, *paths], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff {' '.join(args)}:\n{r.stdout}{r.stderr}"
