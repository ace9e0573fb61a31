"""Joint-state to observation mapping by name (no ROS import: the replay tools use it too)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from flashrt_ros.errors import BadRequest

# the arrays of sensor_msgs/JointState an observation can be made of, in the message's order
FIELDS = ("position", "velocity", "effort")
DEFAULT_FIELDS = ("position", "velocity")


def check_fields(fields: Sequence[str]) -> tuple[str, ...]:
    """`fields` as a tuple, or ValueError: a non-empty list of FIELDS, each at most once."""
    f = tuple(fields)
    bad = [x for x in f if x not in FIELDS]
    if not f or bad or len(set(f)) != len(f):
        raise ValueError(
            f"state fields must be a non-empty list of {', '.join(FIELDS)}, each at most once; "
            f"got {list(f)}"
        )
    return f


def fields_hint(state_dim: int, n_joints: int, option: bool = False) -> str:
    """The state fields whose size would be `state_dim` for `n_joints` joints, in words, for
    an error that says how to fix a mismatch ("" when no choice of ours fits): as the node's
    parameter, or with `option` as flashrt-replay's --state-fields."""
    k, rest = divmod(state_dim, n_joints)
    if rest or not 1 <= k <= len(FIELDS):
        return ""
    fit = FIELDS[:k]
    said = f"--state-fields {','.join(fit)}" if option else f"state_fields {list(fit)}"
    return f" ({state_dim} = {k} x {n_joints} joints: {said} would fit)"


class JointMapper:
    """obs = the `fields` arrays (default positions, then velocities) of `joint_names`, each
    looked up by name in every message; arrays not among `fields` are neither needed nor read,
    so a driver that publishes positions alone serves a positions-only policy.

    `limit` bounds every |value| (the node passes obs_limit): a huge but finite value is refused
    when the message arrives, so it never becomes the observation a timer tick steps on."""

    def __init__(
        self,
        joint_names: Sequence[str],
        limit: float = math.inf,
        fields: Sequence[str] = DEFAULT_FIELDS,
    ):
        names = list(joint_names)
        if not names or len(set(names)) != len(names) or not all(names):
            raise ValueError(f"joint_names must be unique non-empty names, got {names}")
        if not limit > 0:  # NaN too
            raise ValueError(f"limit must be > 0, got {limit}")
        self.joint_names = names
        self.fields = check_fields(fields)
        self._which = tuple(FIELDS.index(f) for f in self.fields)  # into observation()'s arrays
        self.n = len(names)
        self.dim = self.n * len(self.fields)  # the observation's size
        self.limit = float(limit)
        # the last message's names and their index: usually unchanged (None before the first:
        # a first message without names must still be found to lack every joint)
        self._names: tuple | None = None
        self._idx: list[int] = []

    def observation(self, names: Sequence[str], position, velocity=(), effort=()) -> np.ndarray:
        """The observation, or BadRequest (a ValueError) saying why the message is refused."""
        given = (position, velocity, effort)
        arrays = [given[w] for w in self._which]
        count = len(names)
        for a in arrays:
            if len(a) != count:
                sizes = ", ".join(f"{len(given[w])} {FIELDS[w]} values" for w in self._which)
                raise BadRequest(
                    f"joint_states has {count} names and {sizes}; they must match (the state "
                    f"needs {'/'.join(self.fields)} for every name)"
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
        values = [a[i] for a in arrays for i in self._idx]
        lim, isfinite = self.limit, math.isfinite
        for j, x in enumerate(values):
            if not isfinite(x) or abs(x) > lim:
                name = self.joint_names[j % self.n]
                if not isfinite(x):
                    raise BadRequest(f"joint {name!r} has a NaN or Inf value")
                raise BadRequest(f"joint {name!r} has a value beyond |x| <= {lim:g} (obs_limit)")
        return np.array(values, dtype=np.float64)
