"""Python's garbage collector and the control loop.

A collector pass runs in whichever thread's allocation triggers it and holds the GIL for its
whole length, so a pass that starts inside a control tick lengthens it (in the tick's thread) or
makes it wait (in another thread). `CollectorClock` counts and times the passes per thread, for
the account of an overrun (loop.ThreadUsage). `SlackCollector` (the `gc_in_slack` parameter)
runs the passes that are nearly due in the control thread's slack after a tick, when the time
left before the next tick holds one, so that an automatic pass seldom falls inside a tick.
"""

from __future__ import annotations

import gc
import threading
import time


class CollectorClock:
    """Python's garbage collector passes, counted by generation and timed, per thread that ran
    them (through gc.callbacks: a pass runs in whichever thread's allocation triggered it,
    holding the GIL). `totals(tid)`: ([passes of generation 0, 1, 2], seconds) of that thread,
    and of all threads."""

    def __init__(self) -> None:
        self._began: dict[int, float] = {}
        self._mine: dict[int, list] = {}  # thread id -> [gen 0, gen 1, gen 2 passes, seconds]
        self._all = [0, 0, 0, 0.0]

    def __call__(self, phase: str, info: dict) -> None:
        tid = threading.get_ident()
        if phase == "start":
            self._began[tid] = time.perf_counter()
            return
        began = self._began.pop(tid, None)
        if began is None:
            return
        took, gen = time.perf_counter() - began, min(2, max(0, info.get("generation", 0)))
        for rec in (self._mine.setdefault(tid, [0, 0, 0, 0.0]), self._all):
            rec[gen] += 1
            rec[3] += took

    def totals(self, tid: int) -> tuple[tuple, tuple]:
        return tuple(self._mine.get(tid, (0, 0, 0, 0.0))), tuple(self._all)

    @classmethod
    def installed(cls) -> CollectorClock:
        """The process's one clock, added to gc.callbacks on first use."""
        for cb in gc.callbacks:
            if isinstance(cb, cls):
                return cb
        clock = cls()
        gc.callbacks.append(clock)
        return clock


def passes_text(now: tuple, then: tuple) -> str:
    """The passes between two totals, in words."""
    d = [a - b for a, b in zip(now, then, strict=True)]
    n = d[0] + d[1] + d[2]
    if n == 0:
        return "none"
    top = max(g for g in range(3) if d[g])
    return f"{n} ({d[3] * 1e6:.0f} us, up to generation {top})"


class SlackCollector:
    """TimerLoop's idle work (control thread, after a tick): the collector pass that the next
    allocations would trigger anyway, now, when `deadline` leaves room for it.

    CPython starts a young (generation 0) pass once allocations outnumber deallocations by the
    first threshold (700), a generation-1 pass instead once more than ten young ones ran since
    the last, and a full one once more than ten generation-1 ones did (when enough survivors
    are pending). A pass is run here from
    half the first threshold on, of the generation that automatic one would have, provided its
    cost so far (the longest pass of that generation lately, decayed) fits before `deadline`
    with a margin; otherwise it is left to the collector, as without this."""

    MARGIN_S = 0.0001
    START_S = (50e-6, 200e-6, 2e-3)  # cost guesses before a pass of each generation was timed

    def __init__(self) -> None:
        self.cost = list(self.START_S)
        self.passes = [0, 0, 0]  # passes run here, by generation

    def due(self) -> int | None:
        """The generation a pass now would have, or None when none is near."""
        c0, c1, c2 = gc.get_count()
        t0, t1, t2 = gc.get_threshold()
        if not gc.isenabled() or t0 <= 0 or c0 < t0 // 2:
            return None
        if c1 > t1:  # as CPython picks it (less its rule of pending survivors for a full one)
            return 2 if c2 > t2 else 1
        return 0

    def idle(self, deadline: float) -> None:
        gen = self.due()
        if gen is None:
            return
        t0 = time.monotonic()
        if deadline - t0 < self.cost[gen] + self.MARGIN_S:
            return
        gc.collect(gen)
        took = time.monotonic() - t0
        self.cost[gen] = max(took, 0.95 * self.cost[gen])  # the long ones count, then fade
        self.passes[gen] += 1
