"""Subscriptions the control thread reads itself, outside rclpy's executor.

In timer mode joint_states is read at the top of each tick by the control thread. Handing it
to the executor instead costs the executor thread several hundred microseconds of Python per
message (rebuilding its wait set over every service, timer and subscription of the node), and
whenever the control thread wakes while that runs, it waits for the GIL: measured as up to
0.6 ms of period jitter at 500 Hz on the H200 machine. A message taken at the tick is at most
one period old, which is what `obs_timeout_s` is checked against.
"""

from __future__ import annotations

from rclpy.callback_groups import CallbackGroup


class PolledGroup(CallbackGroup):
    """A callback group the executor never runs: rclpy leaves its entities out of the wait
    set, so their messages stay queued for `take`."""

    def can_execute(self, entity) -> bool:
        return False

    def beginning_execution(self, entity) -> bool:
        return False

    def ending_execution(self, entity) -> None:
        pass


def take(sub):
    """The next queued message of a subscription, or None; never blocks."""
    with sub.handle:
        got = sub.handle.take_message(sub.msg_type, sub.raw)
    return None if got is None else got[0]
