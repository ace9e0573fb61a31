"""Late fusing: serve the eager kernels from the first tick, swap the compiled step in later.

Loading the compiled (fused) step is most of a warm start: dynamo traces the step again and
inductor loads its kernels, seconds where a captured graph of the eager kernels takes a few
hundred milliseconds (README, "Benchmarks"). With late fusing the Engine builds every session
over the eager kernels, captured as usual, and serves them at once. Once the first step is
done (so the first command never shares the GIL with a compile), a thread of its own builds the
compiled step:

1. it builds a probe session (or two: with and without a flight ring, which compile apart) with
   the compiled step, on its own arena: this compiles or loads the step, checks it against the
   eager step (fusecheck.py) and warms it up, as a fused Engine does for its first session;
2. it captures the compiled step over each live session's buffers without running anything
   (Session.prepare_plans): another thread may be stepping them meanwhile;
3. the thread that steps swaps all of them in at the next commit boundary (Engine._tick), with
   a few pointer assignments. Sessions made after that are built fused.

On CUDA all of the thread's device work runs on a stream of its own. Every capture is
thread-local, yet a device-wide sync in another thread still ends it, and compiling syncs the
device (inductor's benchmarks): so the thread holds the process's CAPTURE_LOCK
(cuda/graphs.py) for its whole run, every other capture takes it too, a new session waits for
the build (Engine._new_session), and a copy or checksum graph met for the first time meanwhile
is issued directly instead of captured. The loop's replays, event waits and copies are safe
beside the thread's captures.
If the check finds the compiled step different, or building it fails, nothing is swapped: the
eager kernels stay in service, and `why_not` says why.

What it costs: the thread shares the GIL and the device with the control loop while it works,
so ticks in those seconds can come late (build_window keeps the collector's full passes off and
the GIL changing hands often meanwhile); and a state stepped before the swap continues after
it with the fused kernels, whose floats may differ from the eager ones by reassociation (the
check's tolerance), so a capsule taken before the swap and restored after it continues within
that tolerance, not bit for bit. Capsules taken after the swap continue bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch

from flashrt_ros.cuda.graphs import CAPTURE_LOCK
from flashrt_ros.runtime.session import PlanSet, Session
from flashrt_ros.scheduling import current_scheduling

log = logging.getLogger(__name__)


# While a build runs, Python hands the GIL over at least this often (its default is 5 ms): the
# build thread imports and compiles in pure Python, so a stepping thread waits about this long
# for the GIL per request instead of up to 5 ms, and the build itself, which gives the GIL up at
# each of its thousands of file reads, gets it back as soon (a Python loop polling beside it
# with the default interval starved a build on the H200 for over 60 s: gil_gap_probe.py).
SWITCH_S = 0.0002

_window_lock = threading.Lock()
_window: dict = {"builds": 0, "thresholds": None, "switch_s": None}  # before the first build


@contextlib.contextmanager
def build_window():
    """What the process runs under while a build is under way: the GIL changes hands every
    SWITCH_S, and no full (generation 2) collection runs. (Counted, though the capture lock
    has two Engines' builds run one after the other.)

    Compiling imports the compiler stack: some 200k new objects. A full collection walks them
    all while holding the GIL, 80-200 ms in one piece (gil_gap_probe.py found the build's
    longest stalls of the stepping thread to be exactly these passes). Young collections stay
    on (a few ms at most, and they bound the garbage); at the end the young generations are
    collected and everything is frozen (gc.freeze), so the next full pass does not walk the
    compiler either. The freeze takes the whole heap: what cyclic garbage reached the old
    generation (about 1.5k objects from a build, ad hoc on the CPU) stays until gc.unfreeze()
    and a collection (the node's cleanup does both). The switch interval and the thresholds
    come back as they were once the last build ends. threshold2 = 2**30 keeps the generational
    collector of CPython 3.11 and 3.12 (here and on the GPU machine) from any full pass; a later
    collector may read the thresholds otherwise."""
    with _window_lock:
        if _window["builds"] == 0:
            _window["thresholds"] = gc.get_threshold()
            young, middle = _window["thresholds"][:2]
            gc.set_threshold(young, middle, 1 << 30)  # full passes only after 2**30 middle ones
            _window["switch_s"] = sys.getswitchinterval()
            sys.setswitchinterval(min(_window["switch_s"], SWITCH_S))
        _window["builds"] += 1
    try:
        yield
    finally:
        with _window_lock:
            _window["builds"] -= 1
            if _window["builds"] == 0:
                gc.collect(1)
                gc.freeze()
                gc.set_threshold(*_window["thresholds"])
                sys.setswitchinterval(_window["switch_s"])


class LateFuse:
    """One background build of the compiled step for an Engine's sessions.

    `probe(ticks, check)` builds a fused session on an arena of its own with a flight ring of
    `ticks` states, checked against the eager step when `check`; `sessions()` lists the live
    sessions."""

    def __init__(
        self,
        probe: Callable[[int, bool], Session],
        sessions: Callable[[], list[Session]],
        flight_ticks: int,
        device: torch.device,
    ):
        self._probe, self._sessions = probe, sessions
        self._device = torch.device(device)
        # The compiled variants the sessions need: user sessions have a ring of flight_ticks,
        # internal ones none. On the CPU the ring is an argument of the compiled step, so each
        # size is a variant (the live one first: it is the one checked). On CUDA the ring is
        # written by its own kernel outside the compiled step, so a 2-state ring builds the
        # same variant without a second copy of a large ring.
        cuda = self._device.type == "cuda"
        live = min(flight_ticks, 2) if cuda else flight_ticks
        self._ticks = [live] + ([0] if flight_ticks and not cuda else [])
        self.fused = None  # the compiled step, as Session.prepare_plans takes it
        # per live session (by name) its fused plans: every session there is when the build
        # ends, since a new one waits for the build (Engine._new_session)
        self.prepared: dict[str, PlanSet] = {}
        self.ready = False  # built and checked: the plans can be swapped in
        self.why_not = ""  # why nothing will be swapped in ("" while building or when ready)
        self.mismatch = ""  # the check's finding, when it found the fused step different
        self.done = threading.Event()  # ready, or given up
        self.cancelled = threading.Event()  # cancel(): stop at the next phase
        self.started: float | None = None  # when start() began the build (monotonic)
        self.built_s = 0.0
        self._thread = threading.Thread(target=self._run, name="flashrt-fuse", daemon=True)
        self._lock = threading.Lock()  # start() against cancel()
        # the CPUs of the thread that builds the engine (configure's): the stepping thread that
        # start()s the build may be pinned and real-time, and a new thread inherits both
        self._cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        # and its scheduling (an operator's chrt --idle or --batch stays the build's too)
        self._sched = current_scheduling()

    def start(self) -> None:
        """Begin the build (once; nothing after a cancel)."""
        with self._lock:
            if self.started is not None or self.done.is_set():
                return
            self.started = time.monotonic()
            try:
                self._thread.start()
            except RuntimeError as e:  # no thread to be had: nothing will be built
                self.why_not = f"no build thread: {e}"
                self.done.set()
                log.error("late fusing: %s; serving the eager kernels", self.why_not)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the build ended (ready or given up); False on timeout."""
        return self.done.wait(timeout)

    def cancel(self) -> None:
        """Give up at the next phase (a compile under way runs to its end); a build not begun
        yet ends at once."""
        with self._lock:
            self.cancelled.set()
            if self.started is None:
                self.why_not = "cancelled"
                self.done.set()

    def _plain_scheduling(self) -> None:
        """The engine builder's scheduling and CPUs for this thread: the compile (and the
        workers it forks) must not run at the control thread's SCHED_FIFO priority on its CPU,
        where it would stall the loop for the whole build. The builder's, not SCHED_OTHER: a
        node started under SCHED_IDLE or SCHED_BATCH would otherwise compile at normal
        priority."""
        try:
            if self._sched is not None and os.sched_getscheduler(0) != self._sched[0]:
                os.sched_setscheduler(0, self._sched[0], os.sched_param(self._sched[1]))
            if self._cpus is not None and os.sched_getaffinity(0) != self._cpus:
                os.sched_setaffinity(0, self._cpus)
        except OSError as e:  # not allowed here: the build still runs
            log.warning("late fusing: the build thread keeps its creator's scheduling: %s", e)

    def _run(self) -> None:
        self._plain_scheduling()
        try:
            cuda = self._device.type == "cuda"
            stream = torch.cuda.Stream(self._device) if cuda else None
            where = torch.cuda.stream(stream) if cuda else contextlib.nullcontext()
            with CAPTURE_LOCK, build_window(), where, torch.no_grad():
                self._build()
                if cuda:
                    stream.synchronize()
        except Exception as e:  # noqa: BLE001 - the eager kernels stay in service
            self.ready = False
            self.why_not = f"building it failed: {type(e).__name__}: {e}".splitlines()[0][:400]
            log.exception("the compiled step was not built in the background; serving eager")
        self.built_s = time.monotonic() - self.started
        self.done.set()

    def _build(self) -> None:
        for i, ticks in enumerate(self._ticks):
            if self._cancelled():
                return
            probe = self._probe(ticks, i == 0)  # compiled, checked (the first), captured
            self.fused = probe.fused_fn
            if probe.fused_mismatch:
                self.mismatch = probe.fused_mismatch
                self.why_not = f"the fused step differed: {probe.fused_mismatch}"
                return
            if not probe.plan.use_graph:  # nothing captured: run it once, so it is compiled
                probe.warm_fused()
            del probe
        if self._cancelled():
            return
        prepared = {s.name: s.prepare_plans(self.fused) for s in self._sessions()}
        self.prepared, self.ready = prepared, True

    def _cancelled(self) -> bool:
        if self.cancelled.is_set():
            self.why_not = "cancelled"
        return self.cancelled.is_set()
