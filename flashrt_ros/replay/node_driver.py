"""Lockstep replay into a running flashrt node over DDS: send one input, wait for its effect."""

from __future__ import annotations

import time

import numpy as np
import rclpy
from rcl_interfaces.srv import GetParameters
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import QoSDurabilityPolicy, QoSProfile
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray

from flashrt_ros.replay.bags import InputEvent
from flashrt_ros.srv import Checkpoint, Restore


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
        self.js = self.n.create_publisher(JointState, f"{ns}/joint_states", 100)
        self.goal_pub = self.n.create_publisher(Float64MultiArray, f"{ns}/goal", 10)
        self.n.create_subscription(
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
        self.params = self.n.create_client(GetParameters, f"{self.node_name}/get_parameters")

    def _on_echo(self, msg) -> None:
        self.goal_echoes += 1

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

    def connect(self) -> list[str]:
        """Check the node is there in observation mode; returns its joint_names."""
        resp = self._call(self.params, GetParameters.Request(names=["trigger", "joint_names"]))
        trigger, joints = resp.values[0].string_value, list(resp.values[1].string_array_value)
        if trigger != "observation":
            raise NodeError(
                f"{self.node_name} runs trigger:={trigger}; replay needs "
                "trigger:=observation (one step per joint_states message)"
            )
        self._spin_until(lambda: self.js.get_subscription_count() > 0, "joint_states subscriber")
        self._spin_until(lambda: self.goal_pub.get_subscription_count() > 0, "goal subscriber")
        self.ex.spin_once(timeout_sec=0.2)  # let the latched goal echo, if any, arrive first
        return joints

    def _publish_js(self, event: InputEvent) -> None:
        self.js.publish(
            JointState(
                name=list(event.names),
                position=[float(x) for x in event.position],
                velocity=[float(x) for x in event.velocity],
            )
        )

    def goal(self, data: np.ndarray) -> None:
        n = self.goal_echoes
        self.goal_pub.publish(Float64MultiArray(data=[float(x) for x in data]))
        self._spin_until(lambda: self.goal_echoes > n, "goal")

    def observe(self, obs: np.ndarray, event: InputEvent) -> np.ndarray:
        n = len(self.commands)
        self._publish_js(event)
        self._spin_until(lambda: len(self.commands) > n, "command")
        return self.commands[n]

    def refused(self, event: InputEvent) -> None:
        self._publish_js(event)  # the node refuses and counts it; no command comes

    def checkpoint(self) -> str:
        r = self._call(self.cp, Checkpoint.Request())
        if not r.success:
            raise NodeError(f"checkpoint failed: {r.message}")
        return r.capsule.id

    def restore(self, ref: str) -> None:
        r = self._call(self.rs, Restore.Request(capsule=ref, verify=True))
        if not r.success:
            raise NodeError(f"restore of {ref} failed: {r.message}")

    def close(self) -> None:
        self.ex.shutdown(timeout_sec=0)
        self.n.destroy_node()
