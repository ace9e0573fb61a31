"""Joint-state to observation mapping by name (no ROS import: the replay tools use it too)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


class JointMapper:
    """obs = positions then velocities of `joint_names`, looked up by name in each message."""

    def __init__(self, joint_names: Sequence[str]):
        names = list(joint_names)
        if not names or len(set(names)) != len(names) or not all(names):
            raise ValueError(f"joint_names must be unique non-empty names, got {names}")
        self.joint_names = names
        self.n = len(names)
        self._names: tuple = ()  # the last message's names and their index: usually unchanged
        self._idx: list[int] = []

    def observation(self, names: Sequence[str], position, velocity) -> np.ndarray:
        """The observation, or ValueError saying why the message is refused."""
        if len(position) != len(names) or len(velocity) != len(names):
            raise ValueError(
                f"joint_states has {len(names)} names, {len(position)} positions and "
                f"{len(velocity)} velocities; they must match"
            )
        key = tuple(names)
        if key != self._names:
            index = {n: i for i, n in enumerate(names)}
            missing = [j for j in self.joint_names if j not in index]
            if missing:
                raise ValueError(f"joint_states lacks joints {missing}")
            self._names, self._idx = key, [index[j] for j in self.joint_names]
        idx = self._idx
        obs = np.empty(2 * self.n, dtype=np.float64)
        for k, i in enumerate(idx):
            p, v = position[i], velocity[i]
            if not (math.isfinite(p) and math.isfinite(v)):
                raise ValueError(f"joint {self.joint_names[k]!r} has a NaN or Inf value")
            obs[k], obs[self.n + k] = p, v
        return obs
