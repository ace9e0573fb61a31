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
        v = self.values()
        return float(np.percentile(v, q)) if len(v) else 0.0


class LoopStats:
    """Counters the control loop updates and diagnostics reads (under one small lock)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.step_us = Ring()
        self.jitter_us = Ring()
        self.steps = 0
        self.overruns = 0
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
        self.service_us = Ring(512)  # time spent in service handlers (round trip minus DDS)
        self.lock_wait_us = Ring(512)  # of that, waiting for the engine lock

    def add_fault(self, text: str, step_error: bool = False) -> None:
        with self.lock:
            self.faults += 1
            self.last_fault = text
            if step_error:
                self.step_errors += 1
                self.last_error = text

    def rate(self, now: float, window: float = 2.0) -> float:
        with self.lock:
            t = self.tick_times.values()
            return float(np.count_nonzero(now - t <= window)) / window
