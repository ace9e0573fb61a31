"""A capsule the full pool evicts is named where a planner and an operator look: in the reply
of the call that cost it (checkpoint, rewind with keep) and on /rosout, where the core's own
log lines (Python `logging`: the runtime and the capsule store never import ROS) now arrive
as the node's. Before, a planner learned of it only when its restore failed with "unknown
capsule", and a persisted file skipped at a restart was said on stderr alone. A capsule file the
disk refuses to remove is the operator's trouble: said on /diagnostics, as a refused write is."""

from __future__ import annotations

from rcl_interfaces.msg import Log
from rclpy.qos import QoSDurabilityPolicy, QoSProfile, QoSReliabilityPolicy

from flashrt_ros.srv import Rewind
from test.engine_util import immutable, observations
from test.node_client import NodeClient

OBS = observations(10, seed=3)


def rosout(ros) -> list[Log]:
    """Every line the nodes of this domain log, kept as they come (and those logged before,
    from rosout's transient-local history)."""
    lines: list[Log] = []
    qos = QoSProfile(
        depth=1000,
        reliability=QoSReliabilityPolicy.RELIABLE,
        durability=QoSDurabilityPolicy.TRANSIENT_LOCAL,
    )
    ros.node.create_subscription(Log, "/rosout", lines.append, qos)
    return lines


def test_an_evicted_capsule_is_named_in_the_reply_and_on_rosout(ros, tmp_path):
    capdir = tmp_path / "capsules"
    capdir.mkdir()
    params = {
        "trigger": "observation",
        "device": "cpu",
        "capsule_slots": 2,
        "capsule_dir": str(capdir),
        "flight_ticks": 4,
    }
    lines = rosout(ros)
    proc = ros.start_node(params, wait_services=("list_capsules", "rewind"))
    node = NodeClient(ros, proc)
    node.run(OBS[:3])
    first = node.call("checkpoint", name="before_grasp", persist=True)
    second = node.call("checkpoint", name="a", persist=True)
    assert first.success and second.success, (first.message, second.message)
    assert "evicted" not in first.message + second.message  # room for both
    third = node.call("checkpoint", name="b", persist=True)
    assert third.success, third.message
    gone = f"{first.capsule.id} ('before_grasp')"
    assert f"the pool was full: evicted {gone}" in third.message, third.message
    assert sorted(c.name for c in node.call("list_capsules").capsules) == ["a", "b"]
    said = f"[runtime.engine] capsule pool full: evicted {gone}"
    assert ros.spin_until(
        lambda: any(m.name == "flashrt" and m.level == Log.WARN and said in m.msg for m in lines),
        10.0,
    ), [m.msg for m in lines][-20:]

    # the flight recorder's keep makes a capsule too: its reply names what it evicted
    node.run(OBS[3:6])
    rewind = Rewind.Request(steps_back=1, keep=True)
    r = ros.call(ros.client(Rewind, proc.service("rewind")), rewind, timeout=30)
    assert r.success, r.message
    assert f"evicted {second.capsule.id} ('a')" in r.message, r.message
    # and /diagnostics counts them (it said OK with `capsules` steady: nothing lost, it seemed)
    d = node.wait_diag(lambda d: d.get("capsules_evicted") == "2", 5.0)
    assert d["capsule_files_not_loaded"] == "0" and d["last_not_loaded"] == "", d
    proc.stop()

    # a restart finds three files for two slots: the one left on disk is said on /rosout
    n = len(lines)
    proc = ros.start_node(params)
    left = f"capsule file {capdir / 'before_grasp.fcap'} not loaded: the pool is full"
    assert ros.spin_until(
        lambda: any(m.level == Log.WARN and left in m.msg for m in lines[n:]), 10.0
    ), [m.msg for m in lines[n:]][-20:]
    again = NodeClient(ros, proc)
    reloaded = sorted(c.name for c in again.call("list_capsules").capsules)
    assert reloaded == ["a", "b"]
    d = again.wait_diag(lambda d: "capsule_files_not_loaded" in d, 5.0)
    assert d["capsule_files_not_loaded"] == "1" and "before_grasp.fcap" in d["last_not_loaded"]


def test_a_capsule_file_the_disk_will_not_remove_keeps_its_capsule_and_warns(ros, tmp_path):
    """~/drop_capsule of a persisted capsule whose file capsule_dir refuses to remove (an
    immutable file, a read-only mount): success=false saying why, the capsule stays listed and
    restorable, and /diagnostics WARNs and counts it as a failed write to capsule_dir (it said
    OK: only the planner knew). Once the disk lets go, the drop works."""
    capdir = tmp_path / "capsules"
    proc = ros.start_node({"trigger": "observation", "device": "cpu", "capsule_dir": str(capdir)})
    node = NodeClient(ros, proc)
    node.run(OBS[:3])
    cp = node.call("checkpoint", name="safe_pose", persist=True)
    assert cp.success, cp.message
    with immutable(capdir / "safe_pose.fcap"):
        node.run(OBS[3:5])  # fresh joint_states: "no step: waiting" would come first
        r = node.call("drop_capsule", capsule="safe_pose")
        assert not r.success and "cannot remove" in r.message, r.message
        assert "fault" not in r.message, r.message
        assert [c.name for c in node.call("list_capsules").capsules] == ["safe_pose"]
        d = node.wait_diag(lambda d: d["_message"].startswith("writes to capsule_dir fail"), 5.0)
        assert d["disk_write_failures"] == "1" and d["faults"] == "0", d
        assert "safe_pose.fcap" in d["last_disk_error"], d
        back = node.call("restore", capsule="safe_pose")
        assert back.success and back.step == cp.capsule.step, back.message
    r = node.call("drop_capsule", capsule="safe_pose")
    assert r.success, r.message
    assert node.call("list_capsules").capsules == [] and list(capdir.glob("*.fcap")) == []
