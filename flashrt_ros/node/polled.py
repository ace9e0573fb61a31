"""Subscriptions the control thread reads itself, outside rclpy's executor.

In timer mode joint_states is read at the top of each tick by the control thread. Handing it
to the executor instead costs the executor thread several hundred microseconds of Python per
message (rebuilding its wait set over every service, timer and subscription of the node), and
whenever the control thread wakes while that runs, it waits for the GIL: measured as up to
0.6 ms of period jitter at 500 Hz on the H200 machine. A message taken at the tick is at most
one period old, which is what `obs_timeout_s` is checked against.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

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


class Waiter:
    """A thread that waits on one polled subscription and hands each message to `callback`.

    The observation trigger's path: joint_states -> step -> publish without rclpy's executor.
    The thread's wait set holds the subscription and a stop guard only and is built once; the
    wait itself releases the GIL. Dispatching the same message through the node's
    SingleThreadedExecutor first rebuilds a wait set in Python over the node's ~40 entities
    (spin_once with nothing ready: 220 us on the 2-core CPU machine, 137 us for a bare node).
    Messages are handed over in arrival order, one at a time, on this one thread.
    """

    def __init__(
        self,
        sub,
        callback: Callable[[object], None],
        on_error: Callable[[Exception], None],
        context,
        name: str,
    ) -> None:
        """`on_error` gets what a callback raised; the thread goes on with the next message."""
        from rclpy.guard_condition import GuardCondition

        self.sub, self.callback, self.on_error, self.context = sub, callback, on_error, context
        self._stop = False
        self._gc = GuardCondition(None, None, context=context)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Waiter:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the thread (it finishes the message in hand first); idempotent."""
        self._stop = True
        with contextlib.suppress(Exception):
            self._gc.trigger()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with contextlib.suppress(Exception):
            self._gc.destroy()

    def _run(self) -> None:
        from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy

        sub, gc = self.sub, self._gc
        try:
            with sub.handle, gc.handle, self.context.handle:
                ws = _rclpy.WaitSet(1, 1, 0, 0, 0, 0, self.context.handle)
                while not self._stop:
                    ws.clear_entities()
                    ws.add_subscription(sub.handle)
                    ws.add_guard_condition(gc.handle)
                    ws.wait(-1)
                    while not self._stop and (got := take(sub)) is not None:
                        try:
                            self.callback(got[0])
                        except Exception as e:
                            self.on_error(e)
        except Exception:  # the context or the subscription went away: shutting down
            if not self._stop and self.context.ok():
                raise
