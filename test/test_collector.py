"""node/collector.py: the collector's passes run in the control thread's slack (gc_in_slack),
and only where the slack holds them."""

from __future__ import annotations

import gc
import time

import pytest

from flashrt_ros.node.collector import SlackCollector


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.collect()  # counts from zero
    yield
    gc.set_threshold(*saved)


def _allocate(n: int) -> list:
    return [[i] for i in range(n)]  # container objects: each one counts for the collector


def test_a_young_pass_runs_in_the_slack_once_half_due(thresholds) -> None:
    gc.set_threshold(10_000, 10, 10)
    s = SlackCollector()
    assert s.due() is None  # nothing near
    s.idle(time.monotonic() + 1.0)
    assert s.passes == [0, 0, 0]
    keep = _allocate(6_000)  # past half the threshold, short of it: no automatic pass yet
    assert s.due() == 0
    s.idle(time.monotonic() + 1.0)
    assert s.passes == [1, 0, 0] and gc.get_count()[0] < 100
    del keep


def test_no_pass_when_the_next_tick_is_too_near(thresholds) -> None:
    gc.set_threshold(10_000, 10, 10)
    s = SlackCollector()
    keep = _allocate(6_000)
    s.idle(time.monotonic() + s.cost[0] / 2)  # less than its cost: left to the collector
    assert s.passes == [0, 0, 0] and gc.get_count()[0] >= 5_000
    del keep


def test_the_pass_has_the_generation_the_automatic_one_would(thresholds) -> None:
    """With thresholds (t0, 2, 2): three young passes, then one of generation 1; after three
    of those, a full one (CPython's order, its rule of pending survivors aside)."""
    gc.set_threshold(1_000, 2, 2)
    s = SlackCollector()
    kept, gens = [], []
    for _ in range(16):
        kept.append(_allocate(600))
        before = list(s.passes)
        s.idle(time.monotonic() + 1.0)
        gens.append(next(g for g in range(3) if s.passes[g] > before[g]))
    assert gens == [0, 0, 0, 1] * 3 + [0, 0, 0, 2], gens
    del kept
