"""How fast each CPU of this machine runs one thread of Python, as JSON. On a virtual machine the
CPUs are the hypervisor's threads: two of them can differ in speed for a whole run (a host core
shared with another guest, a different clock), and the node's control thread, which also serves
the services in timer mode, runs at the speed of the CPU it lands on. A benchmark that compares
two runs should pin that thread (the node's cpu_affinity) to a CPU this probe rates, or say
which CPU each run had.

    python3 bench/cpu_speed.py [--rounds 20] [--work 20000] [--cpus 0-15] [--out FILE]

Each round times the same interpreter-bound work (dict stores, tuples, small strings: what a
service handler does) once on every CPU in turn, the thread pinned there, so slow drift of the
machine falls on every CPU alike. Per CPU: the best and median time (us) and the steal (time
the hypervisor ran something else on that CPU), as a percent of the CPU's non-idle time over the
probe (results/2026-12-01-1fd00d5-cpu-speed.json divided by all of its time, idle included:
about 16x lower on a 16-CPU machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host_facts import cpu_list, emit, read  # noqa: E402


def work(n: int) -> int:
    """A fixed amount of interpreter work, like a handler's bookkeeping."""
    d: dict[int, tuple] = {}
    for i in range(n):
        d[i & 255] = (i, str(i & 1023))
    return len(d)


def cpu_times() -> dict[int, list[int]]:
    """Each CPU's /proc/stat counters (user, nice, system, idle, iowait, irq, softirq, steal)."""
    out = {}
    for line in read("/proc/stat").splitlines():
        name, *vals = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            out[int(name[3:])] = [int(v) for v in vals[:8]]
    return out


def probe(cpus: list[int], rounds: int, n: int, fn: Callable[[int], object] = work) -> dict:
    """Rounds of `fn(n)` (default `work`) on each CPU in turn; the best, median and steal per
    CPU."""
    keep = os.sched_getaffinity(0)
    times: dict[int, list[float]] = {c: [] for c in cpus}
    t0 = cpu_times()
    try:
        for _ in range(rounds):
            for c in cpus:
                os.sched_setaffinity(0, {c})
                fn(n // 10)  # settle on the CPU
                s = time.perf_counter_ns()
                fn(n)
                times[c].append((time.perf_counter_ns() - s) / 1e3)
    finally:
        os.sched_setaffinity(0, keep)
    t1 = cpu_times()
    rows = {}
    for c in cpus:
        d = [b - a for a, b in zip(t0.get(c, []), t1.get(c, []), strict=False)]
        # of the time the CPU was not idle: each CPU is measured ~1/len(cpus) of the probe
        busy = (sum(d) - sum(d[3:5])) or 1  # all but idle and iowait
        rows[c] = {
            "best_us": round(min(times[c]), 1),
            "median_us": round(statistics.median(times[c]), 1),
            "steal_pct": round(100 * (d[7] if len(d) > 7 else 0) / busy, 2),
        }
    best = min(rows, key=lambda c: rows[c]["median_us"])
    worst = max(rows, key=lambda c: rows[c]["median_us"])
    return {
        "work": n,
        "rounds": rounds,
        "cpus": rows,
        "fastest": best,
        "slowest": worst,
        "slowest_over_fastest": round(rows[worst]["median_us"] / rows[best]["median_us"], 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20, help="times each CPU is measured")
    ap.add_argument("--work", type=int, default=20000, help="loop iterations of one measure")
    ap.add_argument("--cpus", help="CPUs to rate, as taskset -c (default: every CPU allowed)")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    a = ap.parse_args()
    allowed = sorted(os.sched_getaffinity(0))
    cpus = cpu_list(a.cpus) if a.cpus else allowed
    bad = [c for c in cpus if c not in allowed]
    if bad or a.rounds < 1 or a.work < 1:
        what = f"CPUs {bad} are not allowed here ({allowed})" if bad else "--rounds and --work >= 1"
        print(f"cpu_speed: {what}", file=sys.stderr)
        return 2
    emit(probe(cpus, a.rounds, a.work), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
