"""Publishers a subscription of the node never hears, and why (the usual ROS pitfall: a driver
that publishes BEST_EFFORT, a subscription that asks for RELIABLE).

The node's subscriptions are polled (polled.py), so rclpy's incompatible-QoS events, which the
executor would run, never fire for them. Instead /diagnostics compares, once a second, the
publishers the ROS graph lists on each topic with what each subscription asks for.
"""

from __future__ import annotations

from rclpy.qos import QoSReliabilityPolicy


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
        topic = sub.topic_name
        for info in node.get_publishers_info_by_topic(topic):
            why = _why(sub.qos_profile, info.qos_profile)
            if why:
                who = f"{info.node_namespace.rstrip('/')}/{info.node_name}"
                lines.append(f"{topic}: {who} {why}")
    return lines
