"""The flashrt node over real rclpy and DDS (loopback), observation trigger, on the CPU.

The node's commands are checked against the Engine driven directly with the same policy and
seed: the node must add nothing and lose nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

from test.engine_util import make_engine, observations, rate_with_room
from test.node_client import JOINTS, NodeClient, late_goal_echo

OBS = observations(400, seed=7)


@pytest.fixture(scope="module")
def node(ros_module):
    proc = ros_module.start_node({"trigger": "observation", "capsule_slots": 8})
    return NodeClient(ros_module, proc)


@pytest.fixture()
def fresh(node):
    """Each test starts from the node's initial state: restore the capsule taken at step 0."""
    if not any(c.name == "origin" for c in node.call("list_capsules").capsules):
        r = node.call("checkpoint", name="origin", pin=True)
        assert r.success, r.message
    assert node.call("branch", capsule="origin", session="main", activate=True).success
    for c in node.call("list_capsules").capsules:
        if c.name != "origin":
            node.call("drop_capsule", capsule=c.id)
    return node


def test_one_command_per_observation_equal_to_the_engine(fresh):
    eng = make_engine()
    got = fresh.run(OBS[:60])
    want = np.array([eng.step(o) for o in OBS[:60]])
    assert got.shape == (60, 6)
    assert np.array_equal(got, want)


def test_checkpoint_restore_gives_identical_commands(fresh):
    fresh.run(OBS[:20])
    cp = fresh.call("checkpoint", name="before_move")
    assert cp.success and cp.capsule.step == 20 and cp.capsule.session == "main"
    first = fresh.run(OBS[20:70])
    r = fresh.call("restore", capsule="before_move", verify=True)
    assert r.success and r.step == 20, r.message
    assert np.array_equal(fresh.run(OBS[20:70]), first)
    # what happened is in the node's log (written after the replies, by the serving thread)
    want = [f"checkpoint: capsule {cp.capsule.id} of 'main' at step 20", "restore: restored"]
    assert fresh.ros.spin_until(lambda: all(w in fresh.proc.log_tail() for w in want), 5.0), (
        fresh.proc.log_tail()
    )


def test_branch_rollout_equals_live_continuation_and_scratch_leaves_live_alone(fresh):
    fresh.run(OBS[:30])
    cp = fresh.call("checkpoint")
    b = fresh.call("branch", capsule=cp.capsule.id, session="plan_b")
    assert b.success and b.step == 30, b.message
    rows = OBS[30:80]
    ro = fresh.call(
        "rollout",
        session="plan_b",
        observations=rows.ravel().tolist(),
        n_steps=len(rows),
        commit=True,
    )
    assert ro.success and ro.action_dim == 6, ro.message
    scratch = fresh.call("rollout", observations=rows.ravel().tolist(), n_steps=len(rows))
    assert scratch.success, scratch.message
    live = fresh.run(rows)  # the scratch rollout did not advance the live session
    assert np.array_equal(np.array(ro.actions).reshape(-1, 6), live)
    assert np.array_equal(np.array(scratch.actions).reshape(-1, 6), live)
    from_cap = fresh.call(
        "rollout", capsule=cp.capsule.id, observations=rows.ravel().tolist(), n_steps=len(rows)
    )
    assert np.array_equal(np.array(from_cap.actions).reshape(-1, 6), live)


def test_branch_with_activate_switches_what_is_published(fresh):
    fresh.run(OBS[:25])
    cp = fresh.call("checkpoint")
    goal = [0.4, -0.3, 0.2, 0.0, 0.5, -0.5]
    eng = make_engine()
    for o in OBS[:25]:
        eng.step(o)
    eng.set_goal(goal)
    want = np.array([eng.step(o) for o in OBS[25:60]])
    b = fresh.call("branch", capsule=cp.capsule.id, session="alt", activate=True, goal=goal)
    assert b.success, b.message
    assert fresh.call("list_capsules").live_session == "alt"
    assert np.array_equal(fresh.run(OBS[25:60]), want)


def test_goal_topic_applies_at_the_next_boundary(fresh):
    eng = make_engine()
    fresh.run(OBS[:10])
    for o in OBS[:10]:
        eng.step(o)
    goal = [0.1] * 6
    fresh.set_goal(goal)
    eng.set_goal(goal)
    assert np.array_equal(fresh.run(OBS[10:40]), np.array([eng.step(o) for o in OBS[10:40]]))


def test_goal_applied_says_the_goal_a_restore_branch_or_reset_brought_back(fresh):
    """~/goal_applied is latched: a planner that joins late reads it as the goal the robot heads
    for, so a request that brings another goal back says it there too."""

    def as_held(g) -> list[float]:  # the goal buffer is float32
        return np.asarray(g, dtype=np.float32).astype(np.float64).tolist()

    g1, g2, g3 = [0.3] * 6, [-0.2] * 6, [0.1, 0.2, 0.3, -0.1, -0.2, -0.3]
    fresh.set_goal(g1)
    cp = fresh.call("checkpoint")
    fresh.set_goal(g2)
    assert late_goal_echo(fresh.ros, fresh.proc) == g2
    assert fresh.call("restore", capsule=cp.capsule.id).success
    assert late_goal_echo(fresh.ros, fresh.proc) == as_held(g1)
    r = fresh.call("branch", capsule=cp.capsule.id, session="alt", activate=True, goal=g3)
    assert r.success, r.message
    assert late_goal_echo(fresh.ros, fresh.proc) == as_held(g3)
    fresh.set_goal(g2)
    assert fresh.call("reset_session").success  # the live session: its initial goal
    assert late_goal_echo(fresh.ros, fresh.proc) == make_engine().get_goal().tolist()
    # a session that is not live moves without a word on the live session's echo
    assert fresh.call("restore", capsule=cp.capsule.id, session="main").success
    assert late_goal_echo(fresh.ros, fresh.proc) == make_engine().get_goal().tolist()


def test_diagnostics_count_the_readers_and_writers_the_node_has_matched(fresh):
    """The node's own view of its matches, which a client's counts cannot give (each side
    discovers the other on its own): ours are among them, and a reader that goes away is
    counted out, so an operator sees commands that go nowhere."""
    from std_msgs.msg import Float64MultiArray

    def readers_become(want: int) -> dict:
        return fresh.wait_diag(lambda d: int(d["command_subscribers"]) == want, 15.0)

    d = fresh.latest_diag(10.0)
    cmd, js = int(d["command_subscribers"]), int(d["joint_states_publishers"])
    assert cmd >= 1 and js >= 1, d
    extra = fresh.ros.node.create_subscription(
        Float64MultiArray, fresh.proc.topic("commands"), lambda m: None, 10
    )
    readers_become(cmd + 1)
    fresh.ros.node.destroy_subscription(extra)
    readers_become(cmd)


def test_bad_observations_are_refused_counted_and_never_stepped(fresh):
    eng = make_engine()
    before = int(fresh.latest_diag()["refused_inputs"])
    good = OBS[0]
    bad_msgs = [
        (np.r_[np.nan, good[1:]], JOINTS),
        (np.r_[good[:7], np.inf, good[8:]], JOINTS),
        (good, JOINTS[:5] + ["elbow"]),  # a joint missing
    ]
    n = len(fresh.commands)
    for obs, names in bad_msgs:
        fresh.publish(obs, names)
    from sensor_msgs.msg import JointState

    fresh._js.publish(JointState(name=JOINTS, position=[0.0] * 6, velocity=[0.0] * 3))
    # extra joints in any order are fine: this one is stepped
    names = ["gripper"] + JOINTS[::-1]
    obs_rev = np.r_[0.0, good[:6][::-1]], np.r_[0.0, good[6:][::-1]]
    from flashrt_ros.obs.joints import JointMapper

    mapped = JointMapper(JOINTS).observation(names, obs_rev[0], obs_rev[1])
    assert np.array_equal(mapped, good)
    fresh._js.publish(
        JointState(name=names, position=obs_rev[0].tolist(), velocity=obs_rev[1].tolist())
    )
    assert fresh.ros.spin_until(lambda: len(fresh.commands) > n, 10)
    fresh.ros.spin_for(0.3)
    assert len(fresh.commands) == n + 1  # only the valid message was stepped
    assert np.array_equal(fresh.commands[-1], eng.step(good))
    assert fresh.ros.spin_until(
        lambda: (
            int(fresh.diagnostics[-1]["refused_inputs"]) >= before + 4
            if fresh.diagnostics
            else False
        ),
        5,
    )


@pytest.mark.parametrize(
    "service,fields,needle",
    [
        ("restore", {"capsule": "no_such"}, "unknown capsule"),
        ("restore", {"capsule": "origin", "session": "ghost"}, "unknown session"),
        ("checkpoint", {"name": "../../etc/passwd"}, "capsule name"),
        ("checkpoint", {"name": "origin"}, "taken"),
        ("checkpoint", {"persist": True}, "capsule_dir"),
        ("branch", {"capsule": "origin", "session": "bad name"}, "session name"),
        ("branch", {"capsule": "origin", "session": "_rollout"}, "reserved"),
        ("branch", {"capsule": "origin", "session": "g", "goal": [1.0, 2.0]}, "goal"),
        ("branch", {"capsule": "missing", "session": "x"}, "unknown capsule"),
        ("drop_capsule", {"capsule": "nope"}, "unknown capsule"),
        ("rollout", {"observations": [0.0] * 11, "n_steps": 1}, "need 12"),
        ("rollout", {"observations": [], "n_steps": 0}, "n_steps"),
        ("rollout", {"observations": [float("nan")] * 12, "n_steps": 1}, "NaN"),
        ("rollout", {"observations": [0.0] * 12, "n_steps": 1, "commit": True}, "named session"),
        (
            "rollout",
            {"observations": [0.0] * 12, "n_steps": 1, "commit": True, "session": "main"},
            "live session",
        ),
        (
            "rollout",
            {
                "observations": [0.0] * 11 + [1e39],
                "n_steps": 1,
                "commit": True,
                "session": "c_new",
                "capsule": "origin",
            },
            "obs_limit",
        ),
        (
            "rollout",
            {
                "observations": [0.0] * 12,
                "n_steps": 1,
                "commit": True,
                "session": "_rollout",
                "capsule": "origin",
            },
            "reserved",
        ),
        ("rollout", {"observations": [0.0] * 12, "n_steps": 20_000}, "n_steps"),
    ],
)
def test_bad_requests_answer_cleanly_and_change_nothing(fresh, service, fields, needle):
    fresh.run(OBS[:5])
    before = fresh.call("list_capsules")
    resp = fresh.call(service, **fields)
    assert not resp.success and needle in resp.message, resp.message
    assert fresh.ros.spin_until(lambda: resp.message in fresh.proc.log_tail(), 5.0)  # warned
    after = fresh.call("list_capsules")
    assert [c.id for c in after.capsules] == [c.id for c in before.capsules]
    assert after.sessions == before.sessions and after.live_session == before.live_session
    eng = make_engine()
    want = [eng.step(o) for o in OBS[:8]][5:]
    assert np.array_equal(fresh.run(OBS[5:8]), np.array(want))


@pytest.mark.exclusive
def test_capsule_calls_interleaved_with_a_200hz_stream(fresh):
    """150 capsule calls while a thread streams observations at up to 200 Hz: every call
    succeeds, every observation gets its command. The rate leaves the node room on this
    machine (a 4 ms CPU step under a loaded CI machine's preemption fell behind 200 Hz)."""
    import threading
    import time

    hz = rate_with_room(0.25, 200.0)
    ros, n0, sent, stop = fresh.ros, len(fresh.commands), [0], threading.Event()

    def stream() -> None:
        t_next = time.monotonic()
        while not stop.is_set():
            fresh.publish(OBS[sent[0] % len(OBS)])
            sent[0] += 1
            t_next += 1.0 / hz
            time.sleep(max(0.0, t_next - time.monotonic()))

    streamer = threading.Thread(target=stream, daemon=True)
    streamer.start()
    failures, last_cap = [], None
    kinds = ["checkpoint", "list_capsules", "restore", "drop_capsule", "branch"]
    try:
        for i in range(150):
            kind = kinds[i % len(kinds)]
            if kind == "checkpoint":
                r = fresh.call("checkpoint")
                last_cap = r.capsule.id
            elif kind == "restore":
                r = fresh.call("restore", capsule=last_cap)
            elif kind == "drop_capsule":
                r = fresh.call("drop_capsule", capsule=last_cap)
            elif kind == "branch":
                r = fresh.call("branch", capsule="origin", session="side")
            else:
                r = fresh.call("list_capsules")
            if hasattr(r, "success") and not r.success:
                failures.append((kind, r.message))
            ros.spin_for(0.005)
    finally:
        while sent[0] < hz and streamer.is_alive():  # at least a second of stream in all
            ros.spin_for(0.05)
        stop.set()
        streamer.join()
    assert failures == []
    ros.spin_until(lambda: len(fresh.commands) - n0 >= sent[0], 10)
    assert len(fresh.commands) - n0 == sent[0]
    assert fresh.proc.alive()


def test_session_limit_holds_for_branch_and_committed_rollouts(fresh):
    """max_sessions (4) counts main and every branch; the hidden rollout session is extra."""
    for s in fresh.call("list_capsules").sessions:
        if s != "main":
            assert fresh.call("drop_session", session=s).success
    for bad, needle in (
        ("main", "live session"),
        ("nope", "unknown session"),
        ("", "name a session"),
        ("_rollout", "reserved"),
    ):
        r = fresh.call("drop_session", session=bad)
        assert not r.success and needle in r.message, r.message
    made = []
    for name in ("s1", "s2", "s3"):
        r = fresh.call("branch", capsule="origin", session=name)
        assert r.success, r.message
        made.append(name)
    for resp in (
        fresh.call("branch", capsule="origin", session="s4"),
        fresh.call(
            "rollout",
            capsule="origin",
            session="s4",
            commit=True,
            observations=[0.0] * 12,
            n_steps=1,
        ),
    ):
        assert not resp.success and "max_sessions" in resp.message
    scratch = fresh.call("rollout", observations=[0.0] * 12, n_steps=1)
    assert scratch.success, scratch.message  # a scratch fork still works at the limit
    assert sorted(fresh.call("list_capsules").sessions) == sorted(["main", *made])


def test_a_committed_rollout_stops_when_another_request_moves_its_session(fresh):
    """A reset (or restore, rewind, branch into it, drop) of the session a committed rollout
    steps, served between two of its steps, used to be stepped over: the rollout went on from
    the new state and replied success, its actions mixing two starting states. It stops now,
    says why, and the session holds what the other request put there."""
    from flashrt_ros import srv

    for s in fresh.call("list_capsules").sessions:  # room under max_sessions
        if s != "main":
            assert fresh.call("drop_session", session=s).success
    assert fresh.call("branch", capsule="origin", session="b1").success
    steps = 5000  # far more than fit in the time before the reset
    req = srv.Rollout.Request(
        session="b1", commit=True, observations=np.tile(OBS[0], steps).tolist(), n_steps=steps
    )
    client = fresh.ros.client(srv.Rollout, fresh.proc.service("rollout"))
    assert client.wait_for_service(timeout_sec=10)
    fut = client.call_async(req)
    fresh.ros.spin_for(0.5)
    assert not fut.done(), f"the rollout ended before the reset: {fut.result().message}"
    r = fresh.call("reset_session", session="b1")
    assert r.success and r.step == 0, r.message
    assert fresh.ros.spin_until(fut.done, 60), "no reply from the rollout"
    got = fut.result()
    assert not got.success and "reset, rewound, replaced or dropped" in got.message, got.message
    cp = fresh.call("checkpoint", session="b1")
    assert cp.success and cp.capsule.step == 0, cp.message  # what the reset left
    assert fresh.call("drop_session", session="b1").success
