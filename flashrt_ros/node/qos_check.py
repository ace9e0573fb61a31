"""The QoS of the node's input subscriptions: what a user may override, and the publishers a
subscription never hears, and why (the usual ROS pitfall: a driver that publishes BEST_EFFORT,
a subscription that asks for RELIABLE).

The inputs (joint_states, goal, the cameras) take ROS's standard QoS overrides, read-only
parameters named `qos_overrides.<topic>.subscription.<reliability|history|depth>` (for
example `qos_overrides./joint_states.subscription.reliability: best_effort`, to hear a driver
that publishes best effort in observation mode). An override that names no subscription of
the node is warned about at configure.

The node's subscriptions are polled (polled.py), so rclpy's incompatible-QoS events, which the
executor would run, never fire for them. Instead /diagnostics compares, once a second, the
publishers the ROS graph lists on each topic with what each subscription asks for.
"""

from __future__ import annotations

import fnmatch

from rclpy.qos import QoSProfile, QoSReliabilityPolicy
from rclpy.qos_overriding_options import QoSOverridingOptions

# reliability, history and depth of each input subscription, as parameters
QOS_OVERRIDES = QoSOverridingOptions.with_default_policies()
_QOS_FIELDS = (
    "history",
    "depth",
    "reliability",
    "durability",
    "lifespan",
    "deadline",
    "liveliness",
    "liveliness_lease_duration",
    "avoid_ros_namespace_conventions",
)


def input_qos(qos: QoSProfile | int) -> QoSProfile:
    """A profile of its own for a subscription that takes overrides: rclpy writes the
    overrides into the profile it is given (never into a shared one like sensor data's)."""
    if isinstance(qos, int):
        return QoSProfile(depth=qos)
    return QoSProfile(**{f: getattr(qos, f) for f in _QOS_FIELDS})  # (durations: no deepcopy)


def warn_unused_qos_overrides(node) -> None:
    """Warn about each `qos_overrides.*` parameter given to the node that names none of its
    subscriptions (a misspelt topic, a publisher): it would change nothing, silently."""
    given = getattr(node, "_parameter_overrides", {})  # what rcl parsed; no public accessor
    for name in sorted(n for n in given if fnmatch.fnmatch(n, "qos_overrides.*")):
        if not node.has_parameter(name):
            node.get_logger().warning(
                f"parameter {name!r} ignored: it names no input subscription of this node "
                "(qos_overrides.<topic>.subscription.<reliability|history|depth>, with the "
                "topic's full name, e.g. qos_overrides./joint_states.subscription.reliability)"
            )


def _why(want, offer) -> str:
    """Why a publisher offering `offer` does not match a subscription asking `want`, or "".
    Reliability only: the node's subscriptions are all volatile, which any durability meets."""
    if (
        want.reliability == QoSReliabilityPolicy.RELIABLE
        and offer.reliability == QoSReliabilityPolicy.BEST_EFFORT
    ):
        return "offers best_effort, the subscription needs reliable"
    return ""


def unmatched(node, subs) -> list[str]:
    """One line per publisher on a topic of `subs` that cannot match the subscription's QoS:
    "<topic>: <publisher node> offers ..., the subscription needs ..."."""
    lines = []
    for sub in subs:
        if sub.qos_profile.reliability != QoSReliabilityPolicy.RELIABLE:
            continue  # a best-effort subscription hears every publisher: no graph query
        topic = sub.topic_name
        for info in node.get_publishers_info_by_topic(topic):
            why = _why(sub.qos_profile, info.qos_profile)
            if why:
                who = f"{info.node_namespace.rstrip('/')}/{info.node_name}"
                lines.append(f"{topic}: {who} {why}")
    return lines
