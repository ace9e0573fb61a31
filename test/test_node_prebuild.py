"""The autostarting node makes its engine beside its own start (node/prebuild.py), and a
configure whose parameters differ from the ones it was made for builds its own (CPU, real rclpy
and DDS for the node)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flashrt_ros.capsules.folder_lock import lock_folder
from flashrt_ros.errors import BadRequest
from flashrt_ros.node.params import NODE_PARAMS
from flashrt_ros.node.prebuild import Prebuild
from test.node_client import NodeClient
from test.ros_helpers import REPO_ROOT, preserved_environ

TINY = "test.tiny_policy:tiny"


def _cfg(**values):
    return NODE_PARAMS.config({**{p.name: p.default for p in NODE_PARAMS}, **values})


def test_an_autostarting_node_takes_the_engine_made_beside_its_start(ros, tmp_path) -> None:
    with preserved_environ("PYTHONPATH"):  # the tiny policy is importable from the repo
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{old}" if old else str(REPO_ROOT)
        proc = ros.start_node(
            {"device": "cpu", "policy": TINY, "capsule_dir": str(tmp_path / "caps")}
        )
    line = proc.log_match(r"start-up: .*").group(0)
    assert "waited for the engine made beside the imports" in line, line
    assert "engine compile_capture" in line and "policy load" in line, line
    # the engine serves: its capsule_dir is locked for this node, and a checkpoint works
    with pytest.raises(BadRequest, match="in use by /flashrt"):
        lock_folder(tmp_path / "caps", "a second node")
    c = NodeClient(ros, proc)
    assert c.call("checkpoint").success


def test_flashrt_prebuild_0_builds_the_engine_in_configure(ros) -> None:
    """FLASHRT_PREBUILD=0: no engine made ahead (for measuring what it saves)."""
    with preserved_environ("FLASHRT_PREBUILD"):
        os.environ["FLASHRT_PREBUILD"] = "0"
        proc = ros.start_node({"device": "cpu", "policy": "builtin:hybrid"})
    line = proc.log_match(r"start-up: .*").group(0)
    assert "engine compile_capture" in line and "made beside the imports" not in line, line


def test_a_prebuilt_engine_for_other_parameters_is_given_back(tmp_path: Path) -> None:
    """take(cfg) with parameters other than the build's: no engine, and capsule_dir's lock
    released, so configure can take it for the engine it builds itself."""
    caps = tmp_path / "caps"
    cfg = _cfg(device="cpu", policy="builtin:hybrid", capsule_dir=str(caps))
    ahead = Prebuild(cfg, "/flashrt")
    built, waited = ahead.take(
        _cfg(device="cpu", policy="builtin:hybrid", capsule_dir=str(caps), seed=7)
    )
    assert built is None and waited >= 0.0
    assert ahead.error == "was made for other parameters"
    lock_folder(caps, "configure's own").release()  # free again
    ahead = Prebuild(cfg, "/flashrt")
    built, _ = ahead.take(cfg)
    assert built is not None and built.engine.session("main") is not None
    assert ahead.take(cfg)[0] is None  # once
    with pytest.raises(BadRequest, match="in use by /flashrt"):
        lock_folder(caps, "another")
    built.release()
    lock_folder(caps, "another").release()


def test_a_failed_prebuild_holds_nothing(tmp_path: Path) -> None:
    caps = tmp_path / "caps"
    ahead = Prebuild(_cfg(device="cpu", policy="builtin:nope", capsule_dir=str(caps)), "/flashrt")
    built, _ = ahead.take(_cfg(device="cpu", policy="builtin:nope", capsule_dir=str(caps)))
    assert built is None and ahead.error.startswith("failed (") and "nope" in ahead.error
    assert not caps.exists() or lock_folder(caps, "after").held
