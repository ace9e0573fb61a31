"""The log throttle (node/logs.py Throttle): repeated events make one line per window, with a
count, and the newest event of a stream that stopped is still written."""

from __future__ import annotations

import threading
import time

from flashrt_ros.node.logs import Throttle


def test_a_goal_stream_that_stops_still_logs_its_last_goal():
    """Goal A was written, correction B a moment later was held back, then nothing: the log
    named A while the robot went to B, until the next goal minutes later carried B's count."""
    t = Throttle(0.2)
    assert t.due(line="goal A") == ""
    assert t.due(line="goal B") is None
    assert t.overdue() is None  # the window has not passed
    time.sleep(0.25)
    assert t.overdue() == "goal B (the last of 1 since the last line)"
    assert t.overdue() is None  # written once
    time.sleep(0.25)
    assert t.due(line="goal C") == ""  # nothing held back since: no count


def test_a_new_reason_is_written_at_once_without_the_old_reasons_count():
    t = Throttle(60.0)
    assert t.due("poisoned: nan") == ""
    assert t.due("poisoned: nan") is None
    assert t.due("poisoned: inf") == ""  # a new reason: at once, and not "(1 more ...)"
    assert t.due("poisoned: inf") is None
    t.reset()
    assert t.due("poisoned: inf") == ""


def test_events_from_many_threads_are_each_counted_once():
    t = Throttle(60.0)
    written: list[str] = []

    def events() -> None:
        for _ in range(2000):
            if (more := t.due(line="x")) is not None:
                written.append(more)

    threads = [threading.Thread(target=events) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert written == [""]  # one line for the first event, the rest held back
    t._last -= 61.0  # the window passed
    assert t.overdue() == "x (the last of 7999 since the last line)"
