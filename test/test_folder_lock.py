"""capsule_dir has one user at a time (capsules/folder_lock.py): a second node given the same
folder fails its configure naming the first, instead of reloading the first arm's capsules
and deleting its files; the lock goes with its process however that ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flashrt_ros.capsules.folder_lock import LOCK_NAME, lock_folder
from flashrt_ros.errors import BadRequest
from test.engine_util import observations
from test.node_client import NodeClient
from test.ros_helpers import launch_node


def test_a_second_lock_is_refused_naming_the_holder_and_taken_once_released(tmp_path):
    d = tmp_path / "new" / "capsules"  # made when missing, as the capsule store makes it
    first = lock_folder(d, "/left/flashrt")
    assert first.held and d.is_dir()
    with pytest.raises(BadRequest, match=rf"in use by /left/flashrt \(pid {os.getpid()}\)"):
        lock_folder(d, "/right/flashrt")
    first.release()
    second = lock_folder(d, "/right/flashrt")
    assert second.held
    assert (d / LOCK_NAME).read_text().startswith("/right/flashrt (pid")
    second.release()


def test_the_lock_of_a_killed_process_is_free_at_once(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from flashrt_ros.capsules.folder_lock import lock_folder; "
            f"lock_folder({str(tmp_path)!r}, 'holder'); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(BadRequest, match=r"in use by holder"):
            lock_folder(tmp_path, "me")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    lock_folder(tmp_path, "me").release()  # no stale lock after kill -9


def test_a_holder_that_could_not_write_its_name_is_not_named_after_an_earlier_one(tmp_path):
    """A node that took another user's lock file read-only cannot write its name into it: the
    text names an earlier holder, whose pid has ended, and the refusal must not blame it."""
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    (tmp_path / LOCK_NAME).write_text(f"/old/flashrt (pid {gone.stdout.strip()})\n")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys, time; "
            f"fd = os.open({str(tmp_path / LOCK_NAME)!r}, os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(BadRequest) as refused:
            lock_folder(tmp_path, "me")
        assert "in use by another process" in str(refused.value)
        assert "/old/flashrt" not in str(refused.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)


def test_a_folder_that_cannot_be_written_is_used_unlocked_and_says_why(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        lock = lock_folder(d, "me")
        assert not lock.held and "cannot write" in lock.why_unlocked
    finally:
        d.chmod(0o755)


def test_not_a_folder_and_a_planted_link_are_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(BadRequest, match="is not a folder"):
        lock_folder(f, "me")
    d = tmp_path / "d"
    d.mkdir()
    (d / LOCK_NAME).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadRequest, match="cannot open the lock file"):
        lock_folder(d, "me")
    assert not (tmp_path / "elsewhere").exists()


def test_two_nodes_on_one_capsule_dir_the_second_fails_and_the_first_keeps_its_capsules(
    ros, tmp_path
):
    capdir = tmp_path / "capsules"
    params = {"trigger": "observation", "device": "cpu", "capsule_dir": str(capdir)}
    left = ros.start_node(params, namespace="left")
    node = NodeClient(ros, left)
    node.run(observations(3, seed=1))
    kept = node.call("checkpoint", name="grasp", persist=True, pin=True)
    assert kept.success, kept.message

    env = {**os.environ, "ROS_DOMAIN_ID": str(ros.domain_id)}
    right = launch_node(params, namespace="right", log_dir=ros.log_dir, env=env)
    try:
        rc = right.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        right.stop()
        pytest.fail("the second node did not stop:\n" + right.log_tail())
    said = right.log_tail()
    assert rc == 2, said
    assert f"capsule_dir {capdir} is in use by /left/flashrt (pid {left.pid})" in said, said
    assert "reloaded capsule" not in said, said  # it never loaded the left arm's capsules
    # the first node and its files are as they were
    assert [c.name for c in node.call("list_capsules").capsules] == ["grasp"]
    assert (capdir / "grasp.fcap").is_file()
    left.stop()

    # once the first node is gone the folder is free: a restart reloads what it kept
    again = ros.start_node(params, namespace="right")
    assert [c.name for c in NodeClient(ros, again).call("list_capsules").capsules] == ["grasp"]
    again.stop()


def test_a_transition_that_raises_gives_the_folder_back(ros, tmp_path):
    """rclpy puts a node whose transition raised in unconfigured (on_error): it must not keep
    capsule_dir's lock (and its engine), or its own next configure, and any other node, found
    the folder in use."""
    capdir = tmp_path / "capsules"
    params = {"trigger": "observation", "device": "cpu", "capsule_dir": str(capdir)}
    faulty = ros.start_node(
        params, namespace="left", executable=Path(__file__).with_name("fault_node.py")
    )
    # the traceback rclpy drops is in the log
    assert ros.spin_until(lambda: "injected" in faulty.log_tail(200), 30), faulty.log_tail()
    other = ros.start_node(params, namespace="right")  # exited 2 while the folder was held
    assert other.alive, other.log_tail()
    assert [c.name for c in NodeClient(ros, other).call("list_capsules").capsules] == []
    said = faulty.log_tail(200)
    assert "on_activate raised" in said and "RuntimeError: injected" in said, said
    assert "engine and capsule_dir released, configure again to serve" in said, said
    other.stop()
    faulty.stop()
