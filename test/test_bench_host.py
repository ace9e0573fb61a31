"""The bench's machine probes (bench/cpu_speed.py, bench/host_facts.py) that the GPU results
rest on: which CPU ran slow, which thread of the node was busy. Real processes and /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.cpu_speed import probe
from bench.host_facts import ThreadSampler, core_of, thread_use, threads
from test.ros_helpers import REPO_ROOT

# a spinning main thread on CPU argv[1] and a thread napping every 2 ms on CPU argv[2]
BUSY_CHILD = """
import os, sys, threading, time
spin_cpu, nap_cpu = int(sys.argv[1]), int(sys.argv[2])
def nap():
    os.sched_setaffinity(0, {nap_cpu})  # 0: the calling thread
    while True:
        time.sleep(0.002)
threading.Thread(target=nap, daemon=True).start()
os.sched_setaffinity(0, {spin_cpu})
print("up", flush=True)
while True:
    pass
"""
HAVE_SCHEDSTAT = Path("/proc/self/schedstat").exists()


def test_cpu_speed_rates_every_allowed_cpu() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    out = probe(cpus, rounds=3, n=2000)
    assert sorted(out["cpus"]) == cpus
    for row in out["cpus"].values():
        assert 0 < row["best_us"] <= row["median_us"]
        assert 0 <= row["steal_pct"] <= 100
    fast, slow = out["cpus"][out["fastest"]], out["cpus"][out["slowest"]]
    assert fast["median_us"] <= slow["median_us"]
    assert out["slowest_over_fastest"] == round(slow["median_us"] / fast["median_us"], 3)
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


def _gate(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "gate.json"
    r = subprocess.run(
        [sys.executable, "bench/host_gate.py", "--loop-n", "2000", "--sleeps", "20"]
        + [*args, "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return r, out


def test_host_gate_stops_on_a_slow_host_and_passes_a_fast_one(tmp_path) -> None:
    slow, out = _gate(tmp_path, "--max-loop-s", "1e-9")  # no loop is that fast
    assert slow.returncode == 3 and "slow host" in slow.stderr
    r = json.loads(out.read_text())
    assert r["slow"] is True and r["loop_s"] > 0 and r["max_loop_s"] == 1e-9
    # every CPU this process may use was timed, the gate's figure their median
    assert r["cpus"] == len(os.sched_getaffinity(0))
    assert r["loop_s_fastest_cpu"] <= r["loop_s"] <= r["loop_s_slowest_cpu"]
    assert r["slowest_cpu"] in os.sched_getaffinity(0)
    assert r["sleep_1ms_late_us"]["p50"] <= r["sleep_1ms_late_us"]["max"]
    fast, out = _gate(tmp_path, "--max-loop-s", "1000")
    assert fast.returncode == 0, fast.stderr
    assert json.loads(out.read_text())["slow"] is False
    report, out = _gate(tmp_path)  # no bound: a report, never a stop
    assert report.returncode == 0 and json.loads(out.read_text())["max_loop_s"] is None
    bad, out2 = _gate(tmp_path / "x", "--max-loop-s", "-1")
    assert bad.returncode == 2 and "--max-loop-s and --max-sleep-p99-us must be >= 0" in bad.stderr
    assert not out2.exists()


def test_host_gate_stops_on_late_wake_ups(tmp_path) -> None:
    """--max-sleep-p99-us: a host whose 1 ms sleeps wake late is stopped even when its loop is
    fast; the cross-process ping-pong is measured beside it."""
    late, out = _gate(tmp_path, "--max-loop-s", "1000", "--max-sleep-p99-us", "1e-6")
    assert late.returncode == 3 and "a 1 ms sleep woke" in late.stderr, late.stderr
    r = json.loads(out.read_text())
    assert r["slow"] is True and r["max_sleep_p99_us"] == 1e-6
    pong = r["pingpong_rtt_us"]
    assert 0 < pong["p50"] <= pong["p99"] <= pong["max"]
    ok, out = _gate(tmp_path, "--max-sleep-p99-us", "1e9")
    assert ok.returncode == 0, ok.stderr
    assert json.loads(out.read_text())["slow"] is False


def test_ros_gpu_gate_stops_the_call_before_its_setup(tmp_path) -> None:
    """GATE_LOOP_S: a slow host ends bench/ros_gpu.sh with 3 before the venv or the build is
    touched; a fast one goes on (here to the missing wheels, so nothing is installed)."""
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS": str(tmp_path / "no_wheels")}

    def gpu(bound: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "bench/ros_gpu.sh", str(tmp_path / "out")],
            cwd=REPO_ROOT,
            env={**env, "GATE_LOOP_S": bound},
            capture_output=True,
            text=True,
            timeout=120,
        )

    slow = gpu("1e-9")
    assert slow.returncode == 3, slow.stdout + slow.stderr
    assert "slow host (GATE_LOOP_S=1e-9 GATE_SLEEP_P99_US=): not run" in slow.stdout
    assert json.loads((tmp_path / "out" / "host_gate.json").read_text())["slow"] is True
    fast = gpu("1000")
    assert fast.returncode == 1 and "no wheels in" in fast.stderr, fast.stdout + fast.stderr
    assert '"slow":false' in fast.stdout


def _sample(spin_cpu: int, nap_cpu: int) -> tuple[int, ThreadSampler, list[dict]]:
    p = subprocess.Popen(
        [sys.executable, "-c", BUSY_CHILD, str(spin_cpu), str(nap_cpu)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout.readline().strip() == "up"
        before, t0 = threads(p.pid), time.monotonic()
        with ThreadSampler(p.pid, period=0.01) as s:
            time.sleep(0.6)
        rows = thread_use(before, threads(p.pid), time.monotonic() - t0)
    finally:
        p.kill()
        p.wait(timeout=10)
    return p.pid, s, rows


@pytest.mark.exclusive
@pytest.mark.skipif(not HAVE_SCHEDSTAT, reason="needs /proc/<pid>/schedstat (ns CPU time)")
def test_thread_sampler_sees_a_thread_on_the_busy_threads_cpu() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    pid, s, rows = _sample(cpus[0], cpus[0])
    assert len(s.samples) >= 20  # sampled from its own process, every 10 ms
    assert rows[0]["tid"] == pid and rows[0]["last_cpu"] == cpus[0]  # the spinner is busiest
    shared = s.core_sharing()
    assert list(shared.values()) == [100.0], shared  # the napper, always on the same CPU


@pytest.mark.skipif(not HAVE_SCHEDSTAT, reason="needs /proc/<pid>/schedstat (ns CPU time)")
def test_thread_sampler_sees_a_thread_on_a_core_of_its_own() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    other = next((c for c in cpus[1:] if core_of(c) != core_of(cpus[0])), None)
    if other is None:
        pytest.skip("needs two CPUs on different cores")
    pid, s, rows = _sample(cpus[0], other)
    shared = s.core_sharing()
    assert list(shared.values()) == [0.0], shared
    assert not any(k.endswith(f"/{pid}") for k in shared)  # the busiest is not rated


def test_net_shm_load_sees_dropped_datagrams_and_fast_dds_files(tmp_path) -> None:
    """What ros_bench records around each scenario: a datagram dropped for a full receive
    buffer shows in RcvbufErrors, and only Fast DDS's files in the shared-memory folder count."""
    import socket

    from bench.host_facts import net_shm_delta, net_shm_load

    (tmp_path / "fastdds_0123").write_bytes(b"x" * 100)
    (tmp_path / "sem.fastdds_port7000_mutex").write_bytes(b"x" * 32)
    (tmp_path / "other").write_bytes(b"x" * 5000)
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # the kernel's minimum
        rx.bind(("127.0.0.1", 0))
        before = net_shm_load(tmp_path)
        for _ in range(200):  # never read: the buffer fills and the rest are dropped
            tx.sendto(b"y" * 1200, rx.getsockname())
        d = net_shm_delta(before, net_shm_load(tmp_path))
    finally:
        rx.close()
        tx.close()
    if not before["udp"]:
        pytest.skip("no /proc/net/snmp here")
    assert d["udp"].get("RcvbufErrors", 0) >= 100
    assert d["udp"].get("OutDatagrams", 0) >= 200
    assert d["shm_files"] == [2, 2] and before["shm_bytes"] == 132


def test_a_start_run_over_rounds_is_judged_on_its_median() -> None:
    """ros_bench --start-rounds: the headline's start figures are each start's median over its
    rounds (the warm start goal is judged on it), and every round is kept beside it."""
    from bench.ros_bench import headline

    starts = {
        "cold": {"first_command_s": 20.0},
        "late": {"first_command_s": 2.45},
        "late#2": {"first_command_s": 1.96},
        "late#3": {"first_command_s": 2.04},
        "floor": {"first_command_s": 1.70},
        "floor#2": {"first_command_s": 1.76},
        "floor#3": None,  # a start that failed: no figure, and not a zero
    }
    h = headline([], [], None, None, {}, starts)
    assert h["late_fuse_start_s"] == 2.04 and h["cold_start_s"] == 20.0
    assert h["floor_start_s"] == 1.73 and h["unfused_start_s"] is None
    assert h["start_rounds_s"] == {
        "late": [2.45, 1.96, 2.04],
        "floor": [1.70, 1.76, None],
    }
    assert "start_rounds_s" not in headline([], [], None, None, {}, None)  # no starts given
