"""The tools users run by hand refuse to replace what the repository ships unless told."""

from __future__ import annotations

import subprocess
import sys

import pytest

from test.ros_helpers import REPO_ROOT


@pytest.mark.parametrize("tool", ["train_hybrid.py", "train_act.py"])
def test_training_refuses_to_replace_the_shipped_weights_without_force(tool):
    """A trial run (`--steps 5`) replaced the committed weights without a word."""
    r = subprocess.run(
        [sys.executable, f"tools/{tool}", "--steps", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 2 and "exists: pass --force" in r.stderr, r.stderr[-2000:]
