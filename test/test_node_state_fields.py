"""`state_fields`: which sensor_msgs/JointState arrays make the observation, over real DDS on
loopback (CPU). Most LeRobot policies take the joint positions alone (observation.state of one
value per joint); the node used to take positions and velocities always, so it refused such a
policy at configure, and a driver that publishes no velocities could drive none."""

from __future__ import annotations

import os

import numpy as np
import pytest
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray

from test.node_client import JOINTS, NodeClient
from test.ros_helpers import REPO_ROOT, launch_node

POSITIONS_ONLY = "test.lerobot_like:make_joints"  # observation.state (6,), action (6,)
TINY = "test.tiny_policy:tiny"  # obs 12, action 6


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch) -> None:
    """The node process imports the test policies from this repository."""
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{REPO_ROOT}{os.pathsep}{old}" if old else str(REPO_ROOT))


def offline(spec: str, rows: np.ndarray) -> np.ndarray:
    from flashrt_ros import Engine, load_policy

    eng = Engine(load_policy(spec), device="cpu", seed=0)
    return np.array([eng.step(r) for r in rows])


def step_msg(ros, c: NodeClient, msg: JointState, timeout: float = 10.0) -> np.ndarray:
    n = len(c.commands)
    c._js.publish(msg)
    assert ros.spin_until(lambda: len(c.commands) > n, timeout), "no command"
    return np.asarray(c.commands[n])


def test_a_positions_only_lerobot_policy_steps_on_positions_alone(ros):
    """state_fields [position]: a joint_states with no velocities steps the policy, by name,
    across its re-inference boundaries, as the same Engine steps the positions offline."""
    proc = ros.start_node(
        {
            "policy": POSITIONS_ONLY,
            "trigger": "observation",
            "device": "cpu",
            "state_fields": ["position"],
        }
    )
    c = NodeClient(ros, proc)
    rows = np.random.default_rng(1).uniform(-1.0, 1.0, (7, 6))
    got = [
        step_msg(ros, c, JointState(name=list(reversed(JOINTS)), position=r[::-1].tolist()))
        for r in rows
    ]
    np.testing.assert_array_equal(np.array(got), offline(POSITIONS_ONLY, rows))


def test_position_and_effort_make_the_state_and_a_message_without_effort_is_refused(ros):
    proc = ros.start_node(
        {"policy": TINY, "trigger": "observation", "device": "cpu"}
        | {"state_fields": ["position", "effort"]}
    )
    c = NodeClient(ros, proc)
    rows = np.random.default_rng(2).uniform(-1.0, 1.0, (4, 12))
    got = [
        step_msg(
            ros,
            c,
            JointState(name=JOINTS, position=r[:6].tolist(), effort=r[6:].tolist()),
        )
        for r in rows
    ]
    np.testing.assert_array_equal(np.array(got), offline(TINY, rows))
    before = int(c.latest_diag()["refused_inputs"])
    n = len(c.commands)
    c._js.publish(JointState(name=JOINTS, position=[0.1] * 6, velocity=[0.2] * 6))
    diag = c.wait_diag(lambda d: int(d["refused_inputs"]) > before)
    assert "effort" in diag["last_refusal"], diag
    ros.spin_for(0.3)
    assert len(c.commands) == n  # never stepped
    # a refused goal's reason, said once ("goal: goal must have ..." before)
    c._goal.publish(Float64MultiArray(data=[0.1, 0.2]))
    diag = c.wait_diag(lambda d: "(2,)" in d["last_refusal"])
    assert diag["last_refusal"] == "goal must have shape (6,), got (2,)", diag


@pytest.mark.parametrize(
    "params, needle",
    [
        # the policy's state is 6 positions: the default [position, velocity] makes 12
        (
            {"policy": POSITIONS_ONLY},
            "make 12 observations (6 = 1 x 6 joints: state_fields ['position'] would fit)",
        ),
        ({"policy": TINY, "state_fields": ["position"]}, "['position', 'velocity'] would fit"),
        # the state fits; the action does not (it said only what would fit the state)
        (
            {"policy": "test.lerobot_like:make_joints_seven_actions", "state_fields": ["position"]},
            "gives 7 actions and joint_names has 6 joints: a command carries one action per "
            "joint, in joint_names' order",
        ),
        ({"state_fields": ["positions"]}, "state_fields"),
        ({"state_fields": ["position", "position"]}, "each at most once"),
    ],
)
def test_state_fields_that_do_not_fit_the_policy_fail_configure_saying_what_would(
    ros, tmp_path, params, needle
):
    proc = launch_node({"device": "cpu", "trigger": "observation"} | params, log_dir=tmp_path)
    assert proc.proc.wait(timeout=60) == 2, proc.log_tail()
    assert needle in proc.log_tail(), proc.log_tail()


def test_a_positions_only_bag_replays_through_the_node_as_offline(ros, tmp_path, capsys):
    """flashrt-replay reads the node's state_fields: a bag whose joint_states carry positions
    alone replays through the node (before, every sample was refused for its missing
    velocities) and equals the offline replay with --state-fields position. The policy takes
    no goal: the bag's goal is left out through the node as offline (the replay waited for an
    echo that never came, then failed)."""
    from flashrt_ros.replay import bags
    from flashrt_ros.replay.bagdiff_cli import main as bagdiff
    from flashrt_ros.replay.replay_cli import main as replay

    ros.start_node(
        {
            "policy": POSITIONS_ONLY,
            "trigger": "observation",
            "device": "cpu",
            "state_fields": ["position"],
        }
    )
    q = np.random.default_rng(3).uniform(-1.0, 1.0, (20, 6))
    stamps = [1_000_000_000 + k * 10_000_000 for k in range(20)]
    events = [
        bags.InputEvent("joint_states", s, names=JOINTS, position=r)
        for s, r in zip(stamps, q, strict=True)
    ]
    events.insert(5, bags.InputEvent("goal", stamps[4] + 1, data=np.full(6, 0.2)))
    bags.write_inputs(tmp_path / "in", events, storage="mcap")
    assert replay([str(tmp_path / "in"), str(tmp_path / "node")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert ": 20 commands" in out and "1 samples skipped" in out, out
    off = ["--offline", "--policy", POSITIONS_ONLY, "--state-fields", "position"]
    assert replay([str(tmp_path / "in"), str(tmp_path / "off"), *off]) == 0
    assert bagdiff([str(tmp_path / "node"), str(tmp_path / "off")]) == 0
    got = np.array([v for _, v in bags.read_commands(tmp_path / "node")])
    np.testing.assert_array_equal(got, offline(POSITIONS_ONLY, q))
