"""flashrt_sim_arm: a simulated 6-joint arm as a ROS 2 node (for demos, fixtures and tests).

Publishes ``joint_states`` (sensor_msgs/JointState) at ``rate_hz`` and follows position targets
from ``commands`` (std_msgs/Float64MultiArray, one value per joint, as forward_command_controller
takes them). Until the first valid command it holds ``initial_positions``. With ``camera_names``
set it also publishes ``camera/<name>/image_raw`` (sensor_msgs/Image rgb8, flashrt_ros.sim.camera:
the arm and, once ``goal`` (std_msgs/Float64MultiArray) arrived, the goal as a ghost) at
``camera_rate_hz``, stamped with the time of the joint state it shows. The dynamics are
``flashrt_ros.sim.dynamics.ArmModel`` with dt = 1 / rate_hz, one step per timer tick.

Parameters: SIM_PARAMS below (joint_names, rate_hz, initial_positions, extra_joints, camera_*),
declared and checked by the same mechanism as the flashrt node's (flashrt_ros.node.params); a bad
one exits with status 2 naming it.
Topic names are relative, so namespaces and remapping work.
"""

from __future__ import annotations

import sys

import numpy as np
import rclpy
from rclpy.exceptions import ParameterException
from rclpy.executors import ExternalShutdownException
from rclpy.node import Node
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray

from flashrt_ros.node.params import DEFAULT_JOINTS, Param, ParamTable, wants_help
from flashrt_ros.sim.camera import ArmCamera
from flashrt_ros.sim.dynamics import ArmModel

__all__ = ["SimArmNode", "main"]


def _cross(v) -> list[str]:
    problems = []
    if v["initial_positions"] and len(v["initial_positions"]) != len(v["joint_names"]):
        problems.append(
            f"parameter initial_positions={list(v['initial_positions'])}; accepts "
            f"one per joint ({len(v['joint_names'])}) or an empty list (zeros)"
        )
    clash = sorted(set(v["extra_joints"]) & set(v["joint_names"]))
    if clash:
        problems.append(
            f"parameter extra_joints={list(v['extra_joints'])} ({clash} in joint_names too); "
            "accepts names not in joint_names"
        )
    return problems


SIM_PARAMS = ParamTable(
    [
        Param(
            "joint_names",
            DEFAULT_JOINTS,
            "string_array",
            "names of the simulated joints",
            unique=True,
            min_items=1,
        ),
        Param("rate_hz", 100.0, "double", "tick and simulation rate", lo=0.1, hi=10000.0),
        Param(
            "initial_positions",
            [],
            "double_array",
            "start positions, one per joint, within the joint limits ([] = zeros)",
        ),
        Param(
            "extra_joints",
            [],
            "string_array",
            "more joints published with position 0 and velocity 0 (to exercise filtering)",
            unique=True,
        ),
        Param(
            "camera_names",
            [],
            "string_array",
            "cameras published on camera/<name>/image_raw (rgb8 view of the arm and the goal; "
            "[] = none)",
            unique=True,
            pattern=r"[A-Za-z][A-Za-z0-9_]*",
            pattern_text="a letter, then letters, digits or _",
        ),
        Param("camera_rate_hz", 30.0, "double", "camera image rate", lo=0.1, hi=1000.0),
        Param("camera_height", 64, "integer", "camera image height in pixels", lo=8, hi=4096),
        Param("camera_width", 64, "integer", "camera image width in pixels", lo=8, hi=4096),
    ],
    "SimArmConfig",
    cross=_cross,
)


class SimArmNode(Node):
    """Plain rclpy node ``flashrt_sim_arm`` wrapping an ArmModel."""

    def __init__(self, **kwargs) -> None:
        super().__init__("flashrt_sim_arm", **kwargs)
        cfg = SIM_PARAMS.declare(self)
        self.joint_names = list(cfg.joint_names)
        n = len(self.joint_names)
        q0 = list(cfg.initial_positions) or [0.0] * n
        self.extra_joints = list(cfg.extra_joints)
        self.rate_hz = rate = cfg.rate_hz
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
        self._stamp = self.get_clock().now().to_msg()  # of the state the camera shows
        self._goal = None  # drawn as a ghost once a valid `goal` arrived
        self._goal_sub = self.create_subscription(Float64MultiArray, "goal", self._on_goal, 10)
        self.camera = ArmCamera(cfg.camera_height, cfg.camera_width, n)
        self.camera_names = list(cfg.camera_names)
        self._cam_pubs = [
            self.create_publisher(Image, f"camera/{c}/image_raw", 10) for c in cfg.camera_names
        ]
        if self._cam_pubs:
            self._cam_timer = self.create_timer(1.0 / cfg.camera_rate_hz, self._on_camera)
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

    def _on_goal(self, msg: Float64MultiArray) -> None:
        data = np.asarray(msg.data, dtype=np.float64)
        if data.shape != (len(self.joint_names),) or not np.all(np.isfinite(data)):
            self.get_logger().warning(
                f"ignoring goal ({data.size} values or NaN/Inf; expected "
                f"{len(self.joint_names)} finite)",
                throttle_duration_sec=2.0,
            )
            return
        self._goal = data

    def _on_camera(self) -> None:
        """One rgb8 image of the current state (stamped with that state's time) per camera."""
        img = self.camera.render(self.model.q, self._goal)
        msg = Image()
        msg.header.stamp = self._stamp
        msg.height, msg.width = img.shape[0], img.shape[1]
        msg.encoding = "rgb8"
        msg.is_bigendian = 0
        msg.step = 3 * img.shape[1]
        msg.data = img.tobytes()
        for name, pub in zip(self.camera_names, self._cam_pubs, strict=True):
            msg.header.frame_id = f"{name}_camera"
            pub.publish(msg)

    def _on_tick(self) -> None:
        self.model.step(self._target)
        msg = JointState()
        msg.header.stamp = self._stamp = self.get_clock().now().to_msg()
        msg.name = self._names_out
        msg.position = self.model.q.tolist() + self._zeros_extra
        msg.velocity = self.model.dq.tolist() + self._zeros_extra
        self._pub.publish(msg)


USAGE = """usage: flashrt_sim_arm [--help] [--ros-args -p NAME:=VALUE ...]

A simulated 6-joint arm for demos and tests: publishes joint_states (sensor_msgs/JointState) at
rate_hz, follows position targets on commands (std_msgs/Float64MultiArray, one per joint), and
with camera_names set publishes camera/<name>/image_raw (rgb8: the arm, and the goal received on
goal once one came). Topic names are relative: namespaces and remaps apply. Ctrl-C ends it.

Example, beside a flashrt node on the CPU (two shells, the same ROS_DOMAIN_ID):
  flashrt_sim_arm --ros-args -p rate_hz:=100.0
  flashrt_node --ros-args --params-file config/flashrt.yaml -p device:=cpu
"""


def usage() -> str:
    """The --help text, with every parameter from the parameter table."""
    return f"{USAGE}\nParameters:\n{SIM_PARAMS.help_text()}\n"


def main(args: list[str] | None = None) -> int:
    """Entry point: spin ``flashrt_sim_arm`` until Ctrl-C or SIGTERM; exits cleanly."""
    argv = list(sys.argv if args is None else args)
    if wants_help(argv):
        print(usage())
        return 0
    try:
        rclpy.init(args=args)
    except Exception as exc:  # noqa: BLE001 - rcl rejects bad --ros-args with an RCLError
        print(f"flashrt_sim_arm: error: {exc}", file=sys.stderr)
        return 2
    node = None
    try:
        try:
            node = SimArmNode()
        except RuntimeError as exc:  # rcl refuses the name or namespace a remap gives
            print(f"flashrt_sim_arm: error: {exc}", file=sys.stderr)
            return 2
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
