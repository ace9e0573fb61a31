"""Subscriptions read outside rclpy's executor: every subscription of the flashrt node.

Handing a message to the executor costs its thread several hundred microseconds of Python
(rebuilding its wait set over every service, timer and subscription of the node), all under
the GIL. So the executor never sees the node's subscriptions (they are in a `PolledGroup`) and
their messages are taken with `take`: in timer mode joint_states and the images by the control
thread at the top of each tick (with them on the executor, whenever the control thread woke
while it ran it waited for the GIL: measured as up to 0.6 ms of period jitter at 500 Hz on the
H200 machine; a message taken at the tick is at most one period old, which is what
`obs_timeout_s` is checked against), and everything else (the goal; in observation mode also
joint_states and the images) by the inputs' loop (inputs.py), which waits on them itself.
"""

from __future__ import annotations

import time

from rclpy.callback_groups import CallbackGroup


class PolledGroup(CallbackGroup):
    """A callback group the executor never runs: rclpy leaves its entities out of the wait
    set, so their messages stay queued for `take` (their callbacks are never called)."""

    def can_execute(self, entity) -> bool:
        return False

    def beginning_execution(self, entity) -> bool:
        return False

    def ending_execution(self, entity) -> None:
        pass


def take(sub) -> tuple[object, float] | None:
    """(message, age in seconds) of the next queued message of a subscription, or None; never
    blocks. The age comes from the middleware's reception stamp, so a message that waited in
    the queue (while the node was inactive, or behind a long request) is seen as old."""
    with sub.handle:
        got = sub.handle.take_message(sub.msg_type, sub.raw)
    if got is None:
        return None
    msg, info = got
    rx = info.get("received_timestamp", 0) if isinstance(info, dict) else 0
    age = max(0.0, (time.time_ns() - rx) * 1e-9) if rx else 0.0
    return msg, age
