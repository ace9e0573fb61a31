"""flashrt_ros: a stateful robot policy served as a captured CUDA graph, with state capsules.

The core (runtime, capsules, policies) imports no ROS. The interfaces that rosidl generates
(flashrt_ros.msg, flashrt_ros.srv) live in the installed copy of this package; extending
``__path__`` lets a source checkout see them when the built workspace is on sys.path.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__all__ = ["Engine", "load_policy", "CapsuleInfo"]


def __getattr__(name: str):
    # Lazy: importing flashrt_ros.msg must not pull in torch.
    if name == "Engine":
        from flashrt_ros.runtime.engine import Engine

        return Engine
    if name == "load_policy":
        from flashrt_ros.policies.loader import load_policy

        return load_policy
    if name == "CapsuleInfo":
        from flashrt_ros.capsules.info import CapsuleInfo

        return CapsuleInfo
    raise AttributeError(name)
