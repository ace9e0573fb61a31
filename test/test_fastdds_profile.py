"""config/fastdds_images.xml, the Fast DDS profile that lets camera images above 512 KiB travel
whole through shared memory (the file says why), and how the launch file chooses it.

Two real processes on the test's own domain: one publishes a 640x480 rgb8 image, the other
receives it. Each reports the shared-memory segments Fast DDS mapped into it (/proc/self/maps),
which says whether the profile took effect: 8 MiB with it, Fast DDS's 512 KiB default without.
A node started without the profile warns about camera frames too large for the default segment.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashrt_ros.node.fastdds import PROFILE_FILE, PROFILE_VAR, fastdds_env, large_image_hint
from test.ros_helpers import HAVE_RCLPY, REPO_ROOT, launch_node

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "config" / PROFILE_FILE
SEGMENT = 8 * 1024 * 1024

PEER = r"""
import hashlib, sys, time
import rclpy
from sensor_msgs.msg import Image

def segment_bytes():
    out = 0
    for line in open("/proc/self/maps"):
        if "/dev/shm/fastdds" in line and "_el" not in line and "port" not in line:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            out = max(out, hi - lo)
    return out

role, topic = sys.argv[1], sys.argv[2]
rclpy.init()
node = rclpy.create_node("profile_" + role)
data = bytes(i % 251 for i in range(640 * 480 * 3))
deadline = time.monotonic() + 30
if role == "sub":
    got = []
    node.create_subscription(Image, topic, got.append, 10)
    while not got and time.monotonic() < deadline:
        rclpy.spin_once(node, timeout_sec=0.1)
    m = got[0]
    print("GOT", len(m.data), hashlib.sha256(bytes(m.data)).hexdigest(), m.width, m.height,
          segment_bytes(), flush=True)
else:
    pub = node.create_publisher(Image, topic, 10)
    while pub.get_subscription_count() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    msg = Image(height=480, width=640, encoding="rgb8", step=640 * 3, data=data)
    pub.publish(msg)
    time.sleep(1.0)  # reliable delivery completes before the participant goes
    print("SENT", hashlib.sha256(data).hexdigest(), segment_bytes(), flush=True)
node.destroy_node()
rclpy.shutdown()
"""


def exchange(profile: Path | None, topic: str) -> tuple[list[str], list[str], str]:
    """(subscriber's words, publisher's words, both stderrs) of one image sent across."""
    env = dict(os.environ)
    env.pop(PROFILE_VAR, None)
    if profile is not None:
        env[PROFILE_VAR] = str(profile)
    sub = subprocess.Popen(
        [sys.executable, "-c", PEER, "sub", topic], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    pub = subprocess.run(
        [sys.executable, "-c", PEER, "pub", topic], env=env, text=True, capture_output=True,
        timeout=60,
    )  # fmt: skip
    out, err = sub.communicate(timeout=60)
    words = lambda text, key: next(  # noqa: E731
        (ln.split() for ln in text.splitlines() if ln.startswith(key)), []
    )
    return words(out, "GOT"), words(pub.stdout, "SENT"), err + pub.stderr


@pytest.mark.exclusive
@pytest.mark.skipif(not HAVE_RCLPY, reason="rclpy not importable")
def test_the_profile_loads_and_carries_a_640x480_image_whole_through_its_segment():
    got, sent, err = exchange(PROFILE, "frames")
    assert "XMLPARSER" not in err and "Error" not in err, err[-2000:]
    assert got and sent, err[-2000:]
    assert got[1:5] == [str(640 * 480 * 3), sent[1], "640", "480"]  # every byte arrived
    assert int(sent[2]) >= SEGMENT and int(got[5]) >= SEGMENT  # the profile's segment is in use


@pytest.mark.exclusive
@pytest.mark.skipif(not HAVE_RCLPY, reason="rclpy not importable")
def test_without_it_fast_dds_maps_its_small_default_segment_and_a_broken_file_is_reported(
    tmp_path,
):
    got, sent, _ = exchange(None, "frames_default")
    assert got and sent
    assert 0 < int(sent[2]) < SEGMENT  # what the check above tells apart
    bad = tmp_path / "bad.xml"
    bad.write_text(PROFILE.read_text().replace("</profiles>", ""))
    _, _, err = exchange(bad, "frames_bad")
    assert "XMLPARSER" in err  # so the check of the good file's stderr can fail


LONE = r"""
import os, sys, rclpy
if sys.argv[1] == "late":  # a participant first, and only then the profile named in os.environ
    rclpy.init()
    rclpy.create_node("before_the_profile").destroy_node()
    rclpy.shutdown()
    os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = sys.argv[2]
rclpy.init()
node = rclpy.create_node("after")
sys.path.insert(0, sys.argv[3])
from bench.host_facts import fastdds_segment_bytes  # alone in its domain: its own segment
print("LARGEST", fastdds_segment_bytes(), flush=True)
node.destroy_node()
rclpy.shutdown()
"""


@pytest.mark.skipif(not HAVE_RCLPY, reason="rclpy not importable")
def test_a_profile_named_after_the_first_participant_is_not_used():
    """Fast DDS reads the variable once per process, at its first participant: why the README
    says to export it before the process starts, and why bench/ros_bench.py loads it first
    (its full runs sent every image the slow way after an earlier scenario)."""
    env = {k: v for k, v in os.environ.items() if k != PROFILE_VAR}

    def largest(how: str, extra: dict) -> int:
        r = subprocess.run(
            [sys.executable, "-c", LONE, how, str(PROFILE), str(REPO_ROOT)],
            env={**env, **extra}, text=True,
            capture_output=True, timeout=60,
        )  # fmt: skip
        words = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("LARGEST")]
        assert r.returncode == 0 and words, r.stderr[-2000:]
        return int(words[0][1])

    assert largest("first", {PROFILE_VAR: str(PROFILE)}) >= SEGMENT  # named before: in use
    assert 0 < largest("late", {}) < SEGMENT  # named after a participant: the default segment


def test_the_launch_choice_of_profile(tmp_path):
    default = str(PROFILE)
    assert fastdds_env("auto", {}, default) == {PROFILE_VAR: default}
    assert fastdds_env("auto", {PROFILE_VAR: "/robot/dds.xml"}, default) == {}  # the robot's own
    assert fastdds_env("", {}, default) == {}
    own = tmp_path / "own.xml"
    own.write_text("<dds/>")
    assert fastdds_env(str(own), {PROFILE_VAR: "/x.xml"}, default) == {PROFILE_VAR: str(own)}
    with pytest.raises(FileNotFoundError, match="no such file"):
        fastdds_env(str(tmp_path / "missing.xml"), {}, default)
    yaml = tmp_path / "dds.yaml"  # Fast DDS would print a parse error and run on its defaults
    yaml.write_text("transport: shm\n")
    with pytest.raises(ValueError, match="is not an XML profile"):
        fastdds_env(str(yaml), {}, default)


def test_the_installed_profile_is_the_repository_one():
    from test.ros_helpers import INSTALL_PREFIX

    installed = INSTALL_PREFIX / "share" / "flashrt_ros" / "config" / PROFILE_FILE
    assert installed.is_file(), "config not installed: run `make setup`"
    assert (
        hashlib.sha256(installed.read_bytes()).digest()
        == hashlib.sha256(PROFILE.read_bytes()).digest()
    )


def test_the_hint_names_only_frames_over_the_segment_and_only_without_a_profile():
    sizes = {"top": 640 * 480 * 3, "wrist": 640 * 480, "edge": 512 * 1024}
    hint = large_image_hint(sizes, {}, "rmw_fastrtps_cpp", "/share/x.xml")
    assert hint is not None and "top (921600 B)" in hint
    assert "wrist" not in hint and "edge" not in hint  # 307,200 B and exactly 512 KiB fit
    assert f"{PROFILE_VAR}=/share/x.xml" in hint
    assert large_image_hint(sizes, {PROFILE_VAR: "/robot.xml"}, "rmw_fastrtps_cpp", "x") is None
    assert large_image_hint(sizes, {}, "rmw_cyclonedds_cpp", "x") is None  # not Fast DDS
    assert large_image_hint({"wrist": 640 * 480}, {}, "rmw_fastrtps_cpp", "x") is None


def big_and_small_cameras():
    """A LeRobot-shaped policy with a 640x480 rgb8 camera (921,600 B a frame, over Fast DDS's
    512 KiB segment) and a 640x480 mono8 one (307,200 B, under it)."""
    from types import SimpleNamespace as NS

    import torch

    class TwoCameras(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = NS(
                input_features={
                    "observation.state": NS(type="STATE", shape=(12,)),
                    "observation.images.top": NS(type="VISUAL", shape=(3, 480, 640)),
                    "observation.images.wrist": NS(type="VISUAL", shape=(1, 480, 640)),
                },
                output_features={"action": NS(type="ACTION", shape=(6,))},
                chunk_size=1,
                n_action_steps=1,
                n_obs_steps=1,
                temporal_ensemble_coeff=None,
            )

        def predict_action_chunk(self, batch: dict) -> torch.Tensor:
            pix = (
                batch["observation.images.top"][:, 0, 0, :6]
                + batch["observation.images.wrist"][:, 0, 0, :6]
            )
            return (batch["observation.state"][:, :6] + pix)[:, None]

    return TwoCameras()


@pytest.mark.skipif(not HAVE_RCLPY, reason="rclpy not importable")
def test_the_node_warns_at_configure_about_large_frames_without_a_profile(ros, tmp_path):
    """Started without launch (no profile), the node says which camera's frames are too large
    for the default segment and which file to export; with the profile named it says nothing."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "ROS_DOMAIN_ID": str(ros.domain_id), "PYTHONPATH": path}
    env.pop(PROFILE_VAR, None)
    params = {
        "device": "cpu",
        "policy": "test.test_fastdds_profile:big_and_small_cameras",
        "cameras": ["top", "wrist"],
    }
    procs = [
        launch_node(params, log_dir=tmp_path, name="flashrt_plain", env=env),
        launch_node(
            params,
            log_dir=tmp_path,
            name="flashrt_profiled",
            env={**env, PROFILE_VAR: str(PROFILE)},
        ),
    ]
    try:
        logs = []
        for proc in procs:
            deadline = time.monotonic() + 120
            while "configured " not in proc.log_tail(400) and time.monotonic() < deadline:
                assert proc.alive(), proc.log_tail()
                time.sleep(0.2)
            logs.append(proc.log_tail(400))
    finally:
        for proc in procs:
            proc.stop()
    plain, profiled = logs
    assert "configured " in plain and "configured " in profiled, plain[-2000:]
    assert "top (921600 B)" in plain and f"{PROFILE_VAR}=" in plain, plain[-2000:]
    assert "wrist (" not in plain
    assert "shared-memory segment" not in profiled, profiled[-2000:]
