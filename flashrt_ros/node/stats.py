"""Loop statistics for /diagnostics: fixed-size rings, no allocation per tick."""

from __future__ import annotations

import threading

import numpy as np


class Ring:
    def __init__(self, n: int = 2048):
        self.buf = np.zeros(n)
        self.n = 0

    def add(self, x: float) -> None:
        self.buf[self.n % len(self.buf)] = x
        self.n += 1

    def values(self) -> np.ndarray:
        return self.buf[: min(self.n, len(self.buf))]

    def pct(self, q: float) -> float:
        return percentiles(self.values(), (q,))[0]


def _rate(times: np.ndarray, now: float, capacity: int, window: float = 2.0) -> float:
    """Ticks per second over the last `window` s; over the time the ring holds when that is
    less (above capacity / window Hz it was capped at that: 4096 Hz for 8192 ticks)."""
    n = int(np.count_nonzero(now - times <= window))
    if n and n == len(times) == capacity:
        return n / max(now - float(times.min()), 1e-9)
    return n / window


def percentiles(v: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """np.percentile(v, qs) (linear interpolation, the same numbers) with one np.partition:
    np.percentile costs ~60 us of Python per call on 2048 values, and /diagnostics reads six of
    them once a second (diagnostics.py: in the control thread's slack while it runs), under
    the GIL."""
    n = len(v)
    if n == 0:
        return [0.0] * len(qs)
    pos = [q / 100.0 * (n - 1) for q in qs]
    idx = sorted({int(np.floor(x)) for x in pos} | {int(np.ceil(x)) for x in pos})
    part = np.partition(v, idx)
    out = []
    for x in pos:
        lo, hi = int(np.floor(x)), int(np.ceil(x))
        a, b = float(part[lo]), float(part[hi])
        out.append(a + (b - a) * (x - lo))
    return out


class LoopStats:
    """Counters the control loop updates and diagnostics reads (under one small lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.step_us = Ring()
        self.jitter_us = Ring()
        self.steps = 0
        self.overruns = 0
        self.last_overrun = ""  # why the last overrun happened: a late wake-up or a long tick
        self.overruns_late_wake = 0  # overrunning ticks that woke later than they took to run
        self.overruns_long_tick = 0  # the others: the tick itself ran long
        self.overruns_collector = 0  # overrunning ticks that held a garbage collector pass
        # ticks that started late, the one before having run into their period (none lost)
        self.delayed_ticks = 0
        self.refused = 0
        self.stale_ticks = 0
        self.stale_s = 0.0
        self.last_refusal = ""
        self.step_errors = 0  # control ticks whose step raised (a fault, or an unexpected error)
        self.last_error = ""
        self.faults = 0  # every fault: a non-finite action, a device error, a failing request
        self.last_fault = ""
        self.faults_reported = 0  # faults already shown by a /diagnostics message
        self.tick_times = Ring(8192)  # monotonic times of recent steps
        self.js_times = Ring(8192)  # monotonic times of recent valid joint_states (and of those
        # a timer tick's newer valid one superseded unexamined)
        self.service_us = Ring(512)  # time spent in service handlers (round trip minus DDS)
        self.lock_wait_us = Ring(512)  # of that, waiting for the engine lock
        # from the middleware's reception of a request to its take (host.py): the time it
        # waited for the serving thread (a tick in progress, the GIL, a request before it)
        self.service_queue_us = Ring(512)
        self.service_reply_us = Ring(512)  # sending the reply (serialization, the write)
        # per service, once it is called: "<name>" its handler time, "<name>_queue" and
        # "<name>_reply" as service_queue_us and service_reply_us
        self.service_by: dict[str, Ring] = {}

    def service_ring(self, name: str) -> Ring:
        """One per-service ring, made at its first use (lock held)."""
        ring = self.service_by.get(name)
        if ring is None:
            ring = self.service_by[name] = Ring(256)
        return ring

    def add_fault(self, text: str, step_error: bool = False) -> None:
        with self.lock:
            self.faults += 1
            self.last_fault = text
            if step_error:
                self.step_errors += 1
                self.last_error = text

    def snapshot(self, now: float) -> dict:
        """Everything /diagnostics shows, copied under the lock (a few microseconds: the control
        thread takes it after every tick) and computed after it is released."""
        with self.lock:
            rings = {
                k: getattr(self, k).values().copy()
                for k in (
                    "step_us",
                    "jitter_us",
                    "service_us",
                    "lock_wait_us",
                    "service_queue_us",
                    "service_reply_us",
                )
            }
            times = self.tick_times.values().copy()
            js_times = self.js_times.values().copy()
            by = {k: r.values().copy() for k, r in self.service_by.items()}
            counts = {
                k: getattr(self, k)
                for k in (
                    "steps",
                    "overruns",
                    "last_overrun",
                    "overruns_late_wake",
                    "overruns_long_tick",
                    "overruns_collector",
                    "delayed_ticks",
                    "refused",
                    "last_refusal",
                    "stale_ticks",
                    "stale_s",
                    "step_errors",
                    "last_error",
                    "faults",
                    "last_fault",
                )
            }
            new_faults, self.faults_reported = self.faults - self.faults_reported, self.faults
        step50, step99 = percentiles(rings["step_us"], (50, 99))
        svc50, svc99 = percentiles(rings["service_us"], (50, 99))
        wait50, wait99 = percentiles(rings["lock_wait_us"], (50, 99))
        queue50, queue99 = percentiles(rings["service_queue_us"], (50, 99))
        return {
            **counts,
            "rate_hz": _rate(times, now, len(self.tick_times.buf)),
            "last_step_at": float(times.max()) if len(times) else float("-inf"),
            "joint_states_hz": _rate(js_times, now, len(self.js_times.buf)),
            "step_p50_us": step50,
            "step_p99_us": step99,
            "jitter_p99_us": percentiles(rings["jitter_us"], (99,))[0],
            "service_p50_us": svc50,
            "service_p99_us": svc99,
            "lock_wait_p50_us": wait50,
            "lock_wait_p99_us": wait99,
            "service_queue_p50_us": queue50,
            "service_queue_p99_us": queue99,
            "service_reply_p50_us": percentiles(rings["service_reply_us"], (50,))[0],
            "new_faults": new_faults,
            "service_by_p50_us": {k: percentiles(v, (50,))[0] for k, v in sorted(by.items())},
        }
