"""flashrt_node: `ros2 run flashrt_ros flashrt_node [--ros-args ...]`."""

from __future__ import annotations

import sys

import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import TransitionCallbackReturn

USAGE = """usage: flashrt_node [--ros-args -p NAME:=VALUE ... | --params-file FILE]

Serves a stateful robot policy as a captured CUDA graph (ROS 2 LifecycleNode 'flashrt').
Subscribes joint_states and goal, publishes commands / joint_trajectory and /diagnostics, and
offers ~/checkpoint ~/restore ~/branch ~/list_capsules ~/drop_capsule ~/rollout.
Parameters (defaults in config/flashrt.yaml):
"""


def main(args: list[str] | None = None) -> int:
    argv = sys.argv if args is None else args
    if any(a in ("-h", "--help") for a in argv[1:]) and "--ros-args" not in argv:
        from flashrt_ros.node.params import PARAMETERS

        print(USAGE + "\n".join(f"  {k:<20} {d!r:<18} {t}" for k, (d, t) in PARAMETERS.items()))
        return 0
    from flashrt_ros.node.flashrt_node import FlashrtNode

    # The control thread must get the GIL back promptly after the executor thread ran Python.
    sys.setswitchinterval(0.0005)
    rclpy.init(args=argv)
    node = FlashrtNode()
    # One executor thread: joint_states, goal and service callbacks run in arrival order, each
    # a commit boundary (Python's MultiThreadedExecutor measured 25x slower round trips here).
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    rc = 0
    try:
        if node.get_parameter("autostart").value:
            if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
                node.get_logger().fatal("autostart: configure failed (see above); exiting")
                return 2
            node.trigger_activate()
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        if node.active and node._loop is not None:
            node._loop.stop()
        executor.shutdown(timeout_sec=1.0)
        node.capsule_services.close()
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return rc


if __name__ == "__main__":
    sys.exit(main())
