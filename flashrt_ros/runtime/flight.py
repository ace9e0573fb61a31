"""The flight recorder: a device ring of a session's past states, written inside the step.

When a learned policy misbehaves on a robot, the state it acted from is what one needs, and
by the time anybody asks it has been stepped over. A capsule is one device copy, so keeping
one per tick is affordable: slot `step % N` of the ring receives the whole arena at the start
of every step, as a node of the captured step whose slot comes from the step counter on the
device (no host work, no extra launch, sync or allocation per tick). On CUDA that node is our
own copy kernel (cuda/ring.py), running beside the input uploads; on the CPU, and where the
kernel cannot be built, it is `record` below, inside the step function. Recording the state a
step *starts* from, rather than the one it ends with, means the ring holds exactly what the
next step saw, commit-boundary edits included (a goal swapped between two steps): a rewind
then continues bit for bit. The state after the latest step is the arena itself.

The host only keeps `lo`, the oldest step of the session's current line of steps (a restore,
branch or reset starts a new line): which steps are held follows from it, the ring size and
the session's step count, so nothing is tracked per tick.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from flashrt_ros.cuda.copy import copy_bytes
from flashrt_ros.errors import BadRequest, UnknownReference


def check_ticks(x: object) -> int:
    """flight_ticks: an int >= 0 (bools refused: True is no ring size)."""
    if isinstance(x, bool | np.bool_) or not isinstance(x, numbers.Integral):
        raise BadRequest(f"flight_ticks must be an integer >= 0, got {type(x).__name__} {x!r}")
    if int(x) < 0:
        raise BadRequest(f"flight_ticks must be >= 0 (0 = off), got {int(x)}")
    return int(x)


def check_int(x: object, what: str) -> int:
    """A step count or step number: an int (numpy ints too), never a bool or a string."""
    if type(x) is int:  # the usual case, without the ABC check (a rewind is on a planner's path)
        return x
    if isinstance(x, bool | np.bool_) or not isinstance(x, numbers.Integral):
        raise BadRequest(f"{what} must be an integer, got {type(x).__name__} {x!r}")
    return int(x)


def record(ring: torch.Tensor, buf: torch.Tensor, step: torch.Tensor) -> None:
    """ring[step % N] <- buf with torch ops, the slot computed from the tensor: capturable (no
    host sync, no Python branch on a tensor) and traceable by inductor. The CPU path and the
    fallback of cuda/ring.py. The arena is moved as int64 words: eight times fewer elements."""
    ring.index_copy_(0, step % ring.shape[0], buf.view(ring.dtype).view(1, -1))


class FlightRing:
    """N arena-sized device slots of one session, allocated once, before the step is captured."""

    def __init__(self, ticks: int, nbytes: int, device: torch.device):
        if nbytes % 8:
            raise ValueError(f"arena size {nbytes} is not a whole number of 8-byte words")
        self.ticks = int(ticks)
        self.nbytes = int(nbytes)
        # int64 words for the captured write; `rows` are the same bytes for copies and capsules
        self.words = torch.zeros((self.ticks, nbytes // 8), dtype=torch.int64, device=device)
        self.rows = self.words.view(torch.uint8)
        self._slots = list(self.rows)  # one view per slot, made once: indexing costs ~1 us a call
        self.lo = 0  # oldest step of the current line of steps

    @property
    def bytes(self) -> int:
        return self.ticks * self.nbytes

    def held(self, current: int) -> range:
        """The steps whose state is held: the ring's, then `current` (the arena itself)."""
        return range(max(self.lo, current - self.ticks + 1), current + 1)

    def restart(self, current: int) -> None:
        """A new line of steps starts at `current`: older slots belong to another history."""
        self.lo = current

    def row(self, step: int) -> torch.Tensor:
        """The slot holding the state a step started from, i.e. the state after `step`."""
        return self._slots[step % self.ticks]

    def rewind(self, step: int, current: int, buf: torch.Tensor) -> None:
        """buf <- the state after `step` (< current), one copy; the steps older than `step`
        stay held, the newer ones are gone (the next steps overwrite their slots)."""
        self.lo = self.held(current).start
        # the same path as a restore (a cached one-node graph per buffer pair, at a third of the
        # host cost of issuing the copy directly): rewinds are rare, and the graph cache is LRU
        # bounded, so the slots a planner rewinds to stay cheap without crowding anything out
        copy_bytes(buf, self.row(step))


def require_past(held: range, session: str, ticks: int) -> None:
    """BadRequest when the session holds only its current step (a fresh session or branch, or
    a ring of one tick): there is nothing to go back to, whatever was asked."""
    if len(held) == 1:
        raise BadRequest(
            f"session {session!r} holds only its current step {held.start}: nothing to rewind "
            + (
                "to with flight_ticks 1 (keep at least 2)"
                if ticks == 1
                else "to until it has stepped"
            )
        )


def held_step(held: range, step: object, session: str) -> int:
    """`step` if the recorder holds it, else UnknownReference saying which steps it holds."""
    t = check_int(step, "step")
    if t not in held:
        raise UnknownReference(
            f"step {t} is not recorded for session {session!r}: it holds steps "
            f"{held.start}..{held.stop - 1}"
        )
    return t


def nonfinite_regions(buf: torch.Tensor, table: tuple) -> list[str]:
    """Names of the floating-point regions of an arena image (`buf`, uint8) holding NaN/Inf,
    with one small readback; `table` is Session.table (name, dtype, shape, offset, nbytes)."""
    names, checks = [], []
    for name, dtype, _shape, off, n in table:
        if dtype.is_floating_point:
            names.append(name)
            checks.append(torch.isfinite(buf[off : off + n].view(dtype)).all())
    if not checks:
        return []
    ok = torch.stack(checks).cpu().tolist()
    return [n for n, good in zip(names, ok, strict=True) if not good]
