"""Shared helpers for the ROS-free core tests."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from flashrt_ros import Engine, load_policy


def make_engine(**kw) -> Engine:
    kw.setdefault("device", "cpu")
    kw.setdefault("seed", 0)
    return Engine(load_policy(kw.pop("policy", "builtin:hybrid")), **kw)


def observations(n: int, seed: int = 1, obs_dim: int = 12) -> np.ndarray:
    """Smooth joint trajectories (positions then velocities), like an arm would send."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)[:, None] * 0.01
    freq = rng.uniform(0.2, 1.0, size=obs_dim // 2)
    phase = rng.uniform(0, 6.28, size=obs_dim // 2)
    q = 0.8 * np.sin(2 * np.pi * freq * t + phase)
    dq = 0.8 * 2 * np.pi * freq * np.cos(2 * np.pi * freq * t + phase)
    return np.concatenate([q, dq], axis=1)


def tiny_policy(**kw):
    """A module:factory target for load_policy tests."""
    from flashrt_ros.policies.hybrid import HybridConfig, HybridPolicy

    return HybridPolicy(HybridConfig(d_model=16, n_heads=2, **kw))


@functools.cache
def cpu_step_s(policy: str = "builtin:hybrid") -> float:
    """The median time of one eager CPU step of `policy` in this process: tests that need a node
    to keep up with a rate pick the rate from it (builtin:hybrid's step is ~1 ms on one 2-core
    CI machine and ~4 ms on another; at a fixed 500 Hz the slower one could not keep up)."""
    eng = make_engine(policy=policy)
    obs = observations(40, seed=3)
    times = []
    for o in obs:
        t0 = time.perf_counter()
        eng.step(o)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[10:]))


def rate_with_room(share: float, most_hz: float) -> float:
    """A control rate at which one CPU step of builtin:hybrid fills `share` of the period, at
    most `most_hz`."""
    return min(most_hz, share / cpu_step_s())


@contextlib.contextmanager
def immutable(*paths: Path) -> Iterator[None]:
    """Files nobody may remove, replace or write, root included (`chattr +i`; tests run as
    root in CI): a disk that refuses, for real. Skips where the file system has no such flag."""
    done: list[Path] = []
    try:
        for p in paths:
            try:
                r = subprocess.run(["chattr", "+i", str(p)], capture_output=True, text=True)
            except FileNotFoundError:  # no e2fsprogs on this machine
                pytest.skip("chattr is not installed here")
            if r.returncode != 0:
                pytest.skip(f"chattr +i {p} is not possible here: {r.stderr.strip()}")
            done.append(p)
        yield
    finally:
        for p in done:
            subprocess.run(["chattr", "-i", str(p)], check=True)
