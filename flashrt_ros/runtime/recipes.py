"""Compositions of the Engine's verbs that tests, benchmarks and tools use; the Engine stays
small because these live here.

`restore_regions` is the KV-only ablation of the capsules paper ("Execution-State Capsules",
arXiv 2606.20537): restoring only part of the arena is never a valid continuation, and showing
that it diverges is what proves the recurrent state load-bearing.
"""

from __future__ import annotations

from flashrt_ros.capsules.info import CapsuleInfo
from flashrt_ros.runtime.engine import Engine


def rollback(engine: Engine, session: str = "main", verify: bool = True) -> CapsuleInfo:
    """Restore the newest capsule taken from `session`."""
    engine.session(session)
    mine = [c for c in engine.capsules() if c.session == session]
    if not mine:
        raise ValueError(f"session {session!r} has no capsule to roll back to")
    newest = max(mine, key=lambda c: (c.stamp, c.step))
    return engine.restore(newest.id, session, verify)


def restore_regions(engine: Engine, capsule: str, session: str, roles: tuple[str, ...]) -> None:
    """Copy back only the arena regions whose role is in `roles` (e.g. ("kv",))."""
    s = engine.session(session)
    src = engine.pool.source(engine.pool.get(capsule))
    for row in engine.layout:
        if row["role"] in roles:
            a, b = row["offset"], row["offset"] + row["nbytes"]
            s.arena.buf[a:b].copy_(src[a:b])
