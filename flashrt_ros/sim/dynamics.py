"""A small simulated arm: pure numpy, no ROS.

Each joint is a second-order system driven by a position servo:

    acc = stiffness * (target - q) - damping * dq      (clipped to +-max_acc)
    dq  = clip(dq + acc * dt, -max_vel, max_vel)
    q   = q + dq * dt                                  (semi-implicit Euler)

then ``q`` is clamped to the joint limits and the velocity into a limit is zeroed. Targets are
clamped to the limits before use. With the defaults the servo is critically damped
(damping = 2 * sqrt(stiffness)) and its steady-state velocity is
``stiffness / damping * (target - q)`` = 10 * offset.

``expert_action`` is the controller the repository's built-in policy is trained to imitate: a
position target that moves toward a goal with a bounded per-step change and velocity damping.
Everything is deterministic; ``seed`` only feeds the model's own generator (``random_goal``).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "ArmModel",
    "expert_action",
    "random_goal",
    "DEFAULT_LOWER",
    "DEFAULT_UPPER",
    "EXPERT_GAIN",
    "EXPERT_DAMPING",
]

DEFAULT_LOWER = -2.5  # rad, every joint
DEFAULT_UPPER = 2.5
EXPERT_GAIN = 0.3  # k: fraction of the goal error asked for per step (before the clip)
EXPERT_DAMPING = 0.05  # c: s, velocity damping of the expert's target


def _limits(n: int, lower, upper) -> tuple[np.ndarray, np.ndarray]:
    lo = np.broadcast_to(
        np.asarray(DEFAULT_LOWER if lower is None else lower, dtype=np.float64), (n,)
    ).copy()
    hi = np.broadcast_to(
        np.asarray(DEFAULT_UPPER if upper is None else upper, dtype=np.float64), (n,)
    ).copy()
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
        raise ValueError("joint limits must be finite")
    if np.any(lo >= hi):
        raise ValueError(
            f"every lower limit must be below its upper limit (lower={lo}, upper={hi})"
        )
    return lo, hi


def _vector(x, n: int, what: str) -> np.ndarray:
    """A finite float64 copy of ``x`` with shape (n,), else ValueError."""
    try:
        a = np.array(x, dtype=np.float64, copy=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: not a numeric array ({exc})") from None
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{what}: expected {n} values, got shape {a.shape}")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{what}: contains NaN or Inf: {a}")
    return a


def expert_action(
    q: np.ndarray,
    dq: np.ndarray,
    goal: np.ndarray,
    max_step: float = 0.05,
    *,
    k: float = EXPERT_GAIN,
    c: float = EXPERT_DAMPING,
    lower=None,
    upper=None,
) -> np.ndarray:
    """Expert target ``q + clip(k*(goal - q) - c*dq, -max_step, max_step)``, clamped to limits.

    ``lower``/``upper`` default to the ArmModel defaults (scalars broadcast). Returns float64 (n,).
    """
    q = np.asarray(q, dtype=np.float64)
    dq = np.asarray(dq, dtype=np.float64)
    goal = np.asarray(goal, dtype=np.float64)
    if not (q.shape == dq.shape == goal.shape) or q.ndim != 1:
        raise ValueError(
            f"q, dq and goal must be 1-D of one size, got {q.shape}, {dq.shape}, {goal.shape}"
        )
    lo, hi = _limits(q.shape[0], lower, upper)
    step = np.clip(k * (goal - q) - c * dq, -max_step, max_step)
    return np.clip(q + step, lo, hi)


def random_goal(
    rng: np.random.Generator, n_joints: int = 6, lower=None, upper=None, margin: float = 0.2
) -> np.ndarray:
    """A uniformly random goal, at least ``margin`` rad inside the joint limits."""
    lo, hi = _limits(n_joints, lower, upper)
    span = hi - lo
    m = np.minimum(margin, 0.25 * span)
    return rng.uniform(lo + m, hi - m)


class ArmModel:
    """Simulated n-joint arm with position-servoed joints (see the module docstring)."""

    def __init__(
        self,
        n_joints: int = 6,
        dt: float = 0.01,
        lower=None,
        upper=None,
        max_vel: float | np.ndarray = 2.0,
        max_acc: float | np.ndarray = 20.0,
        stiffness: float = 400.0,
        damping: float = 40.0,
        seed: int | None = None,
    ) -> None:
        if int(n_joints) != n_joints or n_joints < 1:
            raise ValueError(f"n_joints must be a positive integer, got {n_joints!r}")
        if not (np.isfinite(dt) and dt > 0):
            raise ValueError(f"dt must be positive, got {dt!r}")
        self.n = int(n_joints)
        self.dt = float(dt)
        self.lower, self.upper = _limits(self.n, lower, upper)
        self.max_vel = np.broadcast_to(np.asarray(max_vel, dtype=np.float64), (self.n,)).copy()
        self.max_acc = np.broadcast_to(np.asarray(max_acc, dtype=np.float64), (self.n,)).copy()
        if np.any(~(self.max_vel > 0)) or np.any(~(self.max_acc > 0)):
            raise ValueError("max_vel and max_acc must be positive")
        if not (stiffness > 0 and damping >= 0):
            raise ValueError("stiffness must be positive and damping non-negative")
        self.stiffness = float(stiffness)
        self.damping = float(damping)
        self.rng = np.random.default_rng(seed)
        self._q = np.zeros(self.n)
        self._dq = np.zeros(self.n)
        self._target = np.zeros(self.n)
        self.steps = 0
        self.reset()

    # -- state ---------------------------------------------------------------------------------
    @property
    def q(self) -> np.ndarray:
        """Joint positions (a copy)."""
        return self._q.copy()

    @property
    def dq(self) -> np.ndarray:
        """Joint velocities (a copy)."""
        return self._dq.copy()

    @property
    def target(self) -> np.ndarray:
        """The position target currently applied (a copy, clamped to limits)."""
        return self._target.copy()

    @property
    def t(self) -> float:
        """Simulated time since the last reset, in seconds."""
        return self.steps * self.dt

    def observation(self) -> np.ndarray:
        """Positions then velocities, float64 of length 2 * n_joints."""
        return np.concatenate([self._q, self._dq])

    def reset(self, q0=None, dq0=None) -> None:
        """Put the arm at ``q0`` (default: zeros, clamped into the limits), target = q0.

        ``dq0`` starts it moving (default: at rest), so a prediction can begin from a measured
        state. ValueError on a wrong size, NaN/Inf or ``q0`` outside the limits, state unchanged.
        """
        if q0 is None:
            q = np.clip(np.zeros(self.n), self.lower, self.upper)
        else:
            q = _vector(q0, self.n, "q0")
            if np.any(q < self.lower) or np.any(q > self.upper):
                raise ValueError(f"q0 outside the joint limits [{self.lower}, {self.upper}]: {q}")
        dq = np.zeros(self.n) if dq0 is None else _vector(dq0, self.n, "dq0")
        self._q = q
        self._dq = dq
        self._target = q.copy()
        self.steps = 0

    # -- dynamics ------------------------------------------------------------------------------
    def step(self, target) -> None:
        """Advance one ``dt`` toward ``target`` (n positions).

        ValueError on a wrong size or NaN/Inf, with the state unchanged.
        """
        tgt = _vector(target, self.n, "target")
        tgt = np.clip(tgt, self.lower, self.upper)
        acc = self.stiffness * (tgt - self._q) - self.damping * self._dq
        acc = np.clip(acc, -self.max_acc, self.max_acc)
        dq = np.clip(self._dq + acc * self.dt, -self.max_vel, self.max_vel)
        q = self._q + dq * self.dt
        below = q <= self.lower
        above = q >= self.upper
        q = np.clip(q, self.lower, self.upper)
        dq = np.where((below & (dq < 0)) | (above & (dq > 0)), 0.0, dq)
        self._q, self._dq, self._target = q, dq, tgt
        self.steps += 1

    # -- helpers -------------------------------------------------------------------------------
    def expert_action(self, goal, max_step: float = 0.05) -> np.ndarray:
        """``expert_action`` at the current state with this arm's limits."""
        return expert_action(self._q, self._dq, goal, max_step, lower=self.lower, upper=self.upper)

    def random_goal(
        self, rng: np.random.Generator | None = None, margin: float = 0.2
    ) -> np.ndarray:
        """A random goal inside this arm's limits (``rng`` defaults to the model's generator)."""
        return random_goal(self.rng if rng is None else rng, self.n, self.lower, self.upper, margin)
