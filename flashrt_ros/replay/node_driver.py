"""Lockstep replay into a running flashrt node over DDS: send one input, wait for its effect.

Images: each camera image is published on `camera/<name>/image_raw` and the replay waits for the
node's `~/camera_seen` acknowledgement (latched: images received and accepted per camera) before
it sends anything else, so the joint_states that follows steps on exactly that image. (Waiting
is needed: DDS orders the messages of one topic, not those of two, so an image published just
before a joint_states may arrive after it.) The node must be freshly activated: images it took
before the replay are not the bag's: a joint_states that comes before every camera had an image
in this replay is not sent (and --offline skips it too)."""

from __future__ import annotations

import time

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.srv import GetParameters
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import QoSDurabilityPolicy, QoSProfile
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray, UInt64MultiArray

from flashrt_ros.replay.bags import InputEvent
from flashrt_ros.srv import Checkpoint, ResetSession, Restore


class NodeError(RuntimeError):
    """The node is missing, misconfigured or stopped answering."""


class NodeDriver:
    def __init__(self, node_name: str = "/flashrt", timeout: float = 10.0):
        self.node_name = "/" + node_name.strip("/")
        ns = self.node_name.rsplit("/", 1)[0]
        self.timeout = timeout
        self.n = rclpy.create_node("flashrt_replay")
        self.ex = SingleThreadedExecutor()
        self.ex.add_node(self.n)
        self.commands: list[np.ndarray] = []
        self.goal_echoes = 0
        self.goal_echo: list[float] | None = None  # the last ~/goal_applied
        self.js = self.n.create_publisher(JointState, f"{ns}/joint_states", 100)
        self.goal_pub = self.n.create_publisher(Float64MultiArray, f"{ns}/goal", 10)
        self.cmd_sub = self.n.create_subscription(
            Float64MultiArray,
            f"{ns}/commands",
            lambda m: self.commands.append(np.array(m.data)),
            100,
        )
        latched = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
        self.n.create_subscription(
            Float64MultiArray, f"{self.node_name}/goal_applied", self._on_echo, latched
        )
        self.cp = self.n.create_client(Checkpoint, f"{self.node_name}/checkpoint")
        self.rs = self.n.create_client(Restore, f"{self.node_name}/restore")
        self.reset_cl = self.n.create_client(ResetSession, f"{self.node_name}/reset_session")
        self.params = self.n.create_client(GetParameters, f"{self.node_name}/get_parameters")
        self.ns = ns
        self.cameras: list[str] = []  # the node's, in its `cameras` order
        self.seen: list[int] | None = None  # ~/camera_seen: received, accepted per camera
        self._img_pubs: dict[str, object] = {}
        self._has_image: set[str] = set()  # cameras with an image accepted in this replay
        self.n.create_subscription(
            UInt64MultiArray, f"{self.node_name}/camera_seen", self._on_seen, latched
        )

    def _on_seen(self, msg) -> None:
        self.seen = list(msg.data)

    def _on_echo(self, msg) -> None:
        self.goal_echoes += 1
        self.goal_echo = list(msg.data)

    def _spin_until(self, pred, what: str) -> None:
        end = time.monotonic() + self.timeout
        while not pred():
            if time.monotonic() > end:
                raise NodeError(f"{what}: no answer from {self.node_name} within {self.timeout} s")
            self.ex.spin_once(timeout_sec=0.01)

    def _call(self, client, req):
        if not client.wait_for_service(timeout_sec=self.timeout):
            raise NodeError(
                f"no flashrt node answering at {self.node_name} (is it running, "
                "in this ROS_DOMAIN_ID?)"
            )
        fut = client.call_async(req)
        self._spin_until(fut.done, client.srv_name)
        return fut.result()

    def connect(self) -> tuple[list[str], float, list[str]]:
        """Check the node is there in observation mode; returns its joint_names, obs_limit and
        state_fields (the replay leaves out what the node would refuse, and expects no command
        for it)."""
        resp = self._call(
            self.params,
            GetParameters.Request(
                names=[
                    "trigger",
                    "joint_names",
                    "cameras",
                    "obs_limit",
                    "state_fields",
                    "step_on",
                    "output",
                ]
            ),
        )
        trigger, joints = resp.values[0].string_value, list(resp.values[1].string_array_value)
        cams = list(resp.values[2].string_array_value)
        limit = resp.values[3].double_value
        fields = list(resp.values[4].string_array_value)
        step_on = list(resp.values[5].string_array_value)
        self.cameras = [c.partition(":")[0] for c in cams]
        compressed = [c.partition(":")[0] for c in cams if c.endswith(":compressed")]
        if compressed:
            raise NodeError(
                f"{self.node_name} takes compressed frames from cameras {compressed}; replay "
                "sends a bag's sensor_msgs/Image frames: run the node with raw cameras"
            )
        if trigger != "observation":
            raise NodeError(
                f"{self.node_name} runs trigger:={trigger}; replay needs "
                "trigger:=observation (one step per joint_states message)"
            )
        if step_on != ["joint_states"]:  # frame sets step on the images: no lockstep pairing
            raise NodeError(
                f"{self.node_name} steps on {step_on}; replay needs step_on: [joint_states] "
                "(one step per joint_states message, each on the images sent before it)"
            )
        output = resp.values[6].string_value
        if output not in ("commands", "both"):  # else no commands publisher ever comes
            raise NodeError(
                f"{self.node_name} runs output:={output}; replay records its commands topic: "
                "run the node with output:=commands or output:=both"
            )
        self._spin_until(lambda: self.js.get_subscription_count() > 0, "joint_states subscriber")
        self._spin_until(lambda: self.goal_pub.get_subscription_count() > 0, "goal subscriber")
        # the first command answers the first observation: DDS keeps nothing for a reader that
        # matches late, so the node's commands must reach us before we send anything
        self._spin_until(lambda: self.cmd_sub.get_publisher_count() > 0, "commands publisher")
        for c in self.cameras:
            pub = self.n.create_publisher(Image, f"{self.ns}/camera/{c}/image_raw", 10)
            self._spin_until(lambda p=pub: p.get_subscription_count() > 0, f"camera {c} subscriber")
            self._img_pubs[c] = pub
        if self.cameras:
            self._spin_until(lambda: self.seen is not None, "~/camera_seen")
        # The counts above are this process's view: the node matches us on its own discovery,
        # and its command writer can match a moment later, on a busy machine after it answered
        # the first observation (that command was lost and the replay failed, "no answer").
        # Spin a second, which also lets the latched goal echo, if any, arrive first.
        end = time.monotonic() + 1.0
        while (left := end - time.monotonic()) > 0:
            self.ex.spin_once(timeout_sec=left)
        return joints, limit, fields

    def goal_dim(self) -> int:
        """The size of goal the node takes, from its /diagnostics (published about once a
        second): a goal of another size is refused there, with no ~/goal_applied echo to wait
        for, so the replay must leave it out as --offline does."""
        prefix, got = f"{self.node_name}:", []

        def on_diag(msg) -> None:
            for st in msg.status:
                if st.name.startswith(prefix):
                    kv = {v.key: v.value for v in st.values}
                    if "goal_dim" in kv:
                        got.append(int(kv["goal_dim"]))

        sub = self.n.create_subscription(DiagnosticArray, "/diagnostics", on_diag, 10)
        try:
            self._spin_until(lambda: bool(got), "/diagnostics with its goal_dim")
        finally:
            self.n.destroy_subscription(sub)
        return got[-1]

    def reset(self) -> str:
        """Put the node's live session back to its initial state (what the replay starts from,
        so that two replays are the same); its reply."""
        r = self._call(self.reset_cl, ResetSession.Request(session=""))
        if not r.success:
            raise NodeError(f"~/reset_session: {r.message}")
        return r.message

    def _publish_js(self, event: InputEvent) -> None:
        """With the bag's header stamp (its receive time when it had none): the node's flight
        recorder keeps it, so a dump of a replayed run points back into this bag."""
        msg = JointState(
            name=list(event.names),
            position=[float(x) for x in event.position],
            velocity=[float(x) for x in event.velocity],
            effort=[float(x) for x in event.effort],
        )
        _stamp(msg, event.header_ns or event.stamp_ns)
        self.js.publish(msg)

    def goal(self, data: np.ndarray) -> None:
        """Publish a goal and wait for its own echo: the node also echoes the goal a reset
        brought back, and that echo may arrive after the reset's reply."""
        n, sent = self.goal_echoes, [float(x) for x in data]
        self.goal_pub.publish(Float64MultiArray(data=sent))
        self._spin_until(lambda: self.goal_echoes > n and self.goal_echo == sent, "goal")

    def image(self, event: InputEvent) -> str:
        """Publish one image and wait until the node handled it; "" when it took it."""
        if event.camera not in self._img_pubs:
            raise NodeError(f"the node has no camera {event.camera!r} (cameras: {self.cameras})")
        i = 2 * self.cameras.index(event.camera)
        received, accepted = self.seen[i], self.seen[i + 1]
        f = event.image
        msg = Image(
            height=int(f.height),
            width=int(f.width),
            encoding=str(f.encoding),
            is_bigendian=int(f.is_bigendian),
            step=int(f.step),
        )
        _stamp(msg, f.header_ns or event.stamp_ns)
        msg.header.frame_id = f"{event.camera}_camera"
        msg.data = np.ascontiguousarray(f.data, dtype=np.uint8).tobytes()
        self._img_pubs[event.camera].publish(msg)
        self._spin_until(lambda: self.seen[i] > received, f"camera {event.camera} image")
        if self.seen[i + 1] > accepted:
            self._has_image.add(event.camera)
            return ""
        return f"camera {event.camera!r}: image refused by the node (see its log)"

    def observe(self, obs: np.ndarray, event: InputEvent) -> np.ndarray | None:
        if len(self._has_image) < len(self.cameras):
            # not sent: the node could still hold an image from before the replay, so it
            # might step on it where --offline cannot; both skip it instead
            return None
        n = len(self.commands)
        self._publish_js(event)
        self._spin_until(lambda: len(self.commands) > n, "command")
        return self.commands[n]

    def refused(self, event: InputEvent) -> None:
        """A sample the node would refuse: a joint_states is sent (the node refuses and counts
        it; no command comes), a goal is not (no echo would come to wait for)."""
        if event.kind == "joint_states":
            self._publish_js(event)

    def checkpoint(self) -> str:
        r = self._call(self.cp, Checkpoint.Request())
        if not r.success:
            raise NodeError(f"checkpoint failed: {r.message}")
        return r.capsule.id

    def restore(self, ref: str) -> None:
        r = self._call(self.rs, Restore.Request(capsule=ref, verify=True))
        if not r.success:
            raise NodeError(f"restore of {ref} failed: {r.message}")

    def rewind_images(self, images: list[InputEvent]) -> None:
        """After a restore: send again the images held at the checkpoint. A camera without one
        then counts as imageless here (the node keeps a newer frame, but nothing is sent until
        the camera's next image in the bag, as on the first pass)."""
        self._has_image = set()
        for ev in images:
            why = self.image(ev)
            if why:
                raise NodeError(f"an image the node took before was refused on its return: {why}")

    def close(self) -> None:
        self.ex.shutdown(timeout_sec=0)
        self.n.destroy_node()


def _stamp(msg, ns: int) -> None:
    """A message's header stamp from integer nanoseconds."""
    msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(ns, 10**9)
