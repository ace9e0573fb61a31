"""The tools users run by hand refuse to replace what the repository ships unless told."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from test.ros_helpers import REPO_ROOT

TOOLS = REPO_ROOT / "tools"


def tool_main(tool: str) -> Callable[[list[str]], int]:
    """A training tool's `main`, loaded from its file as `python tools/<tool>` runs it (each
    in a child process cost an `import torch`: ~4 s of CPU on a 2-core machine, ten times)."""
    spec = importlib.util.spec_from_file_location(f"tools_{Path(tool).stem}", TOOLS / tool)
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(module)  # it puts the repository and tools/ on sys.path
    finally:
        sys.path[:] = saved
    return module.main


def refusal(main: Callable[[list[str]], int], args: list[str], capsys) -> str:
    """What the tool said on stderr when it exited with 2 (argparse's usage error)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(args)
    err = capsys.readouterr().err
    assert stop.value.code == 2, (args, err[-2000:])
    return err


@pytest.mark.parametrize("tool", ["train_hybrid.py", "train_act.py"])
def test_training_refuses_to_replace_the_shipped_weights_without_force(tool, capsys):
    """A trial run (`--steps 5`) replaced the committed weights without a word."""
    main = tool_main(tool)
    assert "exists: pass --force" in refusal(main, ["--steps", "1"], capsys)


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
def test_training_refuses_bad_counts_and_an_unwritable_out_before_training(tool, tmp_path, capsys):
    """--steps 0 divided by zero minutes in, and an --out under a file failed only at the
    save, the run lost: both are one line and exit 2 before any training."""
    main = tool_main(tool)
    (tmp_path / "afile").write_text("")
    for args, says in (
        (["--steps", "0"], "--steps must be >= 1"),
        (["--batch", "-1"], "--batch must be >= 1"),
        (["--out", str(tmp_path / "afile" / "w.pt")], "cannot make its folder"),
        (["--out", str(tmp_path)], "is a folder"),
    ):
        assert says in refusal(main, args, capsys), args


def test_a_training_tool_runs_as_a_script():
    """`python tools/train_act.py` imports its sibling and the package from any folder."""
    r = subprocess.run(
        [sys.executable, str(TOOLS / "train_act.py"), "--steps", "0"],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", **{k: os.environ[k] for k in ("HOME",) if k in os.environ}},
    )
    assert r.returncode == 2 and "--steps must be >= 1" in r.stderr, r.stderr[-2000:]


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
