"""config/fastdds_images.xml, the Fast DDS profile that lets camera images above 512 KiB travel
whole through shared memory (the file says why), and how the launch file chooses it.

Two real processes on the test's own domain: one publishes a 640x480 rgb8 image, the other
receives it. Each reports the shared-memory segments Fast DDS mapped into it (/proc/self/maps),
which says whether the profile took effect: 8 MiB with it, Fast DDS's 512 KiB default without.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashrt_ros.node.fastdds import PROFILE_FILE, PROFILE_VAR, fastdds_env
from test.ros_helpers import HAVE_RCLPY

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


@pytest.mark.skipif(not HAVE_RCLPY, reason="rclpy not importable")
def test_the_profile_loads_and_carries_a_640x480_image_whole_through_its_segment():
    got, sent, err = exchange(PROFILE, "frames")
    assert "XMLPARSER" not in err and "Error" not in err, err[-2000:]
    assert got and sent, err[-2000:]
    assert got[1:5] == [str(640 * 480 * 3), sent[1], "640", "480"]  # every byte arrived
    assert int(sent[2]) >= SEGMENT and int(got[5]) >= SEGMENT  # the profile's segment is in use


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


def test_the_installed_profile_is_the_repository_one():
    from test.ros_helpers import INSTALL_PREFIX

    installed = INSTALL_PREFIX / "share" / "flashrt_ros" / "config" / PROFILE_FILE
    assert installed.is_file(), "config not installed: run `make setup`"
    assert (
        hashlib.sha256(installed.read_bytes()).digest()
        == hashlib.sha256(PROFILE.read_bytes()).digest()
    )
