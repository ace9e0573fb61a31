"""The timer loop's thread: absolute deadlines, and precise sleeps (node/loop.py)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import time

import pytest

from flashrt_ros.node.loop import EngineLock, ThreadUsage, TimerLoop, after_tick, os_thread_name


@pytest.mark.exclusive
def test_the_control_thread_sleeps_with_1ns_timer_slack_and_keeps_its_rate():
    """Linux adds the thread's timer slack (50 us by default) to every sleep; the control
    thread sets its own to 1 ns, so the busy-wait before each deadline can stay short."""
    seen: dict[str, object] = {}
    ticks: list[float] = []
    linux = sys.platform.startswith("linux")
    libc = ctypes.CDLL(None) if linux else None  # loaded here, not inside a tick

    def tick(deadline: float) -> None:
        if "slack" not in seen:  # PR_GET_TIMERSLACK (30) answers for the calling thread
            seen["slack"] = libc.prctl(30, 0, 0, 0, 0) if linux else None
        ticks.append(deadline)

    loop = TimerLoop(200.0, tick, on_timing=lambda *_: None, on_error=lambda e: seen.update(e=e))
    loop.start()
    time.sleep(0.3)
    loop.stop()
    assert "e" not in seen
    if not linux:  # pragma: no cover
        pytest.skip("no per-thread timer slack here")
    assert seen["slack"] == 1
    assert libc.prctl(30, 0, 0, 0, 0) > 1  # this thread's own was not changed
    # absolute deadlines: every tick is due a whole number of periods after the one before
    # (a tick that overran on a loaded machine delays the next or skips it, never drifts)
    gaps = [(b - a) / 0.005 for a, b in zip(ticks, ticks[1:], strict=False)]
    assert len(ticks) >= 10 and all(round(g) >= 1 and abs(g - round(g)) < 1e-6 for g in gaps)


def test_the_control_thread_has_its_name_in_the_kernel_too():
    """top -H and ps -L show the kernel's thread names: the control thread is flashrt-control
    there, not the process's name; a name over 15 bytes gives up its "flashrt-" prefix for
    "frt-" before it is cut."""
    import threading

    if not sys.platform.startswith("linux"):  # pragma: no cover
        pytest.skip("no per-thread names here")
    seen: dict[str, str] = {}

    def tick(deadline: float) -> None:
        if "comm" not in seen:
            with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
                seen["comm"] = f.read()

    loop = TimerLoop(200.0, tick, on_timing=lambda *_: None, on_error=print)
    loop.start()
    time.sleep(0.2)
    loop.stop()
    assert seen["comm"].strip() == "flashrt-control"
    assert os_thread_name("flashrt-services") == "frt-services"
    assert os_thread_name("flashrt-decode-wrist") == "frt-decode-wris"  # 15 bytes at most
    assert os_thread_name("planner-spin") == "planner-spin"


def _run_loop(rate_hz: float, tick, seconds: float) -> list[tuple]:
    """Run a TimerLoop with an idle hook for `seconds`; its events in order: ("tick", deadline),
    ("timing", missed), ("idle", deadline, thread name), ("error", e)."""
    import threading

    events: list[tuple] = []

    def on_tick(deadline: float) -> None:
        events.append(("tick", deadline))
        tick(deadline)

    def idle(deadline: float) -> None:
        events.append(("idle", deadline, threading.current_thread().name))

    loop = TimerLoop(
        rate_hz,
        on_tick,
        on_timing=lambda jitter, missed, took, delayed: events.append(("timing", missed)),
        on_error=lambda e: events.append(("error", e)),
        idle=idle,
    )
    loop.start()
    time.sleep(seconds)
    loop.stop()
    return events


def test_idle_hook_runs_on_the_control_thread_with_the_next_deadline():
    """A cheap tick leaves the whole period: the hook is called after ticks, on the control
    thread, with the deadline of the tick that comes next."""
    events = _run_loop(200.0, lambda d: None, 0.3)
    assert not [e for e in events if e[0] == "error"]
    idles = [i for i, e in enumerate(events) if e[0] == "idle"]
    assert len(idles) >= 5, events  # most ticks leave room (a loaded machine may take some)
    for i in idles:
        _, deadline, thread = events[i]
        assert thread == "flashrt-control"
        assert events[i - 1][0] == "timing" and events[i - 2][0] == "tick"
        later = [e[1] for e in events[i:] if e[0] == "tick"]
        if later:  # the next tick is the one that was due at that deadline
            assert later[0] == deadline


@pytest.mark.exclusive
def test_idle_hook_is_not_called_without_time_to_spare():
    """A tick that ends within the final spin of the next deadline leaves no room: the hook is
    called only after a tick that overran (its lost deadlines skipped, the next one is far)."""
    period = 1.0 / 200.0

    def busy(deadline: float) -> None:
        end = deadline + period - 0.00005  # 50 us before the next deadline (SPIN_S is 200 us)
        while time.monotonic() < end:
            pass

    events = _run_loop(200.0, busy, 0.3)
    assert not [e for e in events if e[0] == "error"]
    assert sum(e[0] == "tick" for e in events) >= 10
    for i, e in enumerate(events):
        if e[0] == "idle":
            assert events[i - 1][0] == "timing" and events[i - 1][1] > 0, events[i - 3 : i + 1]


@pytest.mark.exclusive
def test_timing_reports_how_long_an_overrunning_tick_took():
    """on_timing gets each tick's own duration beside its wake-up lateness, so an overrun can
    be told apart: a tick that ran long, or one that woke late (the node's diagnostics count
    both kinds, overruns_long_tick and overruns_late_wake)."""
    period = 1.0 / 200.0
    seen: list[tuple[float, int, float]] = []
    loop = TimerLoop(
        200.0,
        lambda d: time.sleep(2.5 * period),  # every tick runs long
        on_timing=lambda jitter, missed, took, delayed: seen.append((jitter, missed, took)),
        on_error=lambda e: seen.append((0.0, -1, 0.0)),
    )
    loop.start()
    time.sleep(0.2)
    loop.stop()
    assert len(seen) >= 3 and all(m >= 2 for _, m, _ in seen), seen
    assert all(took >= 2.5 * period > jitter for jitter, _, took in seen), seen


def test_after_a_long_tick_the_next_runs_late_while_its_period_is_less_than_half_gone():
    """Where the loop goes after a tick (period 1, the next deadline 10): on time; the next
    tick at once, late, while less than half its period is gone; else skipped, the periods gone
    counted; after several periods, the newest one runs late if its own half is not gone; and
    never late twice in a row (may_delay False after a delayed tick)."""
    assert after_tick(10.0, 9.9, 1.0) == (10.0, 0, False)
    assert after_tick(10.0, 10.2, 1.0) == (10.0, 0, True)
    assert after_tick(10.0, 10.7, 1.0) == (11.0, 1, False)
    assert after_tick(10.0, 12.3, 1.0) == (12.0, 2, True)
    assert after_tick(10.0, 12.6, 1.0) == (13.0, 3, False)
    assert after_tick(10.0, 10.2, 1.0, may_delay=False) == (11.0, 1, False)
    assert after_tick(10.0, 9.9, 1.0, may_delay=False) == (10.0, 0, False)


def _long_ticks(period: float, long, seconds: float) -> tuple[list, list, int]:
    """A TimerLoop whose tick number i (from 0) runs until `long(i)` periods after its start
    (None: returns at once); (the (deadline, start) of each tick, the (missed, delayed) of
    each timing, the idle hook's calls)."""
    starts: list[tuple[float, float]] = []
    timing: list[tuple[int, bool]] = []
    idle: list[float] = []

    def tick(deadline: float) -> None:
        t0 = time.monotonic()
        starts.append((deadline, t0))
        if (k := long(len(starts) - 1)) is not None:
            while time.monotonic() < t0 + k * period:
                pass

    loop = TimerLoop(
        1 / period,
        tick,
        on_timing=lambda jitter, missed, took, delayed: timing.append((missed, delayed)),
        on_error=pytest.fail,
        idle=idle.append,
    )
    loop.start()
    time.sleep(seconds)
    loop.stop()
    return starts, timing, len(idle)


@pytest.mark.exclusive
@pytest.mark.parametrize("over, skipped", [(0.05, 0), (0.55, 1)])
def test_a_tick_that_runs_into_the_next_period_delays_that_tick_or_skips_it(over, skipped):
    """The third tick ends `over` of a period past the next deadline: at 0.05 the next tick runs
    at once, late, and its command is not lost (its deadline is the very next one; no overrun,
    the timing says delayed); at 0.55, more than half of that period is gone, so it is skipped
    and counted as an overrun, and the loop waits for the deadline after it. (A period of 50 ms
    leaves each case ~22 ms of a loaded machine's lateness before it would turn into the other.)"""
    period = 0.05
    starts, timing, _ = _long_ticks(period, lambda i: 1 + over if i == 2 else None, 0.35)
    assert len(starts) >= 5, starts
    (d3, b3), (d4, b4) = starts[2], starts[3]
    assert b3 - d3 < 0.4 * period, starts  # the long tick itself began about on time
    assert round((d4 - d3) / period) == 1 + skipped
    assert timing[2] == (skipped, not skipped)
    if not skipped:
        assert b4 - d4 > 0.9 * over * period  # at once, as late as the long tick left it


@pytest.mark.exclusive
def test_a_delayed_tick_never_delays_the_next_so_the_loop_keeps_gaps():
    """Every tick runs 1.1 periods: a tick on time delays the next; that one, late itself, may
    not delay the one after it, which is skipped. So the loop keeps a gap of most of a period
    every third period (services, /diagnostics) instead of running late back to back."""
    period = 0.02
    starts, timing, idles = _long_ticks(period, lambda i: 1.1, 0.5)
    assert len(timing) >= 6, timing
    flags = [d for _, d in timing]
    assert not any(a and b for a, b in zip(flags, flags[1:], strict=False)), timing
    assert any(flags) and sum(m for m, _ in timing) > 0, timing
    assert idles > 0  # the gaps left room for the idle hook


def test_a_period_shorter_than_the_final_spin_still_leaves_time_to_serve():
    """At 5 kHz (a period of 200 us, the length of SPIN_S) with ticks that run over, the final
    spin was always due: the services lent to the loop were never served, and a request waited
    until the node stopped. The spin is at most a quarter period now."""
    served: list[float] = []

    @contextlib.contextmanager
    def serving():
        yield lambda timeout_s, due: served.append(timeout_s)

    def tick(deadline: float) -> None:
        end = time.monotonic() + 0.0003  # each tick longer than the period
        while time.monotonic() < end:
            pass

    loop = TimerLoop(5000.0, tick, on_timing=lambda *_: None, on_error=pytest.fail)
    loop.serving = serving
    loop.start()
    time.sleep(0.3)
    loop.stop()
    assert loop.spin_s == pytest.approx(0.00005)
    assert served, "the loop never served in 0.3 s"


@pytest.mark.exclusive
@pytest.mark.parametrize("busy", [False, True])
def test_busy_wait_polls_between_ticks_and_keeps_the_deadlines(busy: bool):
    """busy=True (the `busy_wait` parameter): the control thread never sleeps between ticks
    (no voluntary context switch: it only yields); without it, a cheap tick at 200 Hz leaves
    the thread asleep most of the time, a sleep per tick. The deadlines are the same absolute
    ones.

    Sleeps are counted, not CPU time: a thread that yields gives its core to any other runnable
    task until the next scheduler tick, and in make test the shared run's idle-class tests
    took all but 1.3 % of it that way (the thread still never slept)."""
    import resource

    ticks: list[float] = []
    cpu: list[float] = []
    sleeps: list[int] = []

    def tick(deadline: float) -> None:
        ticks.append(deadline)
        cpu.append(time.thread_time())  # the control thread's own CPU time
        sleeps.append(resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw)  # voluntary switches

    loop = TimerLoop(200.0, tick, on_timing=lambda *_: None, on_error=pytest.fail, busy=busy)
    loop.start()
    time.sleep(0.6)
    loop.stop()
    assert len(ticks) >= 40, len(ticks)
    gaps = [(b - a) / 0.005 for a, b in zip(ticks, ticks[1:], strict=False)]
    assert all(round(g) >= 1 and abs(g - round(g)) < 1e-6 for g in gaps)
    per_tick = (sleeps[-1] - sleeps[0]) / (len(ticks) - 1)
    if busy:
        assert per_tick < 0.3, per_tick  # a stray wait for the GIL, never one per tick
    else:
        assert per_tick >= 0.8, per_tick  # it sleeps until each deadline's spin
        share = (cpu[-1] - cpu[0]) / (ticks[-1] - ticks[0])  # CPU seconds per second
        assert share < 0.3, share  # the 200 us spin before each 5 ms deadline, and the ticks


def test_realtime_priority_0_gives_a_thread_the_process_scheduling_back():
    """set_realtime(t, 0) (the services thread after the control thread lent it back): the
    scheduling the process was started with, not SCHED_OTHER, so a node run under
    chrt --idle or --batch keeps it in every thread."""
    import threading

    from flashrt_ros.node.loop import PROCESS_SCHED, set_realtime

    go = threading.Event()
    t = threading.Thread(target=go.wait, args=(10,))
    t.start()
    try:
        if set_realtime(t, 5):
            pytest.skip("SCHED_FIFO is not allowed here")
        assert os.sched_getscheduler(t.native_id) == os.SCHED_FIFO
        assert set_realtime(t, 0) == ""
        assert os.sched_getscheduler(t.native_id) == PROCESS_SCHED[0]
    finally:
        go.set()
        t.join()


def test_realtime_with_busy_wait_warns_about_the_kernels_throttling(tmp_path):
    """A SCHED_FIFO thread that never sleeps loses its CPU for what sched_rt_runtime_us leaves
    of each period: the node says so when both parameters are on (and only then)."""
    from flashrt_ros.node.loop import throttle_note

    (tmp_path / "sched_rt_runtime_us").write_text("950000\n")
    (tmp_path / "sched_rt_period_us").write_text("1000000\n")
    here = str(tmp_path / "sched_rt_runtime_us")
    note = throttle_note(10, True, here)
    assert "50 ms each 1 s" in note and "sched_rt_runtime_us=-1" in note
    assert throttle_note(0, True, here) == "" and throttle_note(10, False, here) == ""
    (tmp_path / "sched_rt_runtime_us").write_text("-1\n")  # throttling off: nothing to say
    assert throttle_note(10, True, here) == ""
    assert throttle_note(10, True, str(tmp_path / "missing" / "x")) == ""
    real = "/proc/sys/kernel/sched_rt_runtime_us"  # this machine's own setting
    if os.path.exists(real) and int(open(real).read()) >= 0:
        assert "throttles" in throttle_note(1, True)


def test_thread_usage_tells_a_tick_that_computed_from_one_that_waited():
    """ThreadUsage (the tail of `last_overrun`): a thread that slept shows a voluntary context
    switch and almost no CPU time; one that computed shows CPU time, never more than the wall
    time it took (one thread). Nothing before the first mark."""
    import re

    form = re.compile(
        r"on its CPU (\d+) us, (\d+) involuntary and (\d+) voluntary context switches, "
        r"(\d+) page faults; collector passes in it .+, in other threads .+"
    )
    u = ThreadUsage()
    assert u.since() == ""
    u.mark()
    time.sleep(0.05)
    m = form.fullmatch(u.since())
    assert m, u.since()
    cpu_us, _, voluntary, _ = (int(v) for v in m.groups())
    assert voluntary >= 1 and cpu_us < 25_000, m.group(0)  # asleep: the CPU was given away

    u.mark()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.02:
        n += 1
    wall_us = (time.perf_counter() - t0) * 1e6
    m = form.fullmatch(u.since())
    assert m, u.since()
    assert 0 < int(m.group(1)) <= wall_us + 1000, (m.group(0), wall_us)


def test_thread_usage_counts_the_collectors_passes_in_the_tick_and_beside_it():
    """A collector pass in the marked thread is counted as its own, with its generation and a
    time within the call's; one run by another thread meanwhile (the tick then waited for the
    GIL) as the others'; none: none. Made on one thread and marked on another, as the node's
    control thread does; one clock per process however many ThreadUsage there are."""
    import gc
    import re

    from flashrt_ros.node.collector import CollectorClock

    enabled = gc.isenabled()
    gc.disable()  # no pass but the ones asked for
    try:
        u, _ = ThreadUsage(), ThreadUsage()  # made here, on the main thread
        assert sum(isinstance(cb, CollectorClock) for cb in gc.callbacks) == 1
        seen: dict = {}

        def control() -> None:  # marks and reads on a thread of its own
            u.mark()
            seen["none"] = (u.since(), u.collector_passes())
            t0 = time.perf_counter()
            gc.collect()
            wall_us = (time.perf_counter() - t0) * 1e6
            seen["own"] = (u.since(), u.collector_passes(), wall_us)
            u.mark()
            other.start()
            other.join()
            seen["other"] = (u.since(), u.collector_passes())

        other = threading.Thread(target=gc.collect, args=(1,))
        t = threading.Thread(target=control)
        t.start()
        t.join()
        text, n = seen["none"]
        assert text.endswith("collector passes in it none, in other threads none") and n == 0
        text, n, wall_us = seen["own"]
        m = re.search(r"in it 1 \((\d+) us, up to generation 2\), in other threads none$", text)
        assert m and n == 1, text
        assert 0 < int(m.group(1)) <= wall_us + 1, (text, wall_us)
        text, n = seen["other"]
        assert re.search(r"in it none, in other threads 1 \(\d+ us, up to generation 1\)$", text)
        assert n == 1
    finally:
        if enabled:
            gc.enable()


def test_stop_says_when_the_thread_is_still_in_a_tick_and_it_ends_after_that_tick():
    """A tick stuck past stop()'s timeout: stop() says so (the node logs it), and the thread
    still ends after that tick instead of ticking on beside a new activation's loop."""
    release, ticks = threading.Event(), []

    def tick(deadline: float) -> None:
        ticks.append(deadline)
        release.wait(5.0)

    lock, idled = EngineLock(), []
    loop = TimerLoop(
        100.0, tick, on_timing=lambda *_: None, on_error=lambda e: None, lock=lock,
        idle=idled.append,
    )  # fmt: skip
    thread = loop.start()
    time.sleep(0.1)
    assert loop.stop(timeout=0.1) is False and thread.is_alive()
    release.set()
    thread.join(2.0)
    assert not thread.is_alive() and len(ticks) == 1
    # nothing after that tick: no deadline left in the lock (background work would wait for a
    # tick that never comes: rollouts refused on an inactive node), no idle work
    assert lock.next_tick is None and idled == []


def test_a_rollout_priced_by_one_slow_first_step_still_finds_room_at_200hz():
    """A rollout step waits for a gap between control ticks as long as its price
    (EngineLock.background). Its price was the median of a 2 ms seed and the steps so far, so
    one slow first step (a scratch session captured on first use, cold caches, the OS: 17.6
    ms) priced the next at 9.8 ms: no 5 ms period has room for that, and the rollout waited 10
    s and failed. step_cost counts the live session's step time twice beside the steps."""
    from flashrt_ros.errors import CapacityError
    from flashrt_ros.node.services import FIRST_STEP_COST_S, step_cost

    assert step_cost([]) == FIRST_STEP_COST_S  # nothing stepped yet: the seed
    assert step_cost([0.0176]) == 0.002  # one slow step does not set the price
    assert step_cost([0.0176, 0.0015], prior=0.0015) == 0.0015
    # a policy slower than the period is priced so from the start: its live steps are slow too
    assert step_cost([], prior=0.02) == 0.02
    assert step_cost([0.008] * 3) == 0.008  # and once three steps say so, from the third on
    assert step_cost([0.001] * 10 + [0.05] * 4, prior=0.001) == 0.001  # preemptions: no price

    lock = EngineLock()

    def tick(deadline: float) -> None:
        with lock:
            time.sleep(0.001)

    loop = TimerLoop(200.0, tick, lambda *a: None, lambda e: None, lock=lock)
    loop.start()
    try:
        time.sleep(0.1)
        t0 = time.monotonic()
        with lock.background(step_cost([0.0176]), give_up_s=5.0):
            pass
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(CapacityError, match="no room for a 9.8 ms step"):
            with lock.background(0.0098, give_up_s=0.5):  # the old price: never room
                pass
    finally:
        loop.stop()
