"""The sim camera: deterministic rgb8 renders that show the goal, and flashrt_sim_arm publishing
them on camera/<name>/image_raw at the configured rate (real DDS, on loopback)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from flashrt_ros.sim.camera import ArmCamera, render
from test.ros_helpers import INSTALL_PREFIX, launch_node

SIM_EXECUTABLE = INSTALL_PREFIX / "lib" / "flashrt_ros" / "flashrt_sim_arm"
GOAL_A = np.array([0.5, -0.8, 1.0, 0.3, -0.4, 0.9])
GOAL_B = np.array([-1.2, 0.6, -0.5, 1.1, 0.2, -0.7])


def _marker_centre(img: np.ndarray) -> np.ndarray:
    """Mean (row, col) of the white goal-marker pixels."""
    white = np.all(img >= 250, axis=-1)
    assert white.any(), "no goal marker in the image"
    return np.argwhere(white).mean(0)


def test_render_is_deterministic_uint8():
    q = np.linspace(-1.0, 1.0, 6)
    a = render(q, GOAL_A)
    b = ArmCamera(64, 64).render(q, GOAL_A)
    assert a.dtype == np.uint8 and a.shape == (64, 64, 3)
    assert np.array_equal(a, b)
    assert ArmCamera(48, 80).render(q, GOAL_A).shape == (48, 80, 3)


def test_goal_marker_moves_with_the_goal():
    cam = ArmCamera()
    q = np.zeros(6)
    without = cam.render(q)
    a, b = cam.render(q, GOAL_A), cam.render(q, GOAL_B)
    assert not np.all(without >= 250, axis=-1).any()  # no goal: no marker
    assert np.linalg.norm(_marker_centre(a) - _marker_centre(b)) > 5.0
    # the marker sits at the ghost chain's tip
    tip = cam.joints_xy(GOAL_A[None])[0, -1]  # (x, y)
    assert np.linalg.norm(_marker_centre(a)[::-1] - tip) < 1.0
    # the arm moving changes the image too, the goal staying put
    assert not np.array_equal(cam.render(q + 0.3, GOAL_A), a)


def test_batch_matches_single_renders():
    rng = np.random.default_rng(0)
    q, g = rng.uniform(-2, 2, (5, 6)), rng.uniform(-2, 2, (5, 6))
    cam = ArmCamera()
    batch = cam.render_batch(q, g)
    for i in range(5):
        assert np.array_equal(batch[i], cam.render(q[i], g[i]))


def test_bad_input_is_refused():
    cam = ArmCamera()
    with pytest.raises(ValueError):
        cam.render(np.zeros(5))
    with pytest.raises(ValueError):
        cam.render(np.full(6, np.nan))


@pytest.mark.exclusive
def test_sim_node_publishes_camera_images(ros):
    """flashrt_sim_arm with camera_names [top] publishes rgb8 camera/top/image_raw at ~rate_hz,
    stamped like its joint states, and draws the goal it receives."""
    from sensor_msgs.msg import Image
    from std_msgs.msg import Float64MultiArray

    proc = launch_node(
        {"camera_names": ["top"], "camera_rate_hz": 20.0, "camera_width": 48},
        name="flashrt_sim_arm",
        namespace="cam_test",
        params_file=None,
        executable=SIM_EXECUTABLE,
        log_dir=ros.log_dir,
    )
    ros.processes.append(proc)
    got: list[tuple[float, Image]] = []
    ros.node.create_subscription(
        Image, "/cam_test/camera/top/image_raw", lambda m: got.append((time.monotonic(), m)), 10
    )
    goal_pub = ros.node.create_publisher(Float64MultiArray, "/cam_test/goal", 10)
    assert ros.spin_until(lambda: len(got) >= 3, timeout=60.0), proc.log_tail()
    # a goal sent before the sim's reader matches is lost (DDS keeps nothing for it)
    assert ros.spin_until(lambda: goal_pub.get_subscription_count() > 0, timeout=20.0)
    got.clear()
    goal_pub.publish(Float64MultiArray(data=GOAL_A.tolist()))
    ros.spin_for(2.0)
    n = len(got)
    rate = (n - 1) / (got[-1][0] - got[0][0])
    assert 5.0 < rate < 40.0, f"{n} images, {rate:.1f} Hz"
    msg = got[-1][1]
    assert (msg.encoding, msg.height, msg.width, msg.step) == ("rgb8", 64, 48, 144)
    img = np.frombuffer(bytes(msg.data), np.uint8).reshape(64, 48, 3)
    assert np.array_equal(img, ArmCamera(64, 48).render(np.zeros(6), GOAL_A))  # arm at rest
    stamps = [m.header.stamp.sec + 1e-9 * m.header.stamp.nanosec for _, m in got]
    assert all(b >= a for a, b in zip(stamps, stamps[1:], strict=False))
    assert abs(stamps[-1] - time.time()) < 5.0  # the sim's (system) time
    assert proc.alive(), proc.log_tail()
