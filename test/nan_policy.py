"""A test policy (`test.nan_policy:nan_above`): the builtin hybrid policy, except that its action
turns NaN when any observation value exceeds `threshold` (set below the node's obs_limit, so the
observation passes every input check and the fault comes from the step itself, as a diverging
policy or a device fault would)."""

from __future__ import annotations

import time

import torch

from flashrt_ros.policies.base import Policy
from flashrt_ros.policies.loader import load_policy

THRESHOLD = 500.0


class NanAbove(Policy):
    def __init__(self, inner: Policy, threshold: float):
        super().__init__()
        self.inner = inner
        self.threshold = float(threshold)
        self.policy_id = f"test:nan_above/{inner.policy_id}"
        self.obs_dim, self.action_dim = inner.obs_dim, inner.action_dim
        self.goal_dim, self.chunk_len = inner.goal_dim, inner.chunk_len

    def state_spec(self):
        return self.inner.state_spec()

    def init_state(self, state, seed: int) -> None:
        self.inner.init_state(state, seed)

    def step(self, obs, state, action, chunk) -> None:
        self.inner.step(obs, state, action, chunk)
        big = (obs.abs() > self.threshold).any(dim=-1, keepdim=True)  # no host sync: capturable
        action.copy_(torch.where(big, torch.full_like(action, float("nan")), action))


def nan_above(threshold: float = THRESHOLD) -> Policy:
    return NanAbove(load_policy("builtin:hybrid"), threshold).eval()


class SlowAbove(NanAbove):
    """The builtin hybrid policy, except that a step on an observation whose first value
    exceeds `threshold` sleeps `seconds`: a step stuck on the device, as the node sees it."""

    def __init__(self, inner: Policy, threshold: float, seconds: float):
        super().__init__(inner, threshold)
        self.seconds = float(seconds)

    def step(self, obs, state, action, chunk) -> None:
        self.inner.step(obs, state, action, chunk)
        if float(obs.reshape(-1)[0]) > self.threshold:  # a host read: never captured (CPU only)
            time.sleep(self.seconds)


def slow_above(threshold: float = THRESHOLD, seconds: float = 3.0) -> Policy:
    return SlowAbove(load_policy("builtin:hybrid"), threshold, seconds).eval()


def slow5_above(threshold: float = THRESHOLD) -> Policy:
    """A 5 s stall: room for two 1 s watchdog reports however late a loaded machine starts it."""
    return slow_above(threshold, seconds=5.0)


def stuck_above(threshold: float = THRESHOLD) -> Policy:
    """A step that stays stuck for a minute: longer than any test waits for an exit."""
    return slow_above(threshold, seconds=60.0)
