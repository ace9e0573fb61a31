"""PLACEHOLDER flashrt node (written by the build setup to prove the pipeline; replace me).

A plain rclpy node named `flashrt` offering `~/list_capsules` with empty lists.
"""

import sys

import rclpy
from rclpy.node import Node

from flashrt_ros.srv import ListCapsules


class _PlaceholderNode(Node):
    def __init__(self) -> None:
        super().__init__("flashrt")
        self.create_service(ListCapsules, "~/list_capsules", self._list_capsules)

    def _list_capsules(self, request, response):
        response.capsules = []
        response.sessions = []
        response.live_session = ""
        response.pool_bytes_used = 0
        response.pool_bytes_total = 0
        return response


def main(argv=None) -> int:
    rclpy.init(args=argv if argv is not None else sys.argv)
    node = _PlaceholderNode()
    try:
        rclpy.spin(node)
    except (KeyboardInterrupt, rclpy.executors.ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
