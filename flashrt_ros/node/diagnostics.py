"""When /diagnostics is published, and by which thread.

Building and publishing the node's DiagnosticArray costs tens of microseconds of Python (more
on a slow machine), all under the GIL. Published by a 1 Hz timer of rclpy's executor, it ran
whenever that timer fired, also just before a control tick, which then waited for the GIL: at
1 kHz on the H200 machine ~1 overrun a second (69 in 60 s), and on the 2-core CPU half of the
1 Hz publishes came within 3 ms before an overrun. So while the timer loop runs, the control
thread publishes them itself, right after a tick, when the next deadline is further away than
the publish takes (the median cost of the last few, plus a margin); if no such slack comes for
FORCE_S, it publishes anyway, so diagnostics never stop, and once the loop has skipped periods
since the last publish it publishes at once (an overloaded loop has no slack to wait for, and
its ticks are late anyway). In every other state (inactive,
observation trigger, unconfigured) the executor's timer publishes them, as before.

While the loop publishes, the executor's timer is cancelled: each wake-up of rclpy's executor
holds the GIL for a few hundred microseconds (it rebuilds its wait set over the whole node),
and at 1 kHz a wake-up every 4 s (the backup it was) still came before some of the 25-32
overruns a minute on the H200 machine. A watchdog thread of our own (`flashrt-diag-watch`)
steps in instead: at once (within WATCH_S) when a tick has held the engine for over STUCK_S
with no publish for EVERY_S (a step stuck on a hung device: an operator's monitor must see
`engine busy`, not silence, and it did for up to 8 s), and otherwise if the control thread has
not published for FORCE_S + a second. A few clock reads a second, so diagnostics never stop
either way. It looks on a fixed grid, so a stuck tick is reported every EVERY_S, and such a
report does not wait for the engine the tick holds. Its publishes are not counted as the cost
of a publish: that cost sets the slack the loop waits for, and counted it kept the loop from
publishing for seconds after a stall.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from diagnostic_msgs.msg import DiagnosticArray

from flashrt_ros.node.loop import EngineLock, name_os_thread


class Diagnostics:
    """Paces the publishes of `build()` (the node's DiagnosticArray) on /diagnostics."""

    EVERY_S = 1.0  # one publish a second
    FORCE_S = 3.0  # the control thread publishes without slack after this long
    MARGIN_S = EngineLock.MARGIN_S  # besides the publish's cost: the loop's spin before a deadline
    WATCH_S = 0.5  # how often the watchdog looks
    STUCK_S = 0.25  # a tick holding the engine this long is stuck (build() reports it busy)

    def __init__(
        self, node, build: Callable[..., DiagnosticArray], lock: EngineLock, group=None
    ) -> None:
        self.pub = node.create_publisher(DiagnosticArray, "/diagnostics", 10)
        # The executor's timer, cancelled while the control thread publishes (see above)
        self.timer = node.create_timer(self.EVERY_S, self.on_timer, callback_group=group)
        self.build = build
        self.lock = lock  # the engine lock, which build() takes too
        self.log = node.get_logger()
        self.last = -1e9  # monotonic time of the last publish (by either thread)
        # seconds a publish takes: the median of the last few, so that one publish stretched by
        # preemption on a loaded machine does not keep the next ones from finding room
        self.costs = deque([0.0003], maxlen=5)
        self.cost = 0.0003
        # the loop skipped periods since the last publish (set by the node): its ticks are
        # late anyway, so the next publish waits for no slack (at FORCE_S /diagnostics would
        # come every 3 s from a loop that never has room, just when it matters)
        self.behind = False
        self._by_loop = False
        self._watch_stop: threading.Event | None = None  # the watchdog's, while by_loop

    @property
    def by_loop(self) -> bool:
        """Whether the control thread publishes (set while the timer loop runs)."""
        return self._by_loop

    @by_loop.setter
    def by_loop(self, on: bool) -> None:
        on = bool(on)
        if on == self._by_loop:
            return
        self._by_loop = on
        if on:
            self.timer.cancel()
            self._watch_stop = stop = threading.Event()
            threading.Thread(
                target=self._watch, args=(stop,), name="flashrt-diag-watch", daemon=True
            ).start()
        else:
            if self._watch_stop is not None:
                self._watch_stop.set()
                self._watch_stop = None
            self.timer.reset()

    def _watch(self, stop: threading.Event) -> None:
        """While the control thread publishes: step in when it has not for a while."""
        name_os_thread()
        force = self.FORCE_S + self.EVERY_S
        # looks on a fixed grid, not WATCH_S after its last publish, and takes a publish of
        # its own at most a look's slack early: a stuck tick is reported every EVERY_S (with
        # a 0.25 s wait for the engine in each report, the looks made it every 1.25 s)
        due_slack = self.WATCH_S / 4
        next_look = time.monotonic() + self.WATCH_S
        while not stop.wait(max(next_look - time.monotonic(), 0.0)):
            now = time.monotonic()
            next_look += self.WATCH_S * max(1, int((now - next_look) / self.WATCH_S) + 1)
            since = now - self.last
            lock = self.lock
            stuck = lock.locked() and now - lock.held_since > self.STUCK_S
            if since >= force or (stuck and since >= self.EVERY_S - due_slack):
                try:
                    # stuck: the report says so at once (no wait for the engine it holds)
                    self.publish(count=False, engine_wait_s=0.0 if stuck else None)
                except Exception as e:  # the context is going away: the loop stops too
                    if not stop.is_set():
                        self.log.error(f"diagnostics publish failed: {type(e).__name__}: {e}")

    def publish(self, count: bool = True, engine_wait_s: float | None = None) -> None:
        """Publish now; `count`: its time goes into the cost the loop's slack must hold;
        `engine_wait_s`: how long build() may wait for the engine (None: its own default)."""
        t0 = time.monotonic()
        self.last, self.behind = t0, False
        if engine_wait_s is None:
            self.pub.publish(self.build())
        else:
            self.pub.publish(self.build(engine_wait_s=engine_wait_s))
        if count:
            self.costs.append(time.monotonic() - t0)
            self.cost = sorted(self.costs)[len(self.costs) // 2]

    def on_timer(self) -> None:
        """The executor's 1 Hz timer (cancelled while the control thread publishes)."""
        if not self.by_loop:
            self.publish()

    def idle(self, deadline: float) -> None:
        """TimerLoop's idle hook (control thread, after a tick, `deadline` the next tick's):
        publish when due and the slack before `deadline` holds the publish."""
        now = time.monotonic()
        since = now - self.last
        if since < self.EVERY_S:
            return
        no_room = not self.behind and deadline - now < self.cost + self.MARGIN_S
        if since < self.FORCE_S and (
            no_room or self.lock.locked()
        ):  # no room before the next tick, or a rollout step holds the lock: a later tick
            return
        try:
            self.publish()
        except Exception as e:  # a diagnostics failure is no control fault: log it, go on
            self.log.error(f"diagnostics publish failed: {type(e).__name__}: {e}")
