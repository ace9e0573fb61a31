"""The Engine's flight-recorder verbs: what a session holds, rewind, and a recorded step made a
capsule or a file. The ring itself is in flight.py and session.py.

A mixin of Engine (engine.py), split out so that each file holds one subject; like every Engine
method each verb runs between two steps, at a commit boundary.
"""

from __future__ import annotations

import time
from pathlib import Path

from flashrt_ros.capsules.checksum import device_checksum, to_hex
from flashrt_ros.capsules.info import CapsuleInfo
from flashrt_ros.capsules.names import check_capsule_name
from flashrt_ros.capsules.pool import CapsulePool
from flashrt_ros.capsules.store import CapsuleStore
from flashrt_ros.errors import BadName, BadRequest, UnknownReference, shown
from flashrt_ros.runtime.args import bool_arg
from flashrt_ros.runtime.flight import (
    check_int,
    held_step,
    nonfinite_regions,
    require_past,
)
from flashrt_ros.runtime.session import Session


class FlightVerbs:
    """Engine's flight-recorder verbs (the Engine sets up every attribute named here)."""

    flight_ticks: int
    state_nbytes: int
    pool: CapsulePool
    store: CapsuleStore
    _sessions: dict[str, Session]
    _poison: dict[str, str]

    def _flight_session(self, session: str) -> Session:
        """A user session (UnknownReference for an internal one: it has no ring)."""
        if isinstance(session, str) and session.startswith("_"):
            raise UnknownReference(
                f"unknown session {shown(session)} (sessions: {', '.join(self.sessions())})"
            )
        return self.session(session)

    def flight(self, session: str = "main") -> list[int]:
        """The steps whose state the session holds, oldest first; the last is the current step.
        With `flight_ticks`=N: the last N states of the session's current line of steps (a
        restore, branch, copy or reset starts a new line; a rewind keeps the older steps).
        With flight_ticks=0 only the current state."""
        return list(self._flight_session(session).flight_steps())

    def rewind(self, k: int, session: str = "main") -> int:
        """Bring the session back to its state k steps ago (1 <= k <= len(flight()) - 1) with one
        device copy from its flight ring, and clear a poison: that state stepped cleanly. The
        same observations then give bit-identical actions. Returns the step it landed at."""
        s = self._flight_session(session)
        k = check_int(k, "k")
        if s.flight is None:
            raise BadRequest("the flight recorder is off: create the Engine with flight_ticks > 0")
        held = s.flight_steps()
        require_past(held, s.name, self.flight_ticks)
        if not 1 <= k <= len(held) - 1:
            raise BadRequest(
                f"cannot rewind {k} step(s): session {s.name!r} holds steps "
                f"{held.start}..{held.stop - 1}, so k must be in [1, {len(held) - 1}]"
            )
        s.rewind_to(s.steps - k)
        self._poison.pop(s.name, None)
        return s.steps

    def checkpoint_at(
        self, step: int, session: str = "main", name: str | None = None, pin: bool = False
    ) -> CapsuleInfo:
        """Freeze a recorded step into an ordinary pool capsule (one device copy from its ring
        slot), so restore, branch and save_capsule work on it as on any checkpoint. Like
        checkpoint(), a state holding NaN/Inf is refused: the pool only holds finite states."""
        s = self._flight_session(session)
        t = held_step(s.flight_steps(), step, s.name)
        if t == s.steps:  # the current state: exactly a checkpoint
            return self.checkpoint(s.name, name=name, pin=pin)
        if name is not None and not isinstance(name, str):
            raise BadName(f"capsule name must be a string or None, got {name!r}")
        pin = bool_arg(pin, "pin")
        self._check_new_name(name or "")  # a name held by a file or a persist being written
        src = s.flight_state(t)
        bad = nonfinite_regions(src, s.table)
        if bad:
            raise BadRequest(
                f"step {t} of session {s.name!r} holds NaN or Inf in {', '.join(bad)}; "
                "refusing to checkpoint it (save_flight_step writes it to a file)"
            )
        cap = self.pool.put(
            src, name=name or "", session=s.name, parent_id=s.parent_id, step=t, pinned=pin
        )
        self._report_evictions()
        return self.pool.info(cap)

    def save_flight_step(self, step: int, path: str | Path, session: str = "main") -> Path:
        """Write one recorded step of a session to a capsule file (the usual format, checksum and
        fingerprint; id "<session>-<step>", which load_capsule replaces with a fresh capsule id),
        without touching the pool. Non-finite states are written too: the state a misbehaving
        policy acted from is what one wants to look at."""
        s = self._flight_session(session)
        t = held_step(s.flight_steps(), step, s.name)
        src = s.flight_state(t)
        info = CapsuleInfo(
            id=check_capsule_name(f"{s.name}-{t}"),
            name="",
            session=s.name,
            parent_id=s.parent_id,
            step=t,
            nbytes=self.state_nbytes,
            tier="disk",
            checksum=to_hex(device_checksum(src)),
            pinned=False,
            stamp=time.time(),
        )
        return self.store.write(path, info, src)

    def flight_bytes(self) -> int:
        """Device bytes held by the flight rings of all sessions."""
        return sum(s.flight.bytes for s in self._sessions.values() if s.flight is not None)
