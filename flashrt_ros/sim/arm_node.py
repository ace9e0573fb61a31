"""flashrt_sim_arm: a simulated 6-joint arm as a ROS 2 node (for demos, fixtures and tests).

Publishes ``joint_states`` (sensor_msgs/JointState) at ``rate_hz`` and follows position targets
from ``commands`` (std_msgs/Float64MultiArray, one value per joint, as forward_command_controller
takes them). Until the first valid command it holds ``initial_positions``. The dynamics are
``flashrt_ros.sim.dynamics.ArmModel`` with dt = 1 / rate_hz, one step per timer tick.

Parameters: joint_names (joint1..joint6), rate_hz (100.0), initial_positions (zeros),
extra_joints ([]: more joints published with position 0 and velocity 0, to exercise filtering).
Topic names are relative, so namespaces and remapping work.
"""

from __future__ import annotations

import array
import math
import sys

import numpy as np
import rclpy
from rcl_interfaces.msg import ParameterDescriptor
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException
from rclpy.node import Node
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray

from flashrt_ros.sim.dynamics import ArmModel

__all__ = ["SimArmNode", "main"]

DEFAULT_JOINTS = [f"joint{i}" for i in range(1, 7)]


class SimArmNode(Node):
    """Plain rclpy node ``flashrt_sim_arm`` wrapping an ArmModel."""

    def __init__(self, **kwargs) -> None:
        super().__init__("flashrt_sim_arm", **kwargs)
        dyn = dict(dynamic_typing=True)  # accept ints where floats are meant, and unset arrays
        self.declare_parameter(
            "joint_names",
            list(DEFAULT_JOINTS),
            ParameterDescriptor(description="names of the simulated joints"),
        )
        self.declare_parameter(
            "rate_hz", 100.0, ParameterDescriptor(description="tick and sim rate", **dyn)
        )
        self.declare_parameter(
            "initial_positions",
            None,
            ParameterDescriptor(description="start positions (default zeros)", **dyn),
        )
        self.declare_parameter(
            "extra_joints",
            None,
            ParameterDescriptor(description="extra joints published with 0", **dyn),
        )

        self.joint_names = [str(n) for n in self.get_parameter("joint_names").value]
        n = len(self.joint_names)
        if n == 0 or len(set(self.joint_names)) != n:
            raise ValueError(f"joint_names must be non-empty and unique, got {self.joint_names}")
        rate = self.get_parameter("rate_hz").value
        if (
            isinstance(rate, bool)
            or not isinstance(rate, (int, float))
            or not (math.isfinite(rate) and rate > 0)
        ):
            raise ValueError(f"rate_hz must be positive, got {rate}")
        q0 = self.get_parameter("initial_positions").value
        if q0 is None or (isinstance(q0, (list, tuple, array.array)) and len(q0) == 0):
            q0 = [0.0] * n
        elif not isinstance(q0, (list, tuple, array.array)) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in q0
        ):
            raise ValueError(f"initial_positions must be a list of numbers, got {q0!r}")
        q0 = [float(x) for x in q0]
        if len(q0) != n:
            raise ValueError(
                f"initial_positions has {len(q0)} values, expected {n} (one per joint)"
            )
        extra = self.get_parameter("extra_joints").value
        if extra is not None and (
            not isinstance(extra, (list, tuple)) or not all(isinstance(x, str) for x in extra)
        ):
            raise ValueError(f"extra_joints must be a list of strings, got {extra!r}")
        self.extra_joints = list(extra or [])
        clash = set(self.extra_joints) & set(self.joint_names)
        if clash or len(set(self.extra_joints)) != len(self.extra_joints):
            raise ValueError(
                f"extra_joints must be unique and distinct from joint_names: {sorted(clash)}"
            )

        self.rate_hz = rate = float(rate)
        self.model = ArmModel(n_joints=n, dt=1.0 / rate)
        self.model.reset(np.asarray(q0, dtype=np.float64))  # ValueError outside the limits
        self._target = self.model.q
        self.commands_received = 0
        self.commands_refused = 0

        self._names_out = self.joint_names + self.extra_joints
        self._zeros_extra = [0.0] * len(self.extra_joints)
        self._pub = self.create_publisher(JointState, "joint_states", 10)
        self._sub = self.create_subscription(Float64MultiArray, "commands", self._on_command, 10)
        self._timer = self.create_timer(1.0 / rate, self._on_tick)
        self.get_logger().info(
            f"simulated arm: {n} joints {self.joint_names} at {rate:g} Hz"
            + (f", extra joints {self.extra_joints}" if self.extra_joints else "")
        )

    def _on_command(self, msg: Float64MultiArray) -> None:
        data = np.asarray(msg.data, dtype=np.float64)
        n = len(self.joint_names)
        if data.shape != (n,) or not np.all(np.isfinite(data)):
            self.commands_refused += 1
            reason = f"{data.size} values, expected {n}" if data.shape != (n,) else "NaN or Inf"
            self.get_logger().warning(
                f"ignoring command ({reason}); {self.commands_refused} refused so far",
                throttle_duration_sec=2.0,
            )
            return
        self._target = data
        self.commands_received += 1

    def _on_tick(self) -> None:
        self.model.step(self._target)
        msg = JointState()
        msg.header.stamp = self.get_clock().now().to_msg()
        msg.name = self._names_out
        msg.position = self.model.q.tolist() + self._zeros_extra
        msg.velocity = self.model.dq.tolist() + self._zeros_extra
        self._pub.publish(msg)


def main(args: list[str] | None = None) -> int:
    """Entry point: spin ``flashrt_sim_arm`` until Ctrl-C or SIGTERM; exits cleanly."""
    try:
        rclpy.init(args=args)
    except Exception as exc:  # noqa: BLE001 - rcl rejects bad --ros-args with an RCLError
        print(f"flashrt_sim_arm: error: {exc}", file=sys.stderr)
        return 2
    node = None
    try:
        node = SimArmNode()
        rclpy.spin(node)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except (ValueError, ParameterException) as exc:
        print(f"flashrt_sim_arm: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError:
        # rclpy can raise from take_message when SIGINT shuts the context down mid-callback
        if rclpy.ok():
            raise
    finally:
        if node is not None:
            node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
