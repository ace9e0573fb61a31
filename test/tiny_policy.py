"""A trivial policy (`test.tiny_policy:tiny`) for measuring the node's own per-tick cost.

Its step is a handful of tiny tensor ops (a counter, a one-row blend toward the goal), so what a
node serving it spends per tick is the ROS layer and the engine's host path, not the policy:
the builtin policy's CPU step (~1.3 ms) would hide both at 1 kHz. `gain` changes the weights
(a buffer), so two factories give two weights digests and so two engine fingerprints.
"""

from __future__ import annotations

import torch

from flashrt_ros.policies.base import Policy, StateEntry


class TinyPolicy(Policy):
    policy_id = "test:tiny"
    obs_dim, action_dim, goal_dim, chunk_len = 12, 6, 6, 2

    def __init__(self, gain: float = 0.5):
        super().__init__()
        self.register_buffer("gain", torch.tensor([float(gain)]))

    def state_spec(self) -> list[StateEntry]:
        return [StateEntry("last", torch.float32, (1, 6), "recurrent")]

    def step(self, obs, state, action, chunk) -> None:
        last = state["last"]
        last.mul_(1.0 - self.gain).add_(obs[:, :6] * self.gain)
        action.copy_(last + 0.01 * state["goal"])
        chunk.copy_(action.unsqueeze(1).expand_as(chunk))


def tiny(gain: float = 0.5) -> Policy:
    return TinyPolicy(gain).eval()


def tiny_other() -> Policy:
    """The same policy with other weights: another fingerprint."""
    return TinyPolicy(0.25).eval()


class _Unbuildable(TinyPolicy):
    """A policy whose state cannot be laid out: what a user's bug looks like to the Engine."""

    def state_spec(self) -> list[StateEntry]:
        raise KeyError("observation.missing")


def unbuildable() -> Policy:
    """`test.tiny_policy:unbuildable`: the Engine's build raises KeyError (test_node_safety)."""
    return _Unbuildable()


def tiny_from(weights: str) -> Policy:
    """A factory that takes the node's `weights` file: a torch file holding {"gain": float}."""
    return TinyPolicy(float(torch.load(weights, weights_only=True)["gain"])).eval()


class NotAModule:
    """LeRobot-shaped in its attributes (config, predict_action_chunk), but no torch module."""

    config = None

    def predict_action_chunk(self, batch, noise=None):
        return None


def not_a_module() -> NotAModule:
    return NotAModule()


def hybrid_long() -> Policy:
    """The builtin hybrid policy with a 2048-entry KV history: a 2.1 MB state (69 KB by
    default), so that copies of many recorded ticks take long enough to see on the CPU."""
    from flashrt_ros.policies.loader import load_policy

    return load_policy("builtin:hybrid", kv_len=2048)
