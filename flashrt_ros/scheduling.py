"""The calling thread's scheduling, for threads that must be given it back.

A new thread inherits its creator's policy, and the thread that steps may run under SCHED_FIFO.
The threads it starts or lends out (the services' thread, the late-fuse build) are put back to
the scheduling the process or the engine's builder had, not to SCHED_OTHER: an operator's
`chrt --idle` or `--batch` then holds for every thread. Both the core (runtime/latefuse.py) and
the node (node/loop.py) use it, so it imports neither.
"""

from __future__ import annotations

import os


def current_scheduling() -> tuple[int, int] | None:
    """(policy, priority) of the calling thread; None where the OS has no such calls."""
    if not hasattr(os, "sched_getscheduler"):
        return None
    return os.sched_getscheduler(0), os.sched_getparam(0).sched_priority
