"""Shared helpers for the ROS-free core tests."""

from __future__ import annotations

import numpy as np

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
