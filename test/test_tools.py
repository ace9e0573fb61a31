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


def _tool(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
    )


@pytest.mark.parametrize("tool", ["train_hybrid.py", "train_act.py"])
def test_training_refuses_bad_counts_and_an_unwritable_out_before_training(tool, tmp_path):
    """--steps 0 divided by zero minutes in, and an --out under a file failed only at the
    save, the run lost: both are one line and exit 2 before any training."""
    (tmp_path / "afile").write_text("")
    for args, says in (
        (["--steps", "0"], "--steps must be >= 1"),
        (["--batch", "-1"], "--batch must be >= 1"),
        (["--out", str(tmp_path / "afile" / "w.pt")], "cannot make its folder"),
        (["--out", str(tmp_path)], "is a folder"),
    ):
        r = _tool(f"tools/{tool}", *args)
        assert r.returncode == 2 and says in r.stderr, (args, r.stderr[-2000:])


def test_make_fixtures_writes_all_bags_or_none(tmp_path):
    """It wrote the first bags, then refused at one that existed; and a file in the way of
    OUT_DIR was a traceback."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "messy_mcap").mkdir()  # the last of the four
    r = _tool("tools/make_fixtures.py", str(tmp_path / "out"))
    assert r.returncode == 2 and "messy_mcap" in r.stderr, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["messy_mcap"]
    (tmp_path / "afile").write_text("")
    r = _tool("tools/make_fixtures.py", str(tmp_path / "afile"))
    assert r.returncode == 2 and "OUT_DIR" in r.stderr and "Traceback" not in r.stderr, r.stderr
