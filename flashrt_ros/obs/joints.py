"""Joint-state to observation mapping by name (no ROS import: the replay tools use it too)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from flashrt_ros.errors import BadRequest


class JointMapper:
    """obs = positions then velocities of `joint_names`, looked up by name in each message.

    `limit` bounds every |value| (the node passes obs_limit): a huge but finite value is refused
    when the message arrives, so it never becomes the observation a timer tick steps on."""

    def __init__(self, joint_names: Sequence[str], limit: float = math.inf):
        names = list(joint_names)
        if not names or len(set(names)) != len(names) or not all(names):
            raise ValueError(f"joint_names must be unique non-empty names, got {names}")
        if not limit > 0:  # NaN too
            raise ValueError(f"limit must be > 0, got {limit}")
        self.joint_names = names
        self.n = len(names)
        self.limit = float(limit)
        self._names: tuple = ()  # the last message's names and their index: usually unchanged
        self._idx: list[int] = []

    def observation(self, names: Sequence[str], position, velocity) -> np.ndarray:
        """The observation, or BadRequest (a ValueError) saying why the message is refused."""
        if len(position) != len(names) or len(velocity) != len(names):
            raise BadRequest(
                f"joint_states has {len(names)} names, {len(position)} positions and "
                f"{len(velocity)} velocities; they must match"
            )
        key = tuple(names)
        if key != self._names:
            index = {n: i for i, n in enumerate(names)}
            if len(index) != len(names):  # which one is meant is unknowable: refuse the message
                seen: set = set()
                dup = sorted({n for n in names if n in seen or seen.add(n)})
                raise BadRequest(f"joint_states names {dup} more than once")
            missing = [j for j in self.joint_names if j not in index]
            if missing:
                raise BadRequest(f"joint_states lacks joints {missing}")
            self._names, self._idx = key, [index[j] for j in self.joint_names]
        idx = self._idx
        obs = np.empty(2 * self.n, dtype=np.float64)
        for k, i in enumerate(idx):
            p, v = position[i], velocity[i]
            if not (math.isfinite(p) and math.isfinite(v)):
                raise BadRequest(f"joint {self.joint_names[k]!r} has a NaN or Inf value")
            if abs(p) > self.limit or abs(v) > self.limit:
                raise BadRequest(
                    f"joint {self.joint_names[k]!r} has a value beyond |x| <= {self.limit:g} "
                    "(obs_limit)"
                )
            obs[k], obs[self.n + k] = p, v
        return obs
