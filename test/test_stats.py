"""The loop statistics /diagnostics shows (node/stats.py): the same percentiles as numpy's,
computed off the lock the control thread takes after every tick."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from flashrt_ros.node.stats import LoopStats, Ring, percentiles


@pytest.mark.parametrize("n", [0, 1, 2, 3, 10, 2047, 2048])
def test_percentiles_equal_numpy_linear_percentiles(n):
    v = np.random.default_rng(n).exponential(100.0, n)
    qs = (0, 1, 50, 99, 99.9, 100)
    got = percentiles(v, qs)
    want = [float(np.percentile(v, q)) for q in qs] if n else [0.0] * len(qs)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert np.array_equal(v, np.random.default_rng(n).exponential(100.0, n))  # v untouched


def test_snapshot_reads_every_counter_and_reports_new_faults_once():
    st = LoopStats()
    for x in range(1, 101):
        st.step_us.add(float(x))
        st.jitter_us.add(float(x) / 10)
        st.tick_times.add(99.5)
    st.steps, st.overruns, st.refused = 100, 3, 7
    st.add_fault("boom")
    sn = st.snapshot(now=100.0)
    assert (sn["steps"], sn["overruns"], sn["refused"], sn["faults"]) == (100, 3, 7, 1)
    assert sn["step_p50_us"] == pytest.approx(50.5) and sn["step_p99_us"] == pytest.approx(99.01)
    assert sn["rate_hz"] == 50.0  # 100 ticks within the last 2 s
    assert sn["new_faults"] == 1 and st.snapshot(now=100.0)["new_faults"] == 0
    assert sn["service_p50_us"] == 0.0  # an empty ring


@pytest.mark.parametrize("hz", [100.0, 1000.0, 5000.0, 10000.0])
def test_rate_reads_the_rate_up_to_the_highest_rate_hz(hz):
    """rate_hz counted the ticks of the last 2 s in a ring of 8192: above 4096 Hz (rate_hz
    takes up to 10000) it read 4096."""
    st = LoopStats()
    for k in reversed(range(int(3 * hz))):  # 3 s of ticks in time order, the last at t = 100
        st.tick_times.add(100.0 - k / hz)
    assert st.snapshot(now=100.0)["rate_hz"] == pytest.approx(hz, rel=1e-2)


def test_the_lock_is_free_while_percentiles_are_computed(monkeypatch):
    """The control thread takes stats.lock after every tick: the snapshot must not hold it
    while it computes."""
    st = LoopStats()
    for x in range(2048):
        st.step_us.add(float(x))
    held = []
    import flashrt_ros.node.stats as stats

    real = stats.percentiles

    def spy(v, qs):
        free = st.lock.acquire(blocking=False)
        if free:
            st.lock.release()
        held.append(not free)
        return real(v, qs)

    monkeypatch.setattr(stats, "percentiles", spy)
    t = threading.Thread(target=st.snapshot, args=(0.0,))
    t.start()
    t.join()
    assert held and not any(held)
    assert Ring(4).pct(50) == 0.0
