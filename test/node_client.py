"""A test-side client of a running flashrt node: lockstep observations, commands, services."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.qos import QoSDurabilityPolicy, QoSProfile
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray

from flashrt_ros import srv

# the node's private services by name (`~/<name>`), as the clients here and the bench call them
SERVICE_TYPES = {
    "checkpoint": srv.Checkpoint,
    "restore": srv.Restore,
    "branch": srv.Branch,
    "list_capsules": srv.ListCapsules,
    "drop_capsule": srv.DropCapsule,
    "rollout": srv.Rollout,
    "drop_session": srv.DropSession,
    "reset_session": srv.ResetSession,
    "rewind": srv.Rewind,
    "dump_flight": srv.DumpFlight,
}

JOINTS = [f"joint{i}" for i in range(1, 7)]


def joint_state(obs, names=JOINTS) -> JointState:
    obs = np.asarray(obs, dtype=float)
    return JointState(name=list(names), position=obs[:6].tolist(), velocity=obs[6:].tolist())


@contextlib.contextmanager
def feeding(c: NodeClient, obs: np.ndarray, hz: float = 100.0) -> Iterator[list]:
    """The rows of `obs` in turn at `hz` from a thread, as a robot streams joint_states, for as
    long as the block runs; an observation put in `box[0]` replaces the next one, once."""
    stop, box = threading.Event(), [None]

    def feed() -> None:
        i = 0
        while not stop.is_set():
            row, box[0] = (box[0], None) if box[0] is not None else (obs[i % len(obs)], None)
            c.publish(row)
            i += 1
            time.sleep(1.0 / hz)

    t = threading.Thread(target=feed, daemon=True)
    t.start()
    try:
        yield box
    finally:
        stop.set()
        t.join()


def settled_count(
    c: NodeClient, spin, gap: float = 0.3, timeout: float = 5.0, items: list | None = None
) -> int:
    """The command count (or the length of `items`, another list the client fills) once none
    came for `gap` s, spinning with `spin(seconds)`.

    After a stream stops, commands already in flight still land, and a node starved on a loaded
    machine takes its last observations late (their age counts from when it took them); a node
    that never holds fails here."""
    got = c.commands if items is None else items
    end, n = time.monotonic() + timeout, len(got)
    while time.monotonic() < end:
        spin(gap)
        if len(got) == n:
            return n
        n = len(got)
    raise AssertionError(f"messages never stopped: {n} after {timeout:g} s")


class NodeClient:
    def __init__(self, ros, proc):
        self.ros, self.proc, n = ros, proc, ros.node
        self.commands: list[np.ndarray] = []
        self.diagnostics: list[dict] = []  # key/values, plus "_level" (int) and "_message"
        self.goals_applied = 0
        self.goal_echo: list[float] | None = None  # the last ~/goal_applied
        self._js = n.create_publisher(JointState, proc.topic("joint_states"), 100)
        self._goal = n.create_publisher(Float64MultiArray, proc.topic("goal"), 10)
        self._cmd_sub = n.create_subscription(
            Float64MultiArray,
            proc.topic("commands"),
            lambda m: self.commands.append(np.array(m.data)),
            1000,  # a test that streams at 200 Hz can be busy for a while on a loaded machine
        )
        n.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 10)
        latched = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
        n.create_subscription(
            Float64MultiArray, proc.service("goal_applied"), self._on_goal_applied, latched
        )
        # matched both ways before the first message: DDS keeps nothing for a late reader, so an
        # observation or a command sent before discovery completes would just be lost
        assert ros.spin_until(
            lambda: (
                self._js.get_subscription_count() > 0
                and self._goal.get_subscription_count() > 0
                and self._cmd_sub.get_publisher_count() > 0
            ),
            20,
        ), "node does not subscribe joint_states/goal, or does not publish commands\n" + (
            proc.log_tail()
        )
        # Each side matches the other on its own discovery: these counts are this process's
        # view, and the node's reader or writer can match seconds later on a loaded machine (a
        # first command lost that way failed a fresh-clone run 3 s after a fixed 1 s settle).
        # The node says its own view in /diagnostics: wait for it there.
        self.wait_matched()

    def wait_matched(self, timeout: float = 30.0) -> None:
        """Until a /diagnostics of the node counts at least as many readers of its commands and
        writers of its joint_states as this process knows of (ours among them). After a
        reconfigure too: the node's writer and reader are new then."""
        ros, n0 = self.ros, len(self.diagnostics)
        cmd, js = self._cmd_sub.topic_name, self._js.topic_name

        def matched() -> bool:
            if len(self.diagnostics) == n0:
                return False
            d = self.diagnostics[-1]
            c, j = d.get("command_subscribers", "-"), d.get("joint_states_publishers", "-")
            if not (c.isdigit() and j.isdigit()):  # "-": none yet; "?": a look that failed
                return False
            readers, writers = ros.node.count_subscribers(cmd), ros.node.count_publishers(js)
            return int(c) >= readers and int(j) >= writers

        seen = lambda: self.diagnostics[-1:] if len(self.diagnostics) > n0 else "none"  # noqa: E731
        assert ros.spin_until(matched, timeout), (
            "the node has not matched this client's command reader and joint_states writer "
            f"(its diagnostics: {seen()}"
            f"; this process knows {ros.node.count_subscribers(cmd)} readers of {cmd} and "
            f"{ros.node.count_publishers(js)} writers of {js})\n" + self.proc.log_tail()
        )

    def _on_diag(self, msg, info) -> None:
        for st in msg.status:
            if st.name.startswith(f"{self.proc.fqn}:"):  # this node's, not another's
                d = {kv.key: kv.value for kv in st.values}
                d["_level"], d["_message"] = int.from_bytes(st.level, "little"), st.message
                # when the node wrote it (wall ns; 0 where the middleware stamps none)
                d["_written_ns"] = int(info.get("source_timestamp", 0) or 0)
                self.diagnostics.append(d)

    def _on_goal_applied(self, msg) -> None:
        self.goals_applied += 1
        self.goal_echo = list(msg.data)

    def publish(self, obs, names=JOINTS) -> None:
        self._js.publish(joint_state(obs, names))

    def step(self, obs, names=JOINTS, timeout: float = 10.0) -> np.ndarray:
        """Publish one observation and wait for its command (observation trigger)."""
        n = len(self.commands)
        self.publish(obs, names)
        assert self.ros.spin_until(lambda: len(self.commands) > n, timeout), (
            "no command for a valid observation\n" + self.proc.log_tail()
        )
        assert len(self.commands) == n + 1
        return self.commands[-1]

    def run(self, obs_rows) -> np.ndarray:
        return np.array([self.step(o) for o in obs_rows])

    def set_goal(self, goal) -> None:
        """Publish a goal and wait for its echo (a restore's or reset's echo of the goal it
        brought back may come after the reply: it is not this goal's)."""
        n, data = self.goals_applied, [float(g) for g in goal]
        self._goal.publish(Float64MultiArray(data=data))
        assert self.ros.spin_until(lambda: self.goals_applied > n and self.goal_echo == data, 10), (
            "goal not applied"
        )

    def call(self, service: str, /, **fields):
        typ = SERVICE_TYPES[service]
        req = typ.Request()
        for k, v in fields.items():
            setattr(req, k, v)
        return self.ros.call(self.ros.client(typ, self.proc.service(service)), req, timeout=30)

    def latest_diag(self, timeout: float = 5.0) -> dict:
        """The first diagnostics the node wrote after this call: messages written while
        nothing spun wait in the subscription's history, and the oldest would come first."""
        t0, n = time.time_ns(), len(self.diagnostics)

        def fresh() -> list[dict]:
            return [
                d for d in self.diagnostics[n:] if not d["_written_ns"] or d["_written_ns"] >= t0
            ]

        assert self.ros.spin_until(lambda: bool(fresh()), timeout), "no diagnostics"
        return fresh()[0]

    def wait_diag(self, pred, timeout: float = 5.0) -> dict:
        """The first diagnostics message from now on for which pred(d) holds."""
        n = len(self.diagnostics)
        assert self.ros.spin_until(lambda: any(pred(d) for d in self.diagnostics[n:]), timeout), (
            f"no such diagnostics; last: {self.diagnostics[-1:]}"
        )
        return next(d for d in self.diagnostics[n:] if pred(d))


def late_goal_echo(ros, proc) -> list[float]:
    """What a subscriber that joins now (a planner started late) reads on the latched
    ~/goal_applied: the goal the node says its live session heads for."""
    got: list[list[float]] = []
    latched = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
    sub = ros.node.create_subscription(
        Float64MultiArray, proc.service("goal_applied"), lambda m: got.append(list(m.data)), latched
    )
    try:
        assert ros.spin_until(lambda: got, 10), "nothing latched on ~/goal_applied"
        ros.spin_for(0.2)  # an echo in flight as it joined comes after the latched one
        return got[-1]
    finally:
        ros.node.destroy_subscription(sub)


def set_params(ros, proc, **values) -> list[tuple[bool, str]]:
    """Set parameters of a running node through its real SetParameters service."""
    from rcl_interfaces.srv import SetParameters
    from rclpy.parameter import Parameter

    req = SetParameters.Request(
        parameters=[Parameter(k, value=v).to_parameter_msg() for k, v in values.items()]
    )
    resp = ros.call(ros.client(SetParameters, proc.service("set_parameters")), req)
    return [(r.successful, r.reason) for r in resp.results]
