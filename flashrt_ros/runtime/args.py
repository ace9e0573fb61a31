"""Checks of the Engine's plain arguments: each returns the value or raises BadRequest naming it,
so a swapped or mistyped argument changes nothing (numpy scalars pass, bools are not ints)."""

from __future__ import annotations

import math

import numpy as np

from flashrt_ros.errors import BadRequest


def int_arg(x, what: str, lo: int, hi: int = 2**63 - 1) -> int:
    """An int (numpy ints too, bools not: True is no slot count) in [lo, hi]."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise BadRequest(f"{what} must be an integer, got {type(x).__name__} {x!r}")
    if not lo <= int(x) <= hi:
        raise BadRequest(f"{what} must be in [{lo}, {hi}], got {int(x)}")
    return int(x)


def bool_arg(x, what: str) -> bool:
    """A bool (numpy's too); 0/1 or "true" are refused so a swapped argument is caught."""
    if not isinstance(x, bool | np.bool_):
        raise BadRequest(f"{what} must be True or False, got {type(x).__name__} {x!r}")
    return bool(x)


def limit_arg(x) -> float:
    """obs_limit: a finite positive real number (strings and bools refused)."""
    if isinstance(x, bool | np.bool_) or not isinstance(x, int | float | np.integer | np.floating):
        raise BadRequest(f"obs_limit must be a number, got {type(x).__name__} {x!r}")
    v = float(x)
    if not math.isfinite(v) or v <= 0:
        raise BadRequest(f"obs_limit must be finite and > 0, got {v}")
    return v


def ref_arg(x, what: str) -> str:
    """A session or capsule reference: a non-empty string (a list or None is a bad request, not
    a TypeError from a dict lookup)."""
    if not isinstance(x, str) or not x:
        raise BadRequest(f"{what} must be a non-empty string, got {type(x).__name__} {x!r}")
    return x
