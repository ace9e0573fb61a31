"""The timer-trigger control loop: a dedicated thread with absolute deadlines (no drift)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

# The last 200 us before a deadline are busy-waited: sleep() alone overshoots by ~60-100 us.
# The spin keeps the GIL (no sleep(0)): yielding it lets rclpy's executor thread take it, and
# getting it back can then take up to a whole switch interval, right at the deadline.
SPIN_S = 0.0002


class TimerLoop:
    """Calls `tick()` at `rate_hz`. Deadlines are absolute (start + k * period), so a late tick
    does not shift later ones; ticks missed entirely are counted as overruns and skipped."""

    def __init__(
        self, rate_hz: float, tick: Callable[[float], None], on_timing: Callable, on_error: Callable
    ):
        self.period = 1.0 / rate_hz
        self.tick = tick  # tick(deadline): the monotonic time this tick was due
        self.on_timing = on_timing  # (jitter_s, overruns) after each tick
        self.on_error = on_error  # an exception in a tick is reported, the loop goes on
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="flashrt-control", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        deadline = time.monotonic() + self.period
        while not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining > SPIN_S:
                if self._stop.wait(remaining - SPIN_S):
                    break
            while time.monotonic() < deadline:
                pass
            jitter = time.monotonic() - deadline
            try:
                self.tick(deadline)
            except Exception as e:
                self.on_error(e)
            deadline += self.period
            missed = 0
            now = time.monotonic()
            if now > deadline:  # the tick overran the next deadline: skip what is lost
                missed = int((now - deadline) / self.period) + 1
                deadline += missed * self.period
            self.on_timing(jitter, missed)
