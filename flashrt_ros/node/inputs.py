"""The node's inputs (goal, camera images, joint_states), taken by a loop of their own.

rclpy's executor, woken by a message on the flashrt node, rebuilds its wait set in Python over
every service, timer and subscription of the node before it calls the callback: a few hundred
microseconds a message. Measured on the H200 machine in observation mode: observation to action
p50 434 us, against 207 us for a bare rclpy echo plus 130 us for the graph step. So the
subscriptions are in a polled.PolledGroup (the executor never waits on them) and `InputLoop`
takes their messages: a thread (`flashrt-inputs`) waiting on a wait set built once over them
(waitloop.WaitLoop, as the services' loop).

At each wake-up it goes in rounds: every queued message of the `drained` inputs (the goal, then
each camera), then `acknowledge` (the cameras' one acknowledgement of the images the round
took: cameras.py), then `after_drain` (the node's step_on check: a step once every listed input has
something new, so a backlog of frames steps once, on the newest of each), then one message of
the `stepping` input (joint_states in observation mode, where
each one is a step: taken one at a time, none dropped); again while a stepping message came. So
a goal or an image that arrived before an observation is applied before its step, as the
executor did (goal and images first when several wait). Each subscription's own callback is
called as `callback(message, age_s)` (polled.take: the age from the middleware's reception
stamp); one that raises is logged, and the loop goes on. `lock` is held while a wake-up's
messages are handled: a lifecycle transition holds it to change what the handlers see, between
two messages.

In observation mode the loop also answers the services (`host`: host.ServiceHost.borrowed(),
its guard conditions and services in this loop's wait set), between two observations: the
thread that steps is the one that serves, so neither waits for the other's GIL (host.py says
why). They are handled first at each wake-up, outside `lock`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence

from flashrt_ros.node.polled import take
from flashrt_ros.node.waitloop import WAKE_NS, WaitLoop


class InputLoop(WaitLoop):
    """Takes the messages of the subscriptions `drained` and `stepping`, each handed to the
    subscription's own callback as `callback(message, age_s)`."""

    thread_name = "flashrt-inputs"

    def __init__(
        self,
        context,
        log,
        drained: Sequence,
        stepping=None,
        host=None,
        after_drain: Callable[[], None] | None = None,
        acknowledge: Callable[[], None] | None = None,
        watch: Callable[[], float | None] | None = None,
    ) -> None:
        super().__init__(context, log)
        self.drained = list(drained)
        self.stepping = stepping
        self.after_drain = after_drain
        self.acknowledge = acknowledge
        # called before each wait: does what is due (the node's trajectory hold when the inputs
        # stopped) and says in how many seconds it wants to be called again (None: no hurry)
        self.watch = watch
        self.host = host  # a ServiceHost whose services this loop answers (observation mode)
        self._served: tuple[list, list] | None = None  # what it borrowed: guards, services
        self.lock = threading.Lock()

    def _wait_loop(self) -> None:
        with self.host.borrowed() if self.host is not None else contextlib.nullcontext() as got:
            self._served = got
            try:
                super()._wait_loop()
            finally:
                self._served = None

    def _wait_ns(self) -> int:
        if self.watch is None:
            return WAKE_NS
        try:
            left = self.watch()
        except Exception as e:  # as a handler that raises: logged, the loop goes on
            self.log.error(f"watch: {type(e).__name__}: {e}", throttle_duration_sec=1.0)
            return WAKE_NS
        return WAKE_NS if left is None else max(1, min(WAKE_NS, int(left * 1e9)))

    def _entities(self) -> tuple[list, list, list]:
        subs = [*self.drained, *([self.stepping] if self.stepping is not None else [])]
        guards, services = self._served or ([], [])
        return subs, guards, services

    def _on_skipped(self, ws) -> None:
        if self._served is not None:
            self.host._on_skipped(ws)

    def _on_ready(self, ws, stop=None) -> None:
        served = self._served is not None
        if served:  # the services first: each request between two steps
            self.host._on_ready(ws, stop)
        ready = ws.get_ready_entities("subscription")
        if not ready:  # the stop guard, or the once-a-second look at the context
            return
        with self.lock:
            first = True  # the first round skips what the wait did not find ready
            while not self._stop.is_set():
                for sub in self.drained:
                    if first and sub.handle.pointer not in ready:
                        continue
                    while (got := self._take(sub)) is not None:
                        self._call(sub, got)
                if self.acknowledge is not None:
                    self._hook(self.acknowledge, "acknowledging the inputs")
                if self.after_drain is not None:
                    self._hook(self.after_drain, "after the inputs")
                sub = self.stepping
                if sub is None or (first and sub.handle.pointer not in ready):
                    return
                got = self._take(sub)
                if got is None:
                    return
                self._call(sub, got)
                if served:  # back to the wait (ready at once): requests go between two steps
                    return
                first = False

    def _hook(self, hook: Callable[[], None], what: str) -> None:
        try:
            hook()
        except Exception as e:  # as a handler that raises: logged, the loop goes on
            if self.stopping():  # the context shut down under it (Ctrl-C): nothing wrong
                return
            self.log.error(f"{what}: {type(e).__name__}: {e}", throttle_duration_sec=1.0)

    def _take(self, sub) -> tuple[object, float] | None:
        """polled.take, or None when the take itself fails (a message that does not
        deserialize): logged, and the loop goes on, as the services' loop does."""
        try:
            return take(sub)
        except Exception as e:
            self.log.error(
                f"{sub.topic_name}: message not taken: {type(e).__name__}: {e}",
                throttle_duration_sec=1.0,
            )
            return None

    def _call(self, sub, got: tuple[object, float]) -> None:
        try:
            sub.callback(*got)
        except Exception as e:  # one bad message never ends the loop
            if self.stopping():  # a publish on the context Ctrl-C just shut down: no error
                return
            self.log.error(
                f"{sub.topic_name}: handler raised {type(e).__name__}: {e}",
                throttle_duration_sec=1.0,
            )
