"""Is this machine fast enough to judge the node on? A 4-8 s look before a GPU run.

The GPU machines are virtual and not alike: on some hosts every process, the bare-rclpy floors
included, runs 1.7-3x slower, and the bare 1 kHz timer overruns too (HISTORY, 2026-12-06). A
run there measures the host, and costs the ~6 minutes of device time a run on a good host would.
This probe times a fixed Python loop (the best of three) and 2000 one-millisecond sleeps:

    python3 bench/host_gate.py [--max-loop-s 0.85] [--out FILE]

With --max-loop-s it exits 3 when the loop is slower, so a call can stop before its run
(bench/ros_gpu.sh does with GATE_LOOP_S). On the H100s of 2026-12-06 the loop took 0.686 s on
a host whose floors matched the earlier good ones and 1.24-1.39 s on the slow ones.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host_facts import emit  # noqa: E402

LOOP_N = 10_000_000  # the loop's iterations: ~0.7 s on a good host


def loop_s(n: int = LOOP_N, rounds: int = 3) -> float:
    """The best of `rounds` timings of a plain `s += i` loop of `n`: the interpreter's speed on
    this vCPU, the best so one preemption does not fail a good host."""
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        s = 0
        for i in range(n):
            s += i
        best = min(best, time.perf_counter() - t)
    return best


def sleep_late_us(count: int = 2000, period_s: float = 0.001) -> dict:
    """How late `time.sleep(period_s)` returns: the wake-up a sleeping loop pays."""
    late = []
    for _ in range(count):
        t = time.perf_counter()
        time.sleep(period_s)
        late.append((time.perf_counter() - t - period_s) * 1e6)
    late.sort()
    return {
        "p50": round(late[len(late) // 2], 1),
        "p99": round(late[min(len(late) - 1, int(len(late) * 0.99))], 1),
        "max": round(late[-1], 1),
    }


def probe(n: int = LOOP_N, sleeps: int = 2000) -> dict:
    """The loop and the sleeps, with the load average they ran under."""
    return {
        "loop_n": n,
        "loop_s": float(f"{loop_s(n):.4g}"),
        "sleep_1ms_late_us": sleep_late_us(sleeps),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--max-loop-s",
        type=float,
        default=0.0,
        help="exit 3 when the loop takes longer than this (0 = report only)",
    )
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--loop-n", type=int, default=LOOP_N, help=argparse.SUPPRESS)
    ap.add_argument("--sleeps", type=int, default=2000, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.max_loop_s < 0 or a.loop_n < 1 or a.sleeps < 1:
        ap.error("--max-loop-s must be >= 0, --loop-n and --sleeps >= 1")
    r = probe(a.loop_n, a.sleeps)
    r["max_loop_s"] = a.max_loop_s or None
    r["slow"] = bool(a.max_loop_s) and r["loop_s"] > a.max_loop_s
    emit(r, a.out)
    if r["slow"]:
        print(
            f"host_gate: slow host, the loop took {r['loop_s']} s against --max-loop-s "
            f"{a.max_loop_s}: a run here would measure the host, not the node",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
