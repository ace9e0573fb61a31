"""Timing helpers for the GPU benchmarks: every sample waits for the device, medians reported."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch


def host_timed(fn: Callable[[], None], iters: int, warmup: int = 20, sync=None) -> np.ndarray:
    """Wall time per call in microseconds, synchronizing after each call (a control tick)."""
    sync = sync or torch.cuda.synchronize
    for _ in range(warmup):
        fn()
    sync()
    out = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        out[i] = (time.perf_counter() - t0) * 1e6
    return out


def event_timed(fn: Callable[[], None], iters: int, warmup: int = 5) -> np.ndarray:
    """Device time per call in microseconds between two events (launch gaps included)."""
    return burst_timed(fn, iters, burst=1, warmup=warmup)


def burst_timed(
    fn: Callable[[], None], samples: int, burst: int = 16, warmup: int = 3
) -> np.ndarray:
    """Microseconds per call over bursts of `burst` back-to-back calls between two events.

    A single tiny call timed between two events mostly measures the host's gap between
    recording the first event and issuing the call; in a burst each call costs what it costs
    in a stream of operations (host issue or device time, whichever is longer).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = np.empty(samples)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(samples):
        start.record()
        for _ in range(burst):
            fn()
        end.record()
        end.synchronize()
        out[i] = start.elapsed_time(end) * 1e3 / burst
    return out


def pct(a: list[float] | np.ndarray) -> dict:
    """{"n", "p50_us", "p99_us", "ratio": p99 / p50} of per-tick times in us."""
    x = np.asarray(a, dtype=float)
    p50, p99 = float(np.percentile(x, 50)), float(np.percentile(x, 99))
    return {
        "n": int(x.size),
        "p50_us": round(p50, 1),
        "p99_us": round(p99, 1),
        "ratio": round(p99 / max(p50, 1e-9), 2),
    }


def p(a: np.ndarray, q: float) -> float:
    return round(float(np.percentile(a, q)), 2)


def report(out: dict, path: Path | None) -> None:
    """Print a probe's result as JSON, and write it to `path` when given."""
    text = json.dumps(out, indent=1)
    print(text)
    if path is not None:
        path.write_text(text + "\n")
