"""Message conversions (node/convert.py): times are normalized, never nanosec >= 1e9."""

from __future__ import annotations

import numpy as np
import pytest
from builtin_interfaces.msg import Time

from flashrt_ros.node.convert import stamp_to_time, trajectory_msg


@pytest.mark.parametrize("rate_hz", [49.0, 30.0, 100.0, 333.0, 1000.0])
def test_trajectory_times_are_normalized_and_exact(rate_hz):
    """(k+1)/rate rounds to a whole second for some k and rates (point 48 at 49 Hz gave
    sec=0, nanosec=1000000000): such a time carries into sec."""
    chunk = np.zeros((600, 6))
    msg = trajectory_msg(chunk, [f"j{i}" for i in range(6)], 1.0 / rate_hz, Time())
    for k, p in enumerate(msg.points):
        d = p.time_from_start
        assert 0 <= d.nanosec < 1_000_000_000, (k, d)
        assert abs(d.sec * 1_000_000_000 + d.nanosec - (k + 1) / rate_hz * 1e9) <= 1.0, (k, d)


def test_stamps_are_normalized_and_keep_their_fraction():
    t = stamp_to_time(1.9999999999)  # rounds up to a whole second: carried, not wrapped to 1.0
    assert (t.sec, t.nanosec) == (2, 0)
    t = stamp_to_time(1_796_000_000.123456)  # a wall-clock stamp keeps its microseconds
    assert t.sec == 1_796_000_000 and abs(t.nanosec - 123_456_000) < 500
