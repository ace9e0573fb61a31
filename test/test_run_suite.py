"""`make test`'s runner (test/run_suite.py): the two runs never share a ROS domain, a part of the
suite runs in both, an empty selection is no failure, a broken one is."""

from __future__ import annotations

import os
import subprocess
import sys

from test import ros_helpers, run_suite
from test.ros_helpers import REPO_ROOT


def _band(monkeypatch, band: str, worker: str = "", count: int = 1) -> set[int]:
    monkeypatch.setenv("FLASHRT_TEST_DOMAINS", band)
    if worker:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    else:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    first, span = ros_helpers._domain_band()
    return set(range(first, first + span))


def test_the_runs_and_their_workers_take_domains_no_other_takes(monkeypatch):
    gw0 = _band(monkeypatch, run_suite.SHARED_DOMAINS, "gw0", 2)
    gw1 = _band(monkeypatch, run_suite.SHARED_DOMAINS, "gw1", 2)
    timed = _band(monkeypatch, run_suite.TIMED_DOMAINS)
    assert gw0 and gw1 and timed
    assert not (gw0 & gw1) and not (gw0 & timed) and not (gw1 & timed)
    assert min(gw0 | gw1 | timed) >= 101 and max(gw0 | gw1 | timed) <= 200  # the test domains
    # a fresh domain stays in the band, test after test
    assert _band(monkeypatch, run_suite.SHARED_DOMAINS, "gw1", 2) == gw1
    assert {ros_helpers.fresh_domain_id() for _ in range(60)} <= gw1


def _suite(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    # this suite's nodes are live: clearing /dev/shm now could take a starting node's files
    env[ros_helpers.SHM_CLEAN] = "0"
    return subprocess.run(
        [sys.executable, "test/run_suite.py", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_a_file_runs_in_both_runs_and_a_run_with_nothing_to_do_is_no_failure():
    r = _suite("-p", "no:cacheprovider", "test/test_throttle.py")
    # its tests are all shared: the timed run selects none (pytest's 5), which fails nothing
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "passed" in r.stdout and "timed run: exit 5" in r.stdout, r.stdout[-3000:]


def test_a_run_that_cannot_start_fails_the_suite():
    r = _suite("--no-such-pytest-option", "test/test_throttle.py")
    assert r.returncode not in (0, 5), r.stdout[-3000:]
