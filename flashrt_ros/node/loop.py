"""The timer-trigger control loop (a dedicated thread with absolute deadlines, no drift) and the
engine lock that lets it go first."""

from __future__ import annotations

import contextlib
import math
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from flashrt_ros.errors import CapacityError
from flashrt_ros.node.collector import CollectorClock, passes, passes_text
from flashrt_ros.scheduling import current_scheduling

# The last 200 us before a deadline are busy-waited: a sleep overshoots. The spin keeps the GIL
# (no sleep(0)): yielding it lets rclpy's executor thread take it, and getting it back can then
# take up to a whole switch interval, right at the deadline. The control thread's timer slack
# is also 1 ns (Linux's default, 50 us, is added to every sleep). A 100 us spin was tried with
# it: on the H200 machine the node's period jitter p99 at 500 Hz went from 31 to 118 us (191 us
# with a publish offset), the wake-ups from a longer idle overshooting past it; at 1 kHz it
# stayed at 0.2 us.
SPIN_S = 0.0002
PR_SET_TIMERSLACK = 29
PR_SET_NAME = 15
OS_NAME_BYTES = 15  # the kernel keeps 16 bytes of a thread's name, with its NUL


def _prctl(option: int, arg) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux, or no prctl
        return False


class ThreadUsage:
    """What the calling thread did since `mark()`: its CPU time, context switches and page
    faults, and the garbage collector's passes in it and in the other threads, for a tick that
    overran. A long tick that computed all along has its CPU time near its wall time; one whose
    thread was preempted shows involuntary switches; one that waited (for the GIL, a lock, a
    sleep) shows voluntary switches and little CPU time; a collector pass in the tick's thread is
    CPU time of its own, one in another thread a wait for the GIL. It covers the tick only, from
    its mark: what made a wake-up late (the wait before the mark) is not in it. A mark costs a
    clock read, one getrusage call (Linux RUSAGE_THREAD; elsewhere, the CPU time alone) and a
    copy of the collector's totals; each collector pass costs two calls of CollectorClock."""

    _WHO = getattr(resource, "RUSAGE_THREAD", None)

    def __init__(self) -> None:
        self._cpu: float | None = None  # the thread's CPU time at the last mark
        self._ru = None
        self._gc = CollectorClock.installed()
        self._gc_then: tuple = ((0, 0, 0, 0.0), (0, 0, 0, 0.0))

    def mark(self) -> None:
        self._cpu = time.thread_time()
        self._ru = resource.getrusage(self._WHO) if self._WHO is not None else None
        self._gc_then = self._gc.totals(threading.get_ident())

    def collector_passes(self) -> int:
        """The collector's passes in any thread since the last mark (0 before any mark)."""
        if self._cpu is None:
            return 0
        return passes(self._gc.totals(threading.get_ident())[1], self._gc_then[1])

    def since(self) -> str:
        """Since the last mark, on the same thread; "" before any mark."""
        if self._cpu is None:
            return ""
        cpu_us = (time.thread_time() - self._cpu) * 1e6
        text = f"on its CPU {cpu_us:.0f} us"
        if self._ru is not None:
            ru, r0 = resource.getrusage(self._WHO), self._ru
            faults = ru.ru_minflt - r0.ru_minflt + ru.ru_majflt - r0.ru_majflt
            text += (
                f", {ru.ru_nivcsw - r0.ru_nivcsw} involuntary and {ru.ru_nvcsw - r0.ru_nvcsw} "
                f"voluntary context switches, {faults} page faults"
            )
        (mine, every), (mine0, every0) = self._gc.totals(threading.get_ident()), self._gc_then
        others = tuple(a - b for a, b in zip(every, mine, strict=True))
        others0 = tuple(a - b for a, b in zip(every0, mine0, strict=True))
        text += (
            f"; collector passes in it {passes_text(mine, mine0)}, "
            f"in other threads {passes_text(others, others0)}"
        )
        return text


def precise_sleeps() -> bool:
    """Set the calling thread's timer slack to 1 ns (Linux prctl); False where not possible."""
    return _prctl(PR_SET_TIMERSLACK, 1)


def os_thread_name(name: str) -> str:
    """The kernel's name for a thread called `name`: itself when it fits in 15 bytes, else
    "frt-" for "flashrt-" and the rest cut (flashrt-services: frt-services)."""
    if len(name.encode()) > OS_NAME_BYTES and name.startswith("flashrt-"):
        name = "frt-" + name[len("flashrt-") :]
    return name.encode()[:OS_NAME_BYTES].decode(errors="ignore")


def name_os_thread() -> bool:
    """Give the calling thread its Python name in the kernel too (Linux prctl; Python 3.14
    does it itself), so `top -H`, `ps -L` and /proc/PID/task/*/comm tell the control thread,
    the services' and the inputs' apart; False where not possible."""
    name = os_thread_name(threading.current_thread().name).encode()
    return _prctl(PR_SET_NAME, name)


# The scheduling this process was started with (policy, priority), taken when the node starts:
# what set_realtime(t, 0) puts back (an operator's chrt --idle or --batch stays the threads').
PROCESS_SCHED = current_scheduling()


def set_realtime(thread: threading.Thread | None, priority: int) -> str:
    """Give a started thread SCHED_FIFO at `priority` (the `realtime_priority` parameter), or,
    with priority 0, the process's own scheduling back (a new thread inherits its creator's
    policy): "" when done, else why not (no permission, not Linux). A FIFO thread runs before
    any normally scheduled one the moment it wakes, so another process's thread cannot delay a
    tick; the kernel's real-time throttling still leaves the others 5 % of each CPU."""
    tid = getattr(thread, "native_id", None)
    if not hasattr(os, "SCHED_FIFO") or tid is None or PROCESS_SCHED is None:
        return "SCHED_FIFO is not available here"
    policy, priority = (os.SCHED_FIFO, priority) if priority > 0 else PROCESS_SCHED
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(priority))
    except OSError as e:
        return f"{e.strerror} (needs CAP_SYS_NICE or `ulimit -r` >= {priority})"
    return ""


# The CPUs this process may use, taken when the node starts: what a thread pinned by
# `cpu_affinity` hands on to a thread it starts is put back to this (set_affinity(t, None)).
PROCESS_CPUS = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def set_affinity(thread: threading.Thread | None, cpus: frozenset[int] | None) -> str:
    """Keep a started thread on `cpus` (the `cpu_affinity` parameter), or, with None, let it
    run on every CPU of the process again (a new thread inherits its creator's CPUs): "" when
    done, else why not (CPUs the process may not use, not Linux)."""
    tid = getattr(thread, "native_id", None)
    if PROCESS_CPUS is None or tid is None:
        return "CPU affinity is not available here"
    want = PROCESS_CPUS if cpus is None else cpus
    outside = sorted(want - PROCESS_CPUS)
    if outside:
        return (
            f"CPUs {outside} are not among the {len(PROCESS_CPUS)} this process may use "
            f"({','.join(map(str, sorted(PROCESS_CPUS)))})"
        )
    try:
        if os.sched_getaffinity(tid) == want:  # nothing to change: the thread is left alone
            return ""
        os.sched_setaffinity(tid, want)
    except OSError as e:
        return e.strerror or str(e)
    return ""


def throttle_note(
    priority: int, busy: bool, runtime_path: str = "/proc/sys/kernel/sched_rt_runtime_us"
) -> str:
    """Why `realtime_priority` and `busy_wait` together stall the loop here, or "": a SCHED_FIFO
    thread that never sleeps is taken off its CPU by the kernel's real-time throttling for what
    sched_rt_runtime_us leaves of each sched_rt_period_us (50 ms of every second by default)."""
    if priority <= 0 or not busy:
        return ""
    try:
        runtime = int(Path(runtime_path).read_text())
        period = int(Path(runtime_path).with_name("sched_rt_period_us").read_text())
    except (OSError, ValueError):  # not Linux: no such throttling to warn about
        return ""
    if runtime < 0 or runtime >= period:
        return ""
    return (
        f"realtime_priority with busy_wait: the kernel throttles a real-time thread that never "
        f"sleeps to {runtime} us of every {period} us (sched_rt_runtime_us), so the loop stalls "
        f"for {(period - runtime) / 1000:g} ms each {period / 1e6:g} s; set "
        "kernel.sched_rt_runtime_us=-1, or use only one of the two"
    )


class EngineLock:
    """The lock every Engine call holds, with the control loop first.

    `with lock:` is the foreground: control ticks and short service requests. `background(cost)`
    is for long work done in steps (rollouts): each step waits until no foreground caller is
    waiting and the next timer tick is not due within `cost` seconds, so the loop keeps its rate
    whatever a rollout asks. (A plain Lock is not enough: a thread that releases and re-acquires
    it at once usually wins, and the tick would wait for the whole rollout.) When no such room
    comes for a few periods (a slow or busy machine), a step may delay the next tick, but only
    so far that the tick still ends before the deadline after it: late, never lost.
    """

    MARGIN_S = 0.0003  # besides the step's cost: the loop's wake-up and spin before a deadline
    PATIENCE = 3  # periods without room before a step may delay (never skip) a tick

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._waiting = 0  # foreground callers waiting for the lock
        self._gen = 0  # bumped at each foreground release and each new deadline
        self.next_tick: float | None = None  # the timer loop's next deadline (None: no loop)
        self.period = 0.0
        self.tick_s = 0.0  # how long a tick takes (a running mean, from the loop)
        self._slow = False  # the holder waited for the lock (its release must wake waiters)
        # when the holder took it (monotonic), for within()'s callers; inf while free, so a
        # holder that has not set it yet is never taken for one stuck since an old time
        self.held_since = math.inf

    def _take(self, timeout: float = -1) -> bool:
        """Acquire as a foreground caller (-1: however long it takes); False on timeout."""
        if self._lock.acquire(blocking=False):  # free: nobody to tell that we wait (every tick)
            self._slow = False
            self.held_since = time.monotonic()
            return True
        with self._cond:
            self._waiting += 1
        got = self._lock.acquire(timeout=timeout)
        with self._cond:
            self._waiting -= 1
        if not got:
            self._bump()  # background steps held back by our wait may go
            return False
        self._slow = True  # written by the holder, read by it in __exit__
        self.held_since = time.monotonic()
        return True

    def __enter__(self) -> EngineLock:
        self._take()
        return self

    @contextlib.contextmanager
    def within(self, timeout: float) -> Iterator[bool]:
        """The lock if it comes within `timeout` s (yields True), else nothing (False): for a
        reader that must go on when a step or request is stuck holding it (/diagnostics)."""
        if not self._take(timeout):
            yield False
            return
        try:
            yield True
        finally:
            self.__exit__()

    def __exit__(self, *exc) -> None:
        self.held_since = math.inf
        self._lock.release()
        # Background steps wait for `_waiting` to fall or for a new deadline (schedule() tells
        # them that); a holder that never waited changed neither, so its release wakes nobody.
        if self._slow:
            self._bump()

    def locked(self) -> bool:
        """Whether someone holds the lock now (a step, a request, a rollout step)."""
        return self._lock.locked()

    def _bump(self) -> None:
        with self._cond:
            self._gen += 1
            self._cond.notify_all()

    def schedule(self, next_tick: float | None, period: float = 0.0, tick_s: float = 0.0) -> None:
        """The timer loop's next deadline (None: the loop stopped) and its ticks' duration."""
        self.next_tick, self.period, self.tick_s = next_tick, period, tick_s
        self._bump()

    def _may_go(self, cost: float, since: float) -> bool:
        if self._waiting:
            return False
        nt = self.next_tick
        if nt is None:
            return True
        now = time.monotonic()
        if nt - now > cost + self.MARGIN_S:  # done before the next tick is due
            return True
        # no room for a while: the next tick may start late if it still ends in its period
        patient = now - since > self.PATIENCE * self.period
        return patient and now + cost + self.tick_s + self.MARGIN_S < nt + self.period

    def room_s(self) -> float:
        """The longest background step that fits between two ticks of the running loop (its
        period less a tick and the margin); unbounded while no loop runs."""
        if self.next_tick is None:
            return math.inf
        return max(self.period - self.tick_s - self.MARGIN_S, 0.0)

    @contextlib.contextmanager
    def background(
        self, cost: float, give_up_s: float = 10.0, what: str = "step"
    ) -> Iterator[None]:
        """Hold the lock for one `what` of background work that takes about `cost` seconds.
        CapacityError when no such room came for `give_up_s`: the loop never waits for it."""
        since = time.monotonic()
        give_up = since + give_up_s
        while True:
            with self._cond:
                if not self._may_go(cost, since):
                    if time.monotonic() > give_up:
                        raise CapacityError(
                            f"no room for a {cost * 1e3:.1f} ms {what} between control ticks for "
                            f"{give_up_s:g} s: lower rate_hz, or deactivate the node first"
                        )
                    gen, nt = self._gen, self.next_tick
                    wait = 0.05 if nt is None else max(nt - time.monotonic(), 0.0) + self.period
                    self._cond.wait_for(lambda g=gen: self._gen != g, timeout=wait)
                    continue
            self._lock.acquire()
            with self._cond:
                if self._may_go(cost, since):  # still: nobody came while we acquired
                    self.held_since = time.monotonic()
                    break
            self.held_since = math.inf
            self._lock.release()  # a tick or a request came just now: it goes first
            self._bump()
        try:
            yield
        finally:
            self.held_since = math.inf
            self._lock.release()
            self._bump()


LATE_SHARE = 0.5  # a tick may still start this share of its period late; later, it is skipped


def after_tick(
    deadline: float, now: float, period: float, may_delay: bool = True
) -> tuple[float, int, bool]:
    """Where the loop goes once a tick ended at `now`, `deadline` being the next one due: (the
    deadline of the tick to run next, the periods skipped, whether that tick starts late).

    A tick that ran past the next deadline delays the next tick; it does not cost it. The next
    one starts at once if less than LATE_SHARE of its period is gone, so its command still goes
    out within its period: at 1 kHz a publish that took 400 us too long (the virtual machine
    took the CPU away) used to lose the next period's command for a 12 us overshoot. Periods
    gone further than that are skipped, counted as overruns, and the loop waits for the next
    deadline. A delayed tick may not delay the one after it (`may_delay` False): a loop whose
    ticks always run a little long (a publish offset plus a slow publish beyond the period)
    would otherwise run late back to back for ever, with no gap left for the services, the
    idle work (/diagnostics) or a rollout's steps, and no overrun counted to say so.
    """
    if now <= deadline:
        return deadline, 0, False
    passed = int((now - deadline) / period)  # whole periods already gone past `deadline`
    latest = deadline + passed * period  # the last deadline at or before now
    if may_delay and now - latest < LATE_SHARE * period:
        return latest, passed, True
    return latest + period, passed + 1, False


class TimerLoop:
    """Calls `tick()` at `rate_hz`. Deadlines are absolute (start + k * period), so a late tick
    does not shift later ones. A tick that starts late because the one before ran into its
    period runs at once (`after_tick`), but not twice in a row; periods more than half gone are
    counted as overruns and skipped.

    `idle(deadline)`, when given, is called after a tick that left time before the next
    deadline (more than the final spin): periodic side work (/diagnostics) done by this thread
    in its slack, rather than by another thread that may hold the GIL when a tick is due. It
    decides itself whether the room left is enough for it; an exception goes to `on_error`.

    `serving()`, when given, is a context manager (host.ServiceHost.lent) entered on this
    thread for as long as the loop runs; it yields `serve(timeout_s, stop)`, or None. The loop then
    waits for its deadlines in `serve`, so requests are answered by this thread between two
    ticks: until the final spin before a deadline, and a request that comes later waits for
    the tick. No request is started once the spin is due, so a burst of them is spread over
    the gaps between ticks; one started just before the spin may delay the tick by its
    handling time, as a request holding the engine lock did when a thread of its own served it.
    `wake()` ends such a wait early (stop()).

    `busy` (the `busy_wait` parameter): the wait until the final spin polls instead of sleeping,
    `serve(0)` (a wait set looked at, not waited on; the GIL is free meanwhile) or a yield of
    the CPU, again and again. The thread is never descheduled, so nothing wakes it late, and the
    tick or request that follows runs on a core whose caches are warm: after a 2 ms sleep, the
    Engine's checkpoint took 135 us p50 on the H200 machine against 52 us after 2 ms of spinning
    and 42 us back to back (bench/capsule_probe.py --gap-ms 2 [--gap-spin]; a virtual machine,
    whose sleeping CPU gives its core away).
    """

    def __init__(
        self,
        rate_hz: float,
        tick: Callable[[float], None],
        on_timing: Callable,
        on_error: Callable,
        lock: EngineLock | None = None,
        idle: Callable[[float], None] | None = None,
        serving: Callable[[], contextlib.AbstractContextManager] | None = None,
        wake: Callable[[], None] | None = None,
        busy: bool = False,
    ):
        self.period = 1.0 / rate_hz
        # the final spin while serving: SPIN_S, but at most a quarter period, so that a short
        # period (rate_hz above 1250) still leaves a wait in which requests are served: with a
        # period of SPIN_S or less the spin was always due and the services never answered
        self.spin_s = min(SPIN_S, self.period / 4)
        self.busy = busy
        self.lock = lock  # told each next deadline, so background work can stay clear of it
        self.tick = tick  # tick(deadline): the monotonic time this tick was due
        # (jitter_s, overruns, tick_s, delayed) after each tick; delayed: the next tick starts
        # late, this one having run past its deadline
        self.on_timing = on_timing
        self.on_error = on_error  # an exception in a tick is reported, the loop goes on
        self.idle = idle  # idle(next deadline) after a tick with time to spare
        self.serving, self.wake = serving, wake
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> threading.Thread:
        """Run the loop on its thread (`flashrt-control`) until stop(); returns it."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="flashrt-control", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float = 5.0) -> bool:
        """End the loop; False when its thread is still inside a tick after `timeout` s (it
        ends after that tick: its stop stays set, and a new activation makes a new loop)."""
        self._stop.set()
        if self.wake is not None:
            self.wake()
        ended = True
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            ended = not self._thread.is_alive()
            self._thread = None
        if self.lock is not None:
            self.lock.schedule(None)
        return ended

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        name_os_thread()
        precise_sleeps()
        with contextlib.ExitStack() as lent:
            serve = None
            if self.serving is not None:
                try:
                    serve = lent.enter_context(self.serving())
                except Exception as e:  # the loop ticks anyway; the services stay where they are
                    self.on_error(e)
            self._loop(serve)

    def _wait(self, deadline: float, serve) -> bool:
        """Until the final spin before `deadline`, serving meanwhile when lent the services;
        True when stopped."""
        # a quarter period when serving (room for requests at short periods); a sleep keeps
        # the whole SPIN_S, since a wake-up can come that late
        spin_at = deadline - (self.spin_s if serve is not None else SPIN_S)

        def due() -> bool:  # no request starts after the spin began: queued ones wait a tick
            return self._stop.is_set() or time.monotonic() >= spin_at

        while (left := spin_at - time.monotonic()) > 0:
            if self.busy:
                left = 0.0  # look, never sleep (the class docstring)
                if serve is None:
                    os.sched_yield()  # the GIL is free meanwhile; the core stays ours
                    if self._stop.is_set():
                        return True
                    continue
            elif serve is None:
                return self._stop.wait(left)
            serve(left, due)
            if self._stop.is_set():
                return True
        return self._stop.is_set()

    def _loop(self, serve) -> None:
        deadline = time.monotonic() + self.period
        lock, tick_s, delayed = self.lock, 0.0, False
        if lock is not None:
            lock.schedule(deadline, self.period)
        while not self._stop.is_set():
            try:
                if self._wait(deadline, serve):
                    break
            except Exception as e:  # the context went away under the wait: plain waits now
                serve = None
                if not self._stop.is_set():
                    self.on_error(e)
                continue
            while time.monotonic() < deadline:
                pass
            start = time.monotonic()
            jitter = start - deadline
            try:
                self.tick(deadline)
            except Exception as e:
                self.on_error(e)
            if self._stop.is_set():  # stopped during the tick (a stop() that timed out): no
                break  # schedule nor idle work after it, a newer loop may own the lock now
            now = time.monotonic()
            tick_s = now - start if not tick_s else 0.9 * tick_s + 0.1 * (now - start)
            # past the next deadline: that tick runs late, or is skipped (after_tick says why)
            deadline, missed, delayed = after_tick(
                deadline + self.period, now, self.period, may_delay=not delayed
            )
            if lock is not None:
                lock.schedule(deadline, self.period, tick_s)
            self.on_timing(jitter, missed, now - start, delayed)
            if self.idle is not None and deadline - time.monotonic() > self.spin_s:
                try:
                    self.idle(deadline)
                except Exception as e:
                    self.on_error(e)
