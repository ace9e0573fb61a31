"""The node's inputs off rclpy's executor (node/inputs.py) and /diagnostics from the control
thread's slack (node/diagnostics.py), over real rclpy and DDS (loopback), on the CPU.

No timings are asserted beyond counts that a loaded machine still meets.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState

from test.engine_util import make_engine, observations
from test.node_client import NodeClient, late_goal_echo

OBS = observations(200, seed=11)


def _transition(ros, proc, tid: int) -> bool:
    change = ros.client(ChangeState, proc.service("change_state"))
    return ros.call(change, ChangeState.Request(transition=Transition(id=tid)), 60).success


def _burst(c: NodeClient, rows: np.ndarray) -> np.ndarray:
    """Publish every row at once (no waiting between them); the commands that answer them."""
    n = len(c.commands)
    for o in rows:
        c.publish(o)
    assert c.ros.spin_until(lambda: len(c.commands) >= n + len(rows), 20), (
        f"{len(c.commands) - n} commands for {len(rows)} observations\n{c.proc.log_tail()}"
    )
    c.ros.spin_for(0.3)  # and no more than one each
    assert len(c.commands) == n + len(rows)
    return np.array(c.commands[n:])


@pytest.mark.exclusive
def test_a_burst_of_observations_gets_one_command_each_in_order(ros):
    """Every joint_states of a burst is a step (none dropped, none merged), in order, and a goal
    echoed on ~/goal_applied is applied before the next observation's step."""
    proc = ros.start_node({"trigger": "observation"})
    c = NodeClient(ros, proc)
    eng = make_engine()
    got = _burst(c, OBS[:60])
    assert np.array_equal(got, np.array([eng.step(o) for o in OBS[:60]]))
    goal = [0.3, -0.2, 0.1, 0.0, -0.4, 0.2]
    c.set_goal(goal)
    eng.set_goal(goal)
    got = _burst(c, OBS[60:100])
    assert np.array_equal(got, np.array([eng.step(o) for o in OBS[60:100]]))
    assert proc.stop() == 0  # Ctrl-C: the inputs' loop ends with the node


def test_bytes_that_are_no_joint_state_change_nothing_and_the_loop_goes_on(ros):
    """Bytes published as a JointState that are none: whatever the middleware makes of them
    (this one drops them; a take that raises is logged and skipped by the loop), no command
    comes of them and the observations after them are stepped on as usual."""
    proc = ros.start_node({"trigger": "observation"})
    c = NodeClient(ros, proc)
    eng = make_engine()
    for _ in range(3):
        c._js.publish(b"\x00\x01\x00\x00garbage")  # a serialized message, as rclpy sends bytes
    ros.spin_for(0.5)
    assert not c.commands
    got = _burst(c, OBS[:5])
    assert np.array_equal(got, np.array([eng.step(o) for o in OBS[:5]]))


@pytest.mark.exclusive
def test_lifecycle_with_the_inputs_loop_and_serving_after_reconfigure(ros):
    """The loop runs from configure to cleanup: a goal is applied while inactive (as before),
    nothing steps while inactive, and after cleanup and a new configure the new subscriptions
    are served by a new loop."""
    proc = ros.start_node(
        {"trigger": "observation", "autostart": False},
        wait_services=("change_state", "list_capsules"),
    )
    c = NodeClient.__new__(NodeClient)  # the subscriptions exist only once configured
    goal = [0.2] * 6
    ids: list[str] = []  # the capsule id each round's engine gave
    for round_ in range(2):
        assert _transition(ros, proc, Transition.TRANSITION_CONFIGURE), round_
        if round_ == 0:
            c.__init__(ros, proc)
        else:  # the new subscriptions are matched before anything is sent
            assert ros.spin_until(lambda: c._js.get_subscription_count() > 0, 20)
            assert ros.spin_until(lambda: c._goal.get_subscription_count() > 0, 20)
            assert ros.spin_until(lambda: c._cmd_sub.get_publisher_count() > 0, 20)
            c.wait_matched()  # and the node has matched them too
            # the new engine's goal is latched, not the goal the engine before was given
            assert late_goal_echo(ros, proc) == make_engine().get_goal().tolist()
        c.set_goal(goal)  # inactive: applied (echoed) all the same
        n = len(c.commands)
        c.publish(OBS[0])
        ros.spin_for(0.5)
        assert len(c.commands) == n  # inactive: no step
        assert _transition(ros, proc, Transition.TRANSITION_ACTIVATE), round_
        eng = make_engine()  # configure built a new engine: the initial state, then the goal
        eng.set_goal(goal)
        got = _burst(c, OBS[:20])
        assert np.array_equal(got, np.array([eng.step(o) for o in OBS[:20]])), round_
        # capsule ids are never reissued by a new engine: a planner that kept round 0's id
        # must not restore another capsule by it (each engine counted from c0001)
        r = c.call("checkpoint")
        assert r.success and r.capsule.id not in ids, (r.message, ids)
        ids.append(r.capsule.id)
        if round_:
            r = c.call("restore", capsule=ids[0])
            assert not r.success and "unknown capsule" in r.message, r.message
        assert _transition(ros, proc, Transition.TRANSITION_DEACTIVATE), round_
        c.publish(OBS[20])
        ros.spin_for(0.5)
        assert len(c.commands) == n + 20
        assert _transition(ros, proc, Transition.TRANSITION_CLEANUP), round_
    # a lifecycle shutdown leaves the node finalized, for good: /diagnostics and the services
    # say so (they said "unconfigured" and "configure it first", which no transition allows)
    assert _transition(ros, proc, Transition.TRANSITION_UNCONFIGURED_SHUTDOWN)
    d = c.wait_diag(lambda d: d["state"] == "finalized", 5.0)
    assert d["_level"] == 1 and "restart the process" in d["_message"], d
    r = c.call("checkpoint")
    assert not r.success and "finalized" in r.message, r.message
    assert proc.alive()
    assert proc.stop() == 0


@pytest.mark.exclusive
def test_diagnostics_at_1hz_from_the_timer_loop_and_when_inactive(ros):
    """While the timer loop runs, the control thread publishes /diagnostics once a second
    (and the executor's timer does not as well); inactive, the executor's timer does. Both
    publish the same keys. The goal is served by the inputs' loop in timer mode too."""
    proc = ros.start_node({"trigger": "timer", "rate_hz": 100.0, "obs_timeout_s": 0.5})
    c = NodeClient(ros, proc)
    stamps: list[tuple[float, dict]] = []

    def on_diag(msg) -> None:
        for st in msg.status:
            if st.name.startswith(f"{proc.fqn}:"):
                t = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
                stamps.append((t, {kv.key: kv.value for kv in st.values}))

    ros.node.create_subscription(DiagnosticArray, "/diagnostics", on_diag, 10)
    c.set_goal([0.1] * 6)

    def window(seconds: float) -> list[tuple[float, dict]]:
        """Stream observations for `seconds`; the diagnostics stamped within that time."""
        t0 = time.time()
        i = 0
        while time.time() < t0 + seconds:
            c.publish(OBS[i % len(OBS)])
            i += 1
            ros.spin_for(0.02)
        ros.spin_for(0.5)  # the last ones arrive
        return [s for s in stamps if t0 <= s[0] <= t0 + seconds]

    ros.spin_for(1.5)  # settled: activated a while ago
    active = window(8.0)
    assert active and all(d["state"] == "active" for _, d in active), active
    assert c.commands, "no commands from the timer loop"
    # ~8: once a second from the control thread; at most 3 if only the executor's fallback
    # (every 4 s) did
    assert 5 <= len(active) <= 9, [t for t, _ in active]
    gaps = np.diff([t for t, _ in active])
    assert gaps.min() > 0.9, gaps  # one publisher, once a second

    assert _transition(ros, proc, Transition.TRANSITION_DEACTIVATE)
    ros.spin_for(1.5)
    inactive = window(4.0)
    assert inactive and all(d["state"] == "inactive" for _, d in inactive), inactive
    assert 2 <= len(inactive) <= 5, [t for t, _ in inactive]
    assert set(active[-1][1]) == set(inactive[-1][1])  # the same message, whoever publishes


@pytest.mark.exclusive
def test_diagnostics_pacing_between_the_control_thread_and_the_executor_timer(ros):
    """Diagnostics (node/diagnostics.py) on a real node, its hooks called directly: the control
    thread's idle hook publishes once a second when the next deadline leaves room, or after
    FORCE_S anyway; the executor's timer is cancelled while the control thread publishes."""
    import rclpy

    from flashrt_ros.node.diagnostics import Diagnostics
    from flashrt_ros.node.loop import EngineLock

    node = rclpy.create_node("flashrt_diag", context=ros.context)
    built: list[float] = []

    def build() -> DiagnosticArray:
        built.append(time.monotonic())
        return DiagnosticArray()

    lock = EngineLock()
    d = Diagnostics(node, build, lock)
    try:
        d.on_timer()  # no timer loop: the executor's timer publishes
        assert len(built) == 1
        assert d.timer.timer_period_ns == 1_000_000_000
        d.by_loop = True  # the timer loop runs
        d.on_timer()
        assert len(built) == 1  # the control thread publishes now
        assert d.timer.is_canceled()  # ... and the executor's timer never wakes it meanwhile

        def far() -> float:  # a next deadline with room
            return time.monotonic() + 0.5

        d.idle(far())
        assert len(built) == 1  # not due: less than a second since the last one
        d.last -= 1.0
        d.idle(time.monotonic())  # due, but the next deadline is now: no room
        assert len(built) == 1
        with lock:  # due, room, but the engine lock is held (a rollout step)
            d.idle(far())
        assert len(built) == 1
        d.idle(far())  # due and room: published, its cost measured
        assert len(built) == 2 and 0 < d.cost < 0.5
        d.on_timer()
        assert len(built) == 2
        d.last -= Diagnostics.FORCE_S
        d.idle(time.monotonic())  # no room for FORCE_S: published anyway
        assert len(built) == 3
        d.by_loop = False  # the timer loop stopped: the executor's timer is 1 Hz again
        assert not d.timer.is_canceled() and d.timer.timer_period_ns == 1_000_000_000
        d.on_timer()
        assert len(built) == 4
    finally:
        d.by_loop = False
        node.destroy_node()


@pytest.mark.exclusive
def test_diagnostics_watchdog_steps_in_for_a_silent_control_thread(ros):
    """While the control thread publishes, a watchdog thread (not the executor) publishes when
    it has been silent for FORCE_S + EVERY_S (a tick stuck on something), and never while it
    publishes on time; it ends when the loop stops."""
    import threading

    import rclpy

    from flashrt_ros.node.diagnostics import Diagnostics
    from flashrt_ros.node.loop import EngineLock

    node = rclpy.create_node("flashrt_diag_watch", context=ros.context)
    by: list[str] = []

    def build() -> DiagnosticArray:
        by.append(threading.current_thread().name)
        return DiagnosticArray()

    d = Diagnostics(node, build, EngineLock())
    # the watchdog looks every 0.75 s: a loaded machine can stall this thread's updates of
    # d.last for a good part of a second, which would be silence, not a bug
    d.FORCE_S, d.EVERY_S = 0.5, 0.25
    try:
        d.by_loop = True
        t_end = time.monotonic() + 2.0
        while time.monotonic() < t_end:  # the control thread publishes on time
            d.last = time.monotonic()
            time.sleep(0.02)
        assert by == []
        deadline = time.monotonic() + 5.0
        while not by and time.monotonic() < deadline:  # now it is silent
            time.sleep(0.02)
        assert by and set(by) == {"flashrt-diag-watch"}
        d.by_loop = False
        n = len(by)
        d.last -= 10.0
        time.sleep(0.4)
        assert len(by) == n  # the watchdog has ended (the executor's timer is back)
    finally:
        d.by_loop = False
        node.destroy_node()


def test_qos_overrides_let_observation_mode_hear_a_best_effort_driver(ros):
    """ROS's standard QoS override parameters reach the input subscriptions: with
    qos_overrides./<ns>/joint_states.subscription.reliability = best_effort, observation mode
    steps on a driver that publishes best effort (it never heard it, and the override was
    ignored without a word). An override that names no subscription is warned about."""
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import JointState

    from test.node_client import JOINTS

    proc = ros.start_node(
        {
            "trigger": "observation",
            "device": "cpu",
            "qos_overrides./be/joint_states.subscription.reliability": "best_effort",
            "qos_overrides./be/joint_state.subscription.reliability": "best_effort",
        },
        namespace="be",
    )
    c = NodeClient(ros, proc)
    pub = ros.node.create_publisher(JointState, proc.topic("joint_states"), qos_profile_sensor_data)
    assert ros.spin_until(lambda: pub.get_subscription_count() > 0, 10), "not matched"
    n = len(c.commands)
    for _ in range(20):  # best effort: a message sent before the match settles may be lost
        pub.publish(JointState(name=JOINTS, position=[0.1] * 6, velocity=[0.0] * 6))
        if ros.spin_until(lambda: len(c.commands) > n, 0.5):
            break
    assert len(c.commands) > n, proc.log_tail()
    said = "'qos_overrides./be/joint_state.subscription.reliability' ignored"
    assert said in proc.log_tail(200), proc.log_tail(200)
    ros.node.destroy_publisher(pub)


def test_a_bad_qos_override_fails_configure_saying_which(ros, tmp_path):
    """rclpy raises on a QoS override it cannot read; the error ended configure without a word
    (and left the engine held): the node now names the subscription and what it takes."""
    from test.ros_helpers import launch_node

    proc = launch_node(
        {"trigger": "observation", "device": "cpu"},
        ["-p", "qos_overrides./joint_states.subscription.reliability:=bogus"],
        log_dir=tmp_path,
    )
    assert proc.proc.wait(60) == 2
    log = proc.log_tail(50)
    assert "configure failed: joint_states" in log and "bogus" in log, log


def test_a_best_effort_goal_publisher_is_named_in_timer_mode_too(ros):
    """The goal is subscribed reliably in both modes; the check that names a publisher it can
    never hear ran only in observation mode, so in timer mode a best-effort goal publisher was
    ignored without a word (the robot kept going to the old goal)."""
    from rclpy.qos import qos_profile_sensor_data
    from std_msgs.msg import Float64MultiArray

    proc = ros.start_node({"trigger": "timer", "rate_hz": 50.0, "device": "cpu"}, namespace="tg")
    c = NodeClient(ros, proc)
    pub = ros.node.create_publisher(Float64MultiArray, proc.topic("goal"), qos_profile_sensor_data)
    d = c.wait_diag(lambda d: d.get("qos_mismatch", "") != "", 10.0)
    assert "/tg/goal" in d["qos_mismatch"] and "best_effort" in d["qos_mismatch"], d
    assert d["_level"] == 1, d
    assert ros.spin_until(lambda: "its messages never arrive" in proc.log_tail(200), 5)
    assert "trigger:=timer" not in proc.log_tail(200)  # no advice that would change nothing
    ros.node.destroy_publisher(pub)


def test_timer_mode_says_the_joint_states_are_refused_not_only_stale(ros):
    """A driver whose joint names do not match (joint1.. against l_j1..): every message is
    refused, so timer ticks are stale. /diagnostics said only "stale: no fresh joint_states",
    which sends an integrator after the driver's rate; it now also says why they are refused."""
    from sensor_msgs.msg import JointState

    from test.node_client import JOINTS

    arm = [f"l_j{i}" for i in range(1, 7)]
    proc = ros.start_node({"device": "cpu", "rate_hz": 50.0, "joint_names": arm})
    c = NodeClient(ros, proc)
    end, found = time.monotonic() + 15.0, None
    n = len(c.diagnostics)
    while time.monotonic() < end and found is None:
        c._js.publish(JointState(name=JOINTS, position=[0.0] * 6, velocity=[0.0] * 6))
        ros.spin_for(0.05)
        found = next((d for d in c.diagnostics[n:] if "refused" in d["_message"]), None)
    assert found is not None, c.diagnostics[-1:]
    assert found["_message"].startswith("stale: no fresh joint_states, holding; inputs refused"), (
        found
    )
    assert "lacks joints ['l_j1'" in found["_message"], found
    assert c.commands == []


def test_ctrl_c_while_observations_stream_ends_without_an_error(ros):
    """Ctrl-C in observation mode with joint_states streaming: rclpy shuts the context down
    while the inputs' thread is stepping, so that step's publish fails; that is the end, not
    an error (it logged "handler raised RCLError: ... context is invalid" at ERROR in 4 of 4
    runs at 500 Hz, review)."""
    from test.node_client import feeding

    for round_ in range(2):
        proc = ros.start_node({"trigger": "observation"}, namespace=f"stopping{round_}")
        c = NodeClient(ros, proc)
        with feeding(c, OBS, hz=1000.0):
            assert ros.spin_until(lambda c=c: len(c.commands) > 100, 20), proc.log_tail()
            rc = proc.stop()
        log = proc.log_path.read_text(errors="replace")
        assert rc == 0, log
        assert "handler raised" not in log and "Traceback" not in log, log
