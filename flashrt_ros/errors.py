"""The errors the core raises, so a caller can tell a bad request from a fault.

Every bad request is a `ValueError` and every capacity limit a `RuntimeError`, as before this
module existed, so code that catches those keeps working. A bad request changes nothing. A
`StepFault` is not the caller's fault: the step ran and produced something that must not reach
a robot (a NaN or Inf action), or the device failed (CUDA error, out of memory).
"""

from __future__ import annotations

SHOWN_CHARS = 80  # of a name or reference echoed in an error


def shown(x: object) -> str:
    """repr(x) for an error message, a long string cut to its first SHOWN_CHARS characters: a
    client that sends a 10 kB name gets a readable reply, and the node's log does not grow by
    10 kB a refusal."""
    if isinstance(x, str) and len(x) > SHOWN_CHARS:
        return f"{x[:SHOWN_CHARS]!r}... ({len(x)} characters)"
    return repr(x)


class FlashrtError(Exception):
    """Base of every error flashrt_ros raises on purpose."""


class BadRequest(FlashrtError, ValueError):
    """The arguments are wrong (type, shape, range, NaN); nothing was changed."""


class UnknownReference(BadRequest):
    """No capsule, session or recorded step by that id or name."""


class BadName(BadRequest):
    """A capsule or session name outside the allowed pattern, reserved, or already taken."""


class CorruptCapsule(BadRequest):
    """A capsule (in the pool or in a file) whose bytes or fields fail their checks."""


class FingerprintMismatch(BadRequest):
    """A capsule of another policy, weights, state layout or device."""


class DiskError(BadRequest):
    """capsule_dir refused a write (full, read-only, no permission): the operator's to fix.
    Counted apart from refused requests (a name taken meanwhile is no trouble of the disk)."""


class CapacityError(FlashrtError, RuntimeError):
    """A bound is reached: the pool is full of pinned capsules, or max_sessions sessions exist."""


class StepFault(FlashrtError, RuntimeError):
    """A step failed or produced a non-finite action; the session is poisoned until a restore,
    a branch or a reset."""
