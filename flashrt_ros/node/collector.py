"""Python's garbage collector, seen from the control loop.

A collector pass runs in whichever thread's allocation triggers it and holds the GIL for its
whole length, so a pass that starts inside a control tick lengthens it (in the tick's thread) or
makes it wait (in another thread). `CollectorClock` counts and times the passes per thread, for
the account of an overrun (loop.ThreadUsage) and the node's count of overruns that held one.
On the H200 machine (2698e7c, two 60 s runs at 1 kHz) none of the 9 overrun accounts that
/diagnostics showed (of 52 overruns) held a pass; on the CPU machine a node stepping at 200 Hz
for 3.5 s never brought one near due (ad hoc), its ticks allocating and freeing in balance. A
hook that ran the due passes between ticks (`gc_in_slack`) was measured there and removed.
"""

from __future__ import annotations

import gc
import threading
import time

_INSTALL = threading.Lock()


class CollectorClock:
    """Python's garbage collector passes, counted by generation and timed, per thread that ran
    them (through gc.callbacks: a pass runs in whichever thread's allocation triggered it,
    holding the GIL). `totals(tid)`: ([passes of generation 0, 1, 2], seconds) of that thread,
    and of all threads."""

    def __init__(self) -> None:
        self._began: float | None = None  # the running pass's start (passes never overlap)
        self._mine: dict[int, list] = {}  # thread id -> [gen 0, gen 1, gen 2 passes, seconds]
        self._all = [0, 0, 0, 0.0]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        began, self._began = self._began, None
        if began is None:  # the clock was installed during this pass
            return
        tid = threading.get_ident()
        took, gen = time.perf_counter() - began, min(2, max(0, info.get("generation", 0)))
        for rec in (self._mine.setdefault(tid, [0, 0, 0, 0.0]), self._all):
            rec[gen] += 1
            rec[3] += took

    def totals(self, tid: int) -> tuple[tuple, tuple]:
        return tuple(self._mine.get(tid, (0, 0, 0, 0.0))), tuple(self._all)

    @classmethod
    def installed(cls) -> CollectorClock:
        """The process's one clock, added to gc.callbacks on first use."""
        with _INSTALL:
            for cb in gc.callbacks:
                if isinstance(cb, cls):
                    return cb
            clock = cls()
            gc.callbacks.append(clock)
            return clock


def passes(now: tuple, then: tuple) -> int:
    """How many passes ran between two totals."""
    return sum(now[g] - then[g] for g in range(3))


def passes_text(now: tuple, then: tuple) -> str:
    """The passes between two totals, in words."""
    n = passes(now, then)
    if n == 0:
        return "none"
    top = max(g for g in range(3) if now[g] > then[g])
    return f"{n} ({(now[3] - then[3]) * 1e6:.0f} us, up to generation {top})"
