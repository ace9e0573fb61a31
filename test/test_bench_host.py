"""The bench's machine probes (bench/cpu_speed.py, bench/host_facts.py) that the GPU results
rest on: which CPU ran slow, which thread of the node was busy. Real processes and /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from bench.cpu_speed import probe
from bench.host_facts import ThreadSampler, thread_use, threads
from test.ros_helpers import REPO_ROOT

BUSY_CHILD = """
import threading, time
def nap():
    while True:
        time.sleep(0.002)
threading.Thread(target=nap, name="napper", daemon=True).start()
print("up", flush=True)
while True:
    pass
"""


def test_cpu_speed_rates_every_allowed_cpu() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    out = probe(cpus, rounds=3, n=2000)
    assert sorted(out["cpus"]) == cpus
    for row in out["cpus"].values():
        assert 0 < row["best_us"] <= row["median_us"]
        assert 0 <= row["steal_pct"] <= 100
    assert out["fastest"] in cpus and out["slowest"] in cpus
    assert out["slowest_over_fastest"] >= 1.0
    assert os.sched_getaffinity(0) == set(cpus)  # the caller's mask is given back


def test_cpu_speed_refuses_a_cpu_it_may_not_use(tmp_path) -> None:
    bad = max(os.sched_getaffinity(0)) + 1
    out = tmp_path / "speed.json"
    r = subprocess.run(
        [sys.executable, "bench/cpu_speed.py", "--cpus", str(bad), "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and f"CPUs [{bad}] are not allowed" in r.stderr
    assert not out.exists()
    ok = subprocess.run(
        [sys.executable, "bench/cpu_speed.py", "--rounds", "2", "--work", "500", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert set(json.loads(out.read_text())["cpus"]) == {str(c) for c in os.sched_getaffinity(0)}


def test_thread_sampler_finds_the_busy_thread_of_another_process() -> None:
    p = subprocess.Popen([sys.executable, "-c", BUSY_CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        before, t0 = threads(p.pid), time.monotonic()
        with ThreadSampler(p.pid, period=0.01) as s:
            time.sleep(0.6)
        rows = thread_use(before, threads(p.pid), time.monotonic() - t0)
    finally:
        p.kill()
        p.wait(timeout=10)
    assert len(s.samples) >= 20
    assert rows[0]["tid"] == p.pid and rows[0]["cpu_pct"] > 50  # the main thread spins
    shared = s.core_sharing()
    # the napping thread (it ran: schedstat counts its microseconds) is rated against the
    # spinning one, as a percentage of the samples; the busiest itself is not
    assert len(shared) == 1 and not any(k.endswith(f"/{p.pid}") for k in shared), shared
    assert 0.0 <= next(iter(shared.values())) <= 100.0
