"""`python -m flashrt_ros.demo` end to end (short story), plus its plot on synthetic data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test.ros_helpers import HAVE_RCLPY, RCLPY_IMPORT_ERROR, REPO_ROOT, fresh_domain_id

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _require_rclpy() -> None:
    if HAVE_RCLPY:
        return
    if os.environ.get("FLASHRT_ROOT"):
        pytest.fail(f"env.sh is sourced but {RCLPY_IMPORT_ERROR}")
    pytest.skip(RCLPY_IMPORT_ERROR or "rclpy not importable")


def _env(domain: int) -> dict[str, str]:
    env = dict(os.environ)
    env["ROS_DOMAIN_ID"] = str(domain)
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    env.pop("ROS_LOCALHOST_ONLY", None)
    env.pop("ROS_STATIC_PEERS", None)
    env.pop("FLASHRT_DEMO_DOMAIN_ID", None)
    return env


def test_demo_help():
    r = subprocess.run(
        [sys.executable, "-m", "flashrt_ros.demo", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(fresh_domain_id()),
    )
    assert r.returncode == 0, r.stderr
    for opt in ("--out", "--duration", "--rate", "--domain-id", "--policy"):
        assert opt in r.stdout
    # a bad FLASHRT_DEMO_DOMAIN_ID: --help still helps, a run is refused naming it (exit 2)
    env = dict(_env(fresh_domain_id()), FLASHRT_DEMO_DOMAIN_ID="abc")
    demo = [sys.executable, "-m", "flashrt_ros.demo"]
    r = subprocess.run([*demo, "--help"], cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and "--domain-id" in r.stdout, r.stderr
    r = subprocess.run(demo, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "FLASHRT_DEMO_DOMAIN_ID" in r.stderr, r.stderr
    # an explicit --domain-id wins over it (here the run stops at its too-short duration)
    given = [*demo, "--domain-id=99", "--duration", "1"]
    r = subprocess.run(given, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "--duration" in r.stderr and "FLASHRT_DEMO" not in r.stderr


def test_demo_refuses_what_it_cannot_run_before_starting_anything(tmp_path):
    """An endless story (it crashed after starting the nodes: OverflowError) and an output
    folder that cannot be made (a traceback, exit 1) are one line and exit 2."""
    env = _env(fresh_domain_id())
    demo = [sys.executable, "-m", "flashrt_ros.demo"]
    (tmp_path / "afile").write_text("not a folder")
    for args, says in (
        (["--duration", "inf"], "--duration"),
        (["--duration", "nan"], "--duration"),
        (["--out", str(tmp_path / "afile")], "--out"),
        (["--out", str(tmp_path / "afile" / "sub")], "--out"),
    ):
        r = subprocess.run(
            [*demo, *args], cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=60
        )
        assert r.returncode == 2 and says in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr


@pytest.mark.exclusive
def test_demo_runs_end_to_end(tmp_path):
    _require_rclpy()
    domain = fresh_domain_id()
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "flashrt_ros.demo",
        "--out",
        str(out),
        "--duration",
        "10",
        "--domain-id",
        str(domain),
    ]
    try:
        r = subprocess.run(
            cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=85, env=_env(domain)
        )
    except subprocess.TimeoutExpired as e:  # the demo's children die with it (PDEATHSIG)
        pytest.fail(f"demo did not finish within 85 s; output so far:\n{e.stdout}\n{e.stderr}")
    log = f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 0, log

    png = out / "demo.png"
    assert png.is_file() and png.stat().st_size > 10_000, log
    assert png.read_bytes()[:8] == PNG_MAGIC

    summary = json.loads((out / "summary.json").read_text())
    ops = summary["capsule_ops"]
    kinds = {e["kind"] for e in ops}
    assert {"checkpoint", "branch", "rollout", "restore"} <= kinds, ops
    assert all(e["success"] for e in ops), ops
    assert summary["all_ops_ok"] is True
    assert all(e["rtt_ms"] > 0 for e in ops)
    ckpt = next(e for e in ops if e["kind"] == "checkpoint")
    restore = next(e for e in ops if e["kind"] == "restore")
    assert restore["step"] == ckpt["step"]  # the live session went back to the checkpoint's step
    assert summary["live_session_end"] == "plan_c"
    assert any(c["name"] == "before_goal_b" for c in summary["capsules_end"])
    assert summary["steps"] > 0
    assert len(summary["rollouts"]) == 2 and all(r_["success"] for r_ in summary["rollouts"])
    assert (out / "joint_states.csv").is_file()
    assert (out / "flashrt_node.log").is_file() and (out / "sim_arm.log").is_file()

    text = r.stdout.lower()
    for word in ("checkpoint", "branch", "restore", "rollout", "summary"):
        assert word in text, r.stdout


@pytest.mark.exclusive
def test_demo_act_end_to_end(tmp_path):
    """`--policy builtin:act`: the sim publishes the camera the policy's inputs ask for, the node
    subscribes it, checkpoint / restore / live branch succeed, the what-if rollouts are skipped
    (~/rollout takes vectors only) and the PNG holds the camera's snapshots."""
    _require_rclpy()
    domain = fresh_domain_id()
    out = tmp_path / "demo_act"
    cmd = [sys.executable, "-m", "flashrt_ros.demo", "--policy", "builtin:act", "--out", str(out)]
    cmd += ["--duration", "8", "--domain-id", str(domain)]
    try:
        r = subprocess.run(
            cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=_env(domain)
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"act demo did not finish within 60 s; output so far:\n{e.stdout}\n{e.stderr}")
    log = f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    assert r.returncode == 0, log

    summary = json.loads((out / "summary.json").read_text())
    pol = summary["policy"]
    assert pol["spec"] == "builtin:act" and pol["cameras"] == ["top"], pol
    assert pol["goal_dim"] == 0
    ops = summary["capsule_ops"]
    assert [e["kind"] for e in ops if e["kind"] != "list"] == ["checkpoint", "restore", "branch"]
    assert all(e["success"] for e in ops) and summary["all_ops_ok"] is True, ops
    ckpt, restore, branch = ops[:3]
    assert restore["step"] == ckpt["step"] == branch["step"]  # the checkpoint's state, twice
    assert summary["live_session_end"] == "plan_c"
    assert summary["rollouts"] == [] and "rollout" in summary["skipped"][0]
    # goals reach the policy through the camera: each one was followed by fresh frames
    goals = [e for e in summary["events"] if e["kind"] == "goal"]
    assert [g["goal"] for g in goals] == ["A", "B", "A", "C"], goals
    assert all(g["success"] and g["via"] == "camera" for g in goals), goals
    assert {"queue", "counter"} <= {c["role"] for c in pol["capsule_state"]}
    assert summary["story_steps"] > 0

    cam = summary["camera_frames"]
    assert cam["count"] == 5 and cam["drawn"] == cam["count"], cam
    with np.load(out / cam["file"]) as z:
        frames = z["frames"]
    assert frames.shape == (cam["count"], *pol["image_hw"], 3) and frames.dtype == np.uint8
    assert all(f.std() > 1.0 for f in frames)  # an arm and a goal, not a blank image
    png = out / "demo.png"
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000, log
    assert "camera frames" in r.stdout and "skipped" in r.stdout, r.stdout


def test_demo_fits_state_fields_to_the_policy_and_refuses_a_blind_goalless_one():
    """The node takes positions-only policies (state_fields [position]); the demo refused them
    (it required positions and velocities). A policy with neither a goal nor a camera cannot
    see the story's goals: refused with the reason, before any node starts."""
    from flashrt_ros.demo import DemoError
    from flashrt_ros.demo.policy_info import describe_policy

    assert describe_policy("builtin:hybrid", 6).state_fields == ("position", "velocity")
    info = describe_policy("test.lerobot_like:act_positions", 6)
    assert info.state_fields == ("position",) and info.cameras == ("top",)
    with pytest.raises(DemoError, match="neither a goal nor a camera"):
        describe_policy("test.lerobot_like:make_joints", 6)


@pytest.mark.exclusive
def test_demo_serves_a_positions_only_camera_policy(tmp_path):
    """The story with a positions-only ACT: the node gets state_fields [position] and every
    capsule operation succeeds."""
    _require_rclpy()
    domain = fresh_domain_id()
    out = tmp_path / "demo_pos"
    spec = "test.lerobot_like:act_positions"
    cmd = [sys.executable, "-m", "flashrt_ros.demo", "--policy", spec, "--out", str(out)]
    cmd += ["--duration", "8", "--domain-id", str(domain)]
    env = _env(domain)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy"]["state_fields"] == ["position"], summary["policy"]
    assert summary["all_ops_ok"] is True and summary["story_steps"] > 0, summary["capsule_ops"]


def test_demo_plot_imports_no_ros():
    """The plot re-plots a run on a machine without ROS (e.g. the GPU benchmark machine)."""
    code = (
        "import sys, flashrt_ros.demo.plot; "
        "ros = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('rclpy', 'rcl_interfaces', 'sensor_msgs', 'std_msgs')); "
        "assert not ros, ros"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr


def test_demo_plot_synthetic(tmp_path):
    from flashrt_ros.demo.plot import FRAMES_FILE, load_frames, load_run, plot_demo
    from flashrt_ros.demo.trajectory import Trajectory

    t = np.linspace(0, 12, 600)
    q = 0.5 * np.sin(t[:, None] * 0.5 + np.arange(6))
    goals = {"A": [0.5] * 6, "C": [-0.5] * 6}
    events = [
        {"t": 0.0, "kind": "goal", "label": "goal A"},
        {
            "t": 3.0,
            "kind": "checkpoint",
            "label": "checkpoint x",
            "rtt_ms": 1.0,
            "step": 150,
            "success": True,
        },
        {"t": 3.1, "kind": "rollout", "label": "rollout y", "rtt_ms": 2.0, "success": True},
        {
            "t": 6.0,
            "kind": "restore",
            "label": "restore x",
            "rtt_ms": 1.5,
            "step": 150,
            "success": False,
        },
        {
            "t": 8.0,
            "kind": "branch",
            "label": "branch z",
            "rtt_ms": 1.2,
            "step": 150,
            "success": True,
        },
    ]
    summary = {
        "story_s": 12.0,
        "rate_hz": 50.0,
        "events": events,
        "goal_segments": [
            {"t": 0.0, "goal": goals["A"], "label": "goal A"},
            {"t": 8.0, "goal": goals["C"], "label": "goal C"},
        ],
        "diagnostics_end": {"steps": "600"},
        "final_error_rad": {"norm": 0.1, "max_abs": 0.05},
    }
    trajectory = Trajectory(t=t, q=q, joint_names=[f"j{i}" for i in range(6)])
    png = plot_demo(summary, trajectory, tmp_path / "p.png")
    assert png.read_bytes()[:8] == PNG_MAGIC

    # with camera frames: a row of them; the summary says how many were drawn
    cam_summary = json.loads(json.dumps(summary))
    cam_summary["policy"] = {"spec": "builtin:act", "cameras": ["top"], "image_hw": [32, 48]}
    cam_summary["skipped"] = ["what-if: skipped"]
    snaps = [{"t": 3.0, "label": "checkpoint"}, {"t": 6.1, "label": "x"}, {"t": 6.2, "label": "y"}]
    cam_summary["camera_frames"] = {"camera": "top", "count": 3, "drawn": 0, "snapshots": snaps}
    frames = np.random.default_rng(0).integers(0, 255, (3, 32, 48, 3), dtype=np.uint8)
    png2 = plot_demo(cam_summary, trajectory, tmp_path / "cam.png", frames=frames)
    assert png2.read_bytes()[:8] == PNG_MAGIC and cam_summary["camera_frames"]["drawn"] == 3
    np.savez_compressed(tmp_path / FRAMES_FILE, frames=frames)
    np.testing.assert_array_equal(load_frames(tmp_path), frames)

    # the re-plot path reads back what the demo writes
    trajectory.write_csv(tmp_path / "joint_states.csv")
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    summary2, traj2 = load_run(tmp_path)
    assert summary2 == summary and traj2.joint_names == trajectory.joint_names
    np.testing.assert_allclose(traj2.t, t, atol=1e-6)
    np.testing.assert_allclose(traj2.q, q, atol=1e-6)
