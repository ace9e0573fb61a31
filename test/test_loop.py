"""The timer loop's thread: absolute deadlines, and precise sleeps (node/loop.py)."""

from __future__ import annotations

import ctypes
import sys
import time

import pytest

from flashrt_ros.node.loop import TimerLoop


def test_the_control_thread_sleeps_with_1ns_timer_slack_and_keeps_its_rate():
    """Linux adds the thread's timer slack (50 us by default) to every sleep; the control
    thread sets its own to 1 ns, so the busy-wait before each deadline can stay short."""
    seen: dict[str, object] = {}
    ticks: list[float] = []
    linux = sys.platform.startswith("linux")
    libc = ctypes.CDLL(None) if linux else None  # loaded here, not inside a tick

    def tick(deadline: float) -> None:
        if "slack" not in seen:  # PR_GET_TIMERSLACK (30) answers for the calling thread
            seen["slack"] = libc.prctl(30, 0, 0, 0, 0) if linux else None
        ticks.append(deadline)

    loop = TimerLoop(200.0, tick, on_timing=lambda *_: None, on_error=lambda e: seen.update(e=e))
    loop.start()
    time.sleep(0.3)
    loop.stop()
    assert "e" not in seen
    if not linux:  # pragma: no cover
        pytest.skip("no per-thread timer slack here")
    assert seen["slack"] == 1
    assert libc.prctl(30, 0, 0, 0, 0) > 1  # this thread's own was not changed
    # absolute deadlines: every tick is due a whole number of periods after the one before
    # (a tick that overran on a loaded machine skips the deadlines it missed, never drifts)
    gaps = [(b - a) / 0.005 for a, b in zip(ticks, ticks[1:], strict=False)]
    assert len(ticks) >= 10 and all(round(g) >= 1 and abs(g - round(g)) < 1e-6 for g in gaps)
