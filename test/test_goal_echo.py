"""The latched ~/goal_applied (node/goal_echo.py), over real rclpy/DDS: what a late subscriber
reads is the newest change, whatever order the threads publish in; a moved live session's goal
is read from the engine once the replies are sent, and only then."""

from __future__ import annotations

import numpy as np
from rclpy.qos import QoSDurabilityPolicy, QoSProfile
from std_msgs.msg import Float64MultiArray

from flashrt_ros.node.goal_echo import GoalEcho
from flashrt_ros.node.services import Control
from flashrt_ros.node.stats import LoopStats
from flashrt_ros.runtime.engine import Engine
from test.tiny_policy import tiny

LATCHED = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
TOPIC = "goal_echo_test"


def late_read(ros) -> list[float]:
    """The latched message a subscriber that joins now reads."""
    got: list[list[float]] = []
    sub = ros.node.create_subscription(
        Float64MultiArray, TOPIC, lambda m: got.append(list(m.data)), LATCHED
    )
    try:
        assert ros.spin_until(lambda: got, 10), "nothing latched"
        ros.spin_for(0.2)
        return got[-1]
    finally:
        ros.node.destroy_subscription(sub)


def test_an_older_change_published_after_a_newer_one_is_not_published(ros):
    """A goal's echo (published after the engine lock is released) that lost the race to a
    restore's echo must not stay latched: the restore's goal is the one the robot heads for."""
    echo = GoalEcho(ros.node.create_publisher(Float64MultiArray, TOPIC, LATCHED))
    goal_change = echo.changed()  # a goal set, its echo still to come
    restore_change = echo.changed()  # then a restore
    assert echo.say(restore_change, [1.0, 2.0])
    assert not echo.say(goal_change, [9.0, 9.0])
    assert late_read(ros) == [1.0, 2.0]
    assert echo.say(echo.changed(), [3.0, 4.0])  # a newer one is said as usual
    assert late_read(ros) == [3.0, 4.0]


def test_a_moved_live_session_is_echoed_by_the_flush_after_the_replies(ros):
    eng = Engine(tiny(), device="cpu")
    ctl = Control(LoopStats(), ros.node.get_logger(), lambda: None)
    ctl.engine = eng
    echo = GoalEcho(ros.node.create_publisher(Float64MultiArray, TOPIC, LATCHED))
    n = eng.goal_dim
    with ctl.lock:
        eng.set_goal([0.5] * n)
        cp = eng.checkpoint()
        eng.set_goal([-0.25] * n)
        echo.say(echo.changed(), [-0.25] * n)
        eng.restore(cp.id)  # the goal 0.5 is back
        echo.moved()  # what a restore handler tells it, engine lock held
    assert late_read(ros) == [-0.25] * n  # nothing is read or said before the flush
    echo.flush(ctl)
    assert late_read(ros) == [0.5] * n
    eng.set_goal([0.75] * n)
    echo.flush(ctl)  # no move since: nothing read, nothing said
    assert late_read(ros) == [0.5] * n
    with ctl.lock:
        echo.moved()
    ctl.engine = None  # cleaned up before the replies went out: the next configure says it
    echo.flush(ctl)
    assert late_read(ros) == [0.5] * n
    assert np.array_equal(eng.get_goal(), np.full(n, 0.75))
