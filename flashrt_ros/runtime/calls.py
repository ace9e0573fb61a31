"""One call at a time into an Engine, whichever thread makes it.

A planner thread that checkpoints while another thread steps is how a Python user naturally
writes a robot program; unserialized, the checkpoint copied a state half way through a step (a
capsule that loads cleanly and continues wrongly) and a restore found the pool's bytes
"corrupted" while the step wrote them (a review's probe). Each public call now holds the
engine's own re-entrant lock, so it runs whole, between two steps: a commit boundary, as the
API says. The node serializes its calls with a lock of its own (for timing: node/loop.py), so
there this lock is never contended. The cost is one uncontended RLock and a wrapper per call:
0.49 us more than a plain method call on the 2-core CPU machine (ad hoc timeit, not committed).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable


def serialize_calls(cls: type, names: Iterable[str]) -> type:
    """Wrap each method `names` of `cls` (its own or inherited) to run under `self._calls`."""
    for name in names:
        fn = getattr(cls, name)

        def held(fn=fn):
            @functools.wraps(fn)
            def call(self, *args, **kwargs):
                with self._calls:
                    return fn(self, *args, **kwargs)

            return call

        setattr(cls, name, held())
    return cls
