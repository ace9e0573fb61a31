"""Serve a user's functional policy, saved with torch.export, through the same arena and graph.

The user writes `f(obs, goal, *state) -> (action, *new_state)` with obs (obs_dim,), goal
(goal_dim,) and any number of state tensors, exports it with example inputs and saves it with
`torch.export.save`. The adapter turns the state tensors into arena regions and copies the new
state back in place after each call, so capsules and graph capture work unchanged.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from flashrt_ros.policies.base import Policy, StateEntry


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where the other is NaN (NaN never equals NaN)."""
    return torch.equal(a, b) or (
        a.is_floating_point() and torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)
    )


class ExportedPolicy(Policy):
    """A torch.export program wrapped in the policy protocol."""

    def __init__(self, path: str | Path):
        super().__init__()
        path = Path(path)
        try:
            ep = torch.export.load(str(path))
        except Exception as e:  # torch raises several types for a bad archive
            raise ValueError(f"{path}: not a torch.export program ({e})") from e
        args = ep.example_inputs[0] if ep.example_inputs else None
        if not args or len(args) < 2:
            raise ValueError(
                f"{path}: the program must be saved with example inputs (obs, goal, *state)"
            )
        with open(path, "rb") as fh:
            self._digest = hashlib.sha256(fh.read()).hexdigest()[:32]
        # not registered as a submodule: exported modules refuse .train()/.eval()
        object.__setattr__(self, "_fn", ep.module())
        obs, goal, *state = args
        if obs.dim() != 1 or goal.dim() != 1:
            raise ValueError(f"{path}: obs and goal must be 1-D, got {obs.shape} and {goal.shape}")
        out = self._fn(obs, goal, *state)
        if not isinstance(out, (tuple, list)) or len(out) != 1 + len(state):
            raise ValueError(f"{path}: must return (action, *new_state) with {len(state)} states")
        if not (isinstance(out[0], torch.Tensor) and out[0].is_floating_point()):
            raise ValueError(f"{path}: the action must be a floating-point tensor")
        for i, (new, old) in enumerate(zip(out[1:], state, strict=True)):
            # copied in place after each step: another shape would broadcast, another dtype cast
            if not isinstance(new, torch.Tensor) or (new.shape, new.dtype) != (
                old.shape,
                old.dtype,
            ):
                got = (tuple(new.shape), new.dtype) if isinstance(new, torch.Tensor) else new
                raise ValueError(
                    f"{path}: new state {i} must have its input's shape and dtype "
                    f"{(tuple(old.shape), old.dtype)}, got {got}"
                )
        # a second call on the same inputs must agree: randomness drawn inside the program
        # would not be in the arena, so no restore could replay it
        with torch.random.fork_rng(devices=[]):
            again = self._fn(obs, goal, *state)
        if not all(_same(a, b) for a, b in zip(out, again, strict=True)):
            raise ValueError(
                f"{path}: two calls on the same inputs differ: the program draws randomness (or "
                "reads something outside its inputs) that a capsule cannot hold; pass noise in "
                "as a state tensor instead"
            )
        # A new state that is one of the state inputs, returned as it is (a delay line, a
        # swap): copied back after another state was overwritten, it would carry the new value,
        # so it is cloned first (decided once: the program's outputs are fixed by its graph).
        inputs = {t.untyped_storage().data_ptr() for t in state}
        self._alias = tuple(t.untyped_storage().data_ptr() in inputs for t in out[1:])
        self.policy_id = f"exported:{path.name}"
        self.obs_dim, self.goal_dim = int(obs.shape[0]), int(goal.shape[0])
        self.action_dim = int(out[0].reshape(-1).shape[0])
        self.chunk_len = 1
        self._state_meta = [(t.dtype, tuple(t.shape)) for t in state]
        self._init = [t.detach().clone() for t in state]

    def state_spec(self) -> list[StateEntry]:
        return [
            StateEntry(f"s{i}", dt, (1, *shape), "user")
            for i, (dt, shape) in enumerate(self._state_meta)
        ]

    def init_state(self, state, seed: int) -> None:
        for i, t in enumerate(self._init):
            state[f"s{i}"][0].copy_(t)

    def step(self, obs, state, action, chunk) -> None:
        n = len(self._state_meta)
        out = self._fn(obs[0], state["goal"][0], *(state[f"s{i}"][0] for i in range(n)))
        action[0].copy_(out[0].reshape(-1))
        chunk[0, 0].copy_(out[0].reshape(-1))
        new = [t.clone() if a else t for t, a in zip(out[1:], self._alias, strict=True)]
        for i in range(n):
            state[f"s{i}"][0].copy_(new[i])

    def _apply(self, fn, recurse=True):
        # move the exported module's constants along with .to(device)
        object.__setattr__(self, "_fn", self._fn._apply(fn))
        self._init = [fn(t) for t in self._init]
        return super()._apply(fn, recurse)

    def weights_digest(self) -> str:
        return self._digest
