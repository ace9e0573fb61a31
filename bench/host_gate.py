"""Is this machine fast enough to judge the node on? A few seconds' look before a GPU run.

The GPU machines are virtual and not alike: on some hosts every process, the bare-rclpy floors
included, runs 1.7-3x slower, and the bare 1 kHz timer overruns too (HISTORY, 2026-12-06). A
run there measures the host, and costs the ~6 minutes of device time a run on a good host would.
This probe times a fixed Python loop on every CPU in turn (pinned; the vCPUs of one machine can
differ 2x, so one CPU's time is luck) and 2000 one-millisecond sleeps, and reads the steal:

    python3 bench/host_gate.py [--max-loop-s 0.85] [--max-sleep-p99-us 110] [--out FILE]

`loop_s` is the median over the CPUs of each one's best time, in seconds per 10M iterations.
With --max-loop-s it exits 3 when that is slower, so a call can stop before its run
(bench/ros_gpu.sh does with GATE_LOOP_S; GATE_SLEEP_P99_US for the sleeps). On the H100s of
2026-12-06 one CPU's loop took 0.686 s on a host whose floors matched the earlier good ones and
1.24-1.39 s on two slow ones; a fourth host passed at 0.566 s and still ran slow, and a fifth
looped in 0.35 s (a faster CPU) with slow floors. The sleeps told the seven hosts of that day
apart: p99 lateness 74-96 us on the two good ones, 123-1865 on the five slow ones (a bound of
125 passed one at 123.4; 110 is the one used since). Seven hosts are few: a pass is no promise.
`pingpong_rtt_us` (a pipe round trip between two processes) is recorded to learn whether it
predicts the DDS floors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import cpu_speed  # noqa: E402
from bench.host_facts import emit, stat_total, steal_between  # noqa: E402

LOOP_N = 10_000_000  # loop_s is per this many iterations: ~0.7 s on a good host
PER_CPU_N = 2_000_000  # iterations timed on each CPU


def add_loop(n: int) -> int:
    """A plain `s += i` loop of `n`: the interpreter's speed on the CPU it runs on."""
    s = 0
    for i in range(n):
        s += i
    return s


def sleep_late_us(count: int = 2000, period_s: float = 0.001) -> dict:
    """How late `time.sleep(period_s)` returns: the wake-up a sleeping loop pays."""
    late = []
    for _ in range(count):
        t = time.perf_counter()
        time.sleep(period_s)
        late.append((time.perf_counter() - t - period_s) * 1e6)
    return _quantiles(late)


def _quantiles(us: list[float]) -> dict:
    us = sorted(us)
    return {
        "p50": round(us[len(us) // 2], 1),
        "p99": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1),
        "max": round(us[-1], 1),
    }


def pingpong_us(count: int = 2000) -> dict:
    """Round trips of one byte between this process and a forked child over two pipes: a
    sleeping process woken by another, the hand-off a DDS echo or a service call pays twice."""
    ping_r, ping_w = os.pipe()
    pong_r, pong_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer each byte until the pipe closes
        os.close(ping_w)
        os.close(pong_r)
        while os.read(ping_r, 1):
            os.write(pong_w, b"x")
        os._exit(0)
    os.close(ping_r)
    os.close(pong_w)
    rtt = []
    try:
        for _ in range(count + 50):  # the first 50 warm the path up
            t = time.perf_counter()
            os.write(ping_w, b"x")
            os.read(pong_r, 1)
            rtt.append((time.perf_counter() - t) * 1e6)
    finally:
        os.close(ping_w)
        os.close(pong_r)
        os.waitpid(pid, 0)
    return _quantiles(rtt[50:])


def probe(n: int = PER_CPU_N, sleeps: int = 2000) -> dict:
    """The loop on every CPU (bench/cpu_speed.py's round-robin, best of two each), the sleeps,
    a cross-process ping-pong, and the steal and load they ran under."""
    a = stat_total()
    rows = cpu_speed.probe(sorted(os.sched_getaffinity(0)), 2, n, add_loop)["cpus"]
    late = sleep_late_us(sleeps)
    pong = pingpong_us(sleeps)
    steal = steal_between(a, stat_total())
    per = {c: r["best_us"] * 1e-6 * LOOP_N / n for c, r in rows.items()}
    times = sorted(per.values())
    sig = lambda v: float(f"{v:.4g}")  # noqa: E731
    return {
        "loop_n": LOOP_N,
        "loop_s": sig(statistics.median(times)),
        "loop_s_fastest_cpu": sig(times[0]),
        "loop_s_slowest_cpu": sig(times[-1]),
        "slowest_cpu": max(per, key=per.get),
        "sleep_1ms_late_us": late,
        "pingpong_rtt_us": pong,
        "steal_pct": steal,
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": len(per),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--max-loop-s",
        type=float,
        default=0.0,
        help="exit 3 when the loop takes longer than this (0 = report only)",
    )
    ap.add_argument(
        "--max-sleep-p99-us",
        type=float,
        default=0.0,
        help="exit 3 also when a 1 ms sleep's p99 lateness is over this (0 = no bound)",
    )
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--loop-n", type=int, default=PER_CPU_N, help=argparse.SUPPRESS)
    ap.add_argument("--sleeps", type=int, default=2000, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.max_loop_s < 0 or a.max_sleep_p99_us < 0 or a.loop_n < 1 or a.sleeps < 1:
        ap.error("--max-loop-s and --max-sleep-p99-us must be >= 0, --loop-n and --sleeps >= 1")
    r = probe(a.loop_n, a.sleeps)
    r["max_loop_s"] = a.max_loop_s or None
    r["max_sleep_p99_us"] = a.max_sleep_p99_us or None
    why = []
    if a.max_loop_s and r["loop_s"] > a.max_loop_s:
        why.append(f"the loop took {r['loop_s']} s against --max-loop-s {a.max_loop_s}")
    late = r["sleep_1ms_late_us"]["p99"]
    if a.max_sleep_p99_us and late > a.max_sleep_p99_us:
        why.append(f"a 1 ms sleep woke {late} us late (p99) against {a.max_sleep_p99_us}")
    r["slow"] = bool(why)
    emit(r, a.out)
    if why:
        print(
            f"host_gate: slow host, {'; '.join(why)}: a run here would measure the host, "
            "not the node",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
