"""Late fusing (runtime/latefuse.py): the eager kernels serve from the first step, the fused
step is built, checked and swapped in between two steps, and nothing else changes.

These tests compile the tiny policy with inductor's C++ backend (seconds on 2 cores; the
compiled variants are shared by every engine of the process). The CUDA path, where the swapped
plans are captured graphs, is test_cuda_latefuse.py.
"""

from __future__ import annotations

import gc
import sys
import threading
import time

import numpy as np
import pytest
import torch

from flashrt_ros import Engine
from flashrt_ros.errors import BadRequest
from flashrt_ros.runtime import latefuse, session
from test.tiny_policy import tiny

OBS = np.random.default_rng(7).normal(size=(40, 12)).astype(np.float32)


def engine(**kw) -> Engine:
    return Engine(tiny(), device="cpu", seed=3, flight_ticks=8, **kw)


@pytest.fixture(autouse=True)
def unfreeze():
    """A build freezes the heap as it ends (latefuse.build_window): give each test's engines
    back to the collector, as the node's cleanup does."""
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture
def gate(monkeypatch):
    """Holds the background build until set, so a test knows which steps ran before it."""
    ev = threading.Event()
    real = Engine._fused_probe

    def probe(self, ticks, check):
        assert ev.wait(120), "the test never opened the gate"
        return real(self, ticks, check)

    monkeypatch.setattr(Engine, "_fused_probe", probe)
    yield ev
    ev.set()


@pytest.fixture
def nudged(monkeypatch):
    """The real compiled step, plus 1e-6 on the action: within the check's tolerance, yet told
    apart from the eager step (the tiny policy compiles to the eager bits on the CPU)."""
    real = session.fused_step

    def fused_step():
        compiled = real()

        def step(*args) -> None:
            compiled(*args)
            args[3].add_(1e-6)  # args[3]: the action buffer

        return step

    monkeypatch.setattr(session, "fused_step", fused_step)


def test_eager_until_the_swap_then_the_fused_step_for_every_session(gate, nudged, tmp_path):
    """Before the swap every step is the eager step, bit for bit; a branch asked for during
    the build waits for it and is built fused; after the swap the sessions step exactly as a
    fused engine does from the same capsule, and the flight recorder held the steps across."""
    eng, ref = engine(fuse=True, late_fuse=True), engine(fuse=False)
    assert eng.fusing and not eng.fused and eng.late_fuse == ""
    for o in OBS[:5]:
        np.testing.assert_array_equal(eng.step(o), ref.step(o))
    assert not eng.finish_fusing(timeout=0.05)  # still building: nothing swapped
    assert eng.fusing and not eng.fused
    cap = eng.checkpoint()  # capsule verbs go on during the build
    threading.Timer(0.5, gate.set).start()
    t0 = time.monotonic()
    eng.branch(cap.id, session="alt")  # a new session waits for the build, then is fused
    assert time.monotonic() - t0 > 0.4
    assert not eng.fusing and eng.fused and eng.session("alt").fused
    assert eng.late_fuse.startswith("fused step in service from step 5 of main"), eng.late_fuse
    at5 = eng.state_bytes()
    a = eng.step(OBS[5])
    b = ref.step(OBS[5])
    assert not np.array_equal(a, b) and np.allclose(a, b, rtol=0, atol=1e-5)  # fused now
    for o in OBS[6:8]:
        eng.step(o)
    assert eng.flight() == list(range(1, 9))  # the ring kept recording through the swap
    assert eng.rewind(3) == 5 and eng.state_bytes() == at5
    fused = engine(fuse=True)
    assert fused.fused
    cap = eng.checkpoint()
    fused.restore(fused.load_capsule(eng.save_capsule(cap.id, tmp_path / "c.fcap")).id)
    for o in OBS[8:20]:
        np.testing.assert_array_equal(eng.step(o), fused.step(o))
    alt = eng.checkpoint(session="alt")
    fused.branch(fused.load_capsule(eng.save_capsule(alt.id, tmp_path / "a.fcap")).id, "alt")
    for o in OBS[20:30]:
        np.testing.assert_array_equal(eng.step(o, "alt"), fused.step(o, "alt"))


@pytest.mark.exclusive
@pytest.mark.parametrize("precompiled", [False, True], ids=["torch-compile", "precompiled"])
def test_a_loop_steps_throughout_and_the_swap_happens_between_two_of_its_steps(
    precompiled, nudged, tmp_path
):
    """No gate: the build runs beside a stepping loop. Every step before the swap is the eager
    step; the swap comes at a step boundary, seen by the same loop. With a compile cache the
    build compiles the step ahead of time and saves it, as the node does (that path compiles
    the step itself, without the nudge)."""
    cache = tmp_path / "cc" if precompiled else None
    eng = engine(fuse=True, late_fuse=True, compile_cache_dir=cache)
    ref = engine(fuse=False)
    assert (eng.precompiled is not None) == precompiled
    n, before = 0, 0
    while eng.fusing and n < 200_000:
        o = OBS[n % len(OBS)]
        was_fused = eng.fused
        a = eng.step(o)
        b = ref.step(o)
        if not was_fused and not eng.fused:
            np.testing.assert_array_equal(a, b)
            before += 1
        n += 1
    assert not eng.fusing and eng.fused, eng.late_fuse
    assert before > 0 and f"from step {before} of main" in eng.late_fuse, (before, eng.late_fuse)
    a, b = eng.step(OBS[0]), ref.step(OBS[0])
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    if precompiled:  # the ring and the no-ring variant, compiled and saved
        assert [": compiled in " in e for e in eng.precompiled.events] == [True, True]
    else:
        assert not np.array_equal(a, b)


def _fuse_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "flashrt-fuse"}


def test_the_build_begins_once_the_first_step_is_done(gate):
    """The first command never shares the GIL with a compile: no build thread until the first
    step is done; a poll (finish_fusing(0), as /diagnostics does) begins nothing."""
    before = _fuse_threads()
    eng = engine(fuse=True, late_fuse=True)
    assert eng.fusing and not eng.finish_fusing(timeout=0)
    eng.step(OBS[0])
    assert not eng.fusing_begun and not (_fuse_threads() - before)
    eng.step(OBS[1])
    assert eng.fusing_begun and len(_fuse_threads() - before) == 1
    gate.set()
    assert eng.finish_fusing(timeout=120) and eng.fused, eng.late_fuse


def test_the_build_window_hands_the_gil_over_often_and_skips_full_collections(gate):
    """A full pass of the collector over the compiler's objects stalled the stepping thread
    80-200 ms (bench/gil_gap_probe.py): none runs during the build, the young generations are
    collected as usual, and the GIL changes hands every 0.2 ms; afterwards the thresholds and
    the switch interval come back, with the build's objects frozen."""
    before, switch = gc.get_threshold(), sys.getswitchinterval()
    assert switch > latefuse.SWITCH_S  # Python's default, 5 ms
    eng = engine(fuse=True, late_fuse=True)
    eng.step(OBS[0])
    assert gc.get_threshold() == before  # nothing changes before the build begins
    eng.step(OBS[1])  # the build begins, and waits at the gate
    deadline = time.monotonic() + 30
    while gc.get_threshold() == before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gc.get_threshold() == (before[0], before[1], 1 << 30)
    assert sys.getswitchinterval() == pytest.approx(latefuse.SWITCH_S)
    frozen = gc.get_freeze_count()
    gate.set()
    assert eng.finish_fusing(timeout=120) and eng.fused, eng.late_fuse
    assert gc.get_threshold() == before and sys.getswitchinterval() == switch
    assert gc.get_freeze_count() > frozen


def test_the_build_window_nests_and_restores_once_the_last_build_ends():
    before, switch = gc.get_threshold(), sys.getswitchinterval()
    with latefuse.build_window():
        with latefuse.build_window():
            assert gc.get_threshold()[2] == 1 << 30
        assert gc.get_threshold()[2] == 1 << 30  # the outer build still runs
        assert sys.getswitchinterval() == pytest.approx(latefuse.SWITCH_S)
    assert gc.get_threshold() == before and sys.getswitchinterval() == switch
    with pytest.raises(RuntimeError), latefuse.build_window():  # a build that fails
        raise RuntimeError("inductor fell over")
    assert gc.get_threshold() == before and sys.getswitchinterval() == switch


def test_finish_fusing_begins_a_build_no_step_began():
    eng = engine(fuse=True, late_fuse=True)
    assert eng.finish_fusing(timeout=120) and eng.fused, eng.late_fuse
    assert eng.late_fuse.startswith("fused step in service from step 0 of main"), eng.late_fuse


@pytest.mark.parametrize("begun", [False, True], ids=["before-the-build", "during-it"])
def test_a_build_can_be_cancelled(gate, begun):
    """Cancelled before its thread began or while it runs: the eager kernels go on serving."""
    eng, ref = engine(fuse=True, late_fuse=True), engine(fuse=False)
    for o in OBS[: 2 if begun else 0]:  # the second step begins the build, held at the gate
        np.testing.assert_array_equal(eng.step(o), ref.step(o))
    eng.cancel_fusing()
    gate.set()
    assert not eng.finish_fusing(timeout=60)
    assert eng.late_fuse == "eager kernels kept: cancelled" and not eng.fused
    for o in OBS[2:6]:
        np.testing.assert_array_equal(eng.step(o), ref.step(o))


def test_a_fused_step_that_differs_is_never_swapped_in(monkeypatch):
    """The check runs in the build thread too: the eager kernels stay, for later sessions as
    well, and the engine says why."""

    def wrong_fused_step():
        def step(*args) -> None:
            session.arena_step(*args)
            args[3].add_(0.5)  # the action buffer

        return step

    monkeypatch.setattr(session, "fused_step", wrong_fused_step)
    eng, ref = engine(fuse=True, late_fuse=True), engine(fuse=False)
    assert not eng.finish_fusing(timeout=60)
    assert not eng.fusing and not eng.fused
    assert eng.fused_mismatch.startswith("tick kind 0 at step 0: 'action': max difference 0.5")
    assert eng.late_fuse.startswith("eager kernels kept: the fused step differed"), eng.late_fuse
    for o in OBS[:6]:
        np.testing.assert_array_equal(eng.step(o), ref.step(o))
    assert not eng.create_session("b").fused


def test_a_build_that_fails_keeps_the_eager_kernels(monkeypatch):
    def broken_fused_step():
        def step(*args) -> None:
            raise RuntimeError("inductor fell over")

        return step

    monkeypatch.setattr(session, "fused_step", broken_fused_step)
    eng, ref = engine(fuse=True, late_fuse=True), engine(fuse=False)
    assert not eng.finish_fusing(timeout=60)
    said = "eager kernels kept: building it failed: RuntimeError: inductor fell over"
    assert eng.late_fuse == said
    assert eng.fused_mismatch == ""
    for o in OBS[:4]:
        np.testing.assert_array_equal(eng.step(o), ref.step(o))


def test_late_fuse_is_checked_and_means_nothing_without_a_fused_step():
    with pytest.raises(BadRequest, match="late_fuse"):
        engine(fuse=True, late_fuse="yes")
    eng = engine(fuse=False, late_fuse=True)
    assert not eng.fusing and not eng.fused and eng.late_fuse == ""
    assert not eng.finish_fusing(timeout=0)


def test_the_build_thread_does_not_inherit_the_stepping_threads_cpu_or_priority():
    """start() runs on the thread that steps (the second step), which cpu_affinity pins and
    realtime_priority makes SCHED_FIFO; a new thread inherits both, and a compile of seconds at
    the control thread's priority on its CPU would stall the loop. The build runs normally
    scheduled on the CPUs of the thread that made the engine."""
    import os

    from flashrt_ros.node.loop import set_affinity, set_realtime

    seen = {}

    def probe(ticks, check):
        seen["cpus"] = os.sched_getaffinity(0)
        seen["policy"] = os.sched_getscheduler(0)
        raise RuntimeError("measured; no build")

    mine = os.sched_getaffinity(0)
    late = latefuse.LateFuse(probe, lambda: [], 0, torch.device("cpu"))
    go = threading.Event()

    def stepping() -> None:
        go.wait()
        late.start()
        late.wait(10)

    t = threading.Thread(target=stepping, name="flashrt-control")
    t.start()
    one = frozenset([max(mine)])
    assert set_affinity(t, one) == ""
    fifo = set_realtime(t, 10) == ""  # needs CAP_SYS_NICE: checked where it can be had
    go.set()
    t.join(10)
    assert late.done.is_set() and seen["cpus"] == mine
    if fifo:  # the builder's own: SCHED_OTHER, or SCHED_IDLE in make test's shared run
        assert seen["policy"] == os.sched_getscheduler(0)
    if len(mine) > 1:
        assert seen["cpus"] != one
