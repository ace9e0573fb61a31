"""Late fusing on CUDA (runtime/latefuse.py), on the GPU machine:

    FLASHRT_REQUIRE_CUDA=1 python3 -m pytest -q -m cuda test/test_cuda_latefuse.py

The build thread compiles, checks and warms the fused step on a stream of its own and captures
it over the live sessions' buffers (thread-local capture) while this thread keeps stepping the
eager graphs; the swap comes between two steps. test_latefuse.py covers the same on the CPU.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from flashrt_ros import Engine, load_policy

pytestmark = pytest.mark.cuda

OBS = np.random.default_rng(11).normal(size=(64, 12)).astype(np.float32)


@pytest.mark.parametrize("precompiled", [False, True], ids=["torch-compile", "precompiled"])
def test_the_fused_graphs_are_captured_beside_the_stepping_loop_and_swapped_in(
    precompiled, tmp_path
):
    """Eager graphs bit for bit until the swap, with a checkpoint and a restore during the
    build (their copy graphs, met for the first time while the build holds the capture lock,
    are issued directly); then every session steps as a fused engine's do, bit for bit."""
    cache = tmp_path / "cc" if precompiled else None

    def make(**kw) -> Engine:
        pol = load_policy("builtin:hybrid")
        return Engine(pol, device="cuda", seed=1, flight_ticks=16, compile_cache_dir=cache, **kw)

    # ref first: a capture waits for the build, which holds the process's capture lock
    ref = make(fuse=False)
    eng = make(fuse=True, late_fuse=True)
    assert eng.fusing and not eng.fused and eng.session("main").captured
    assert (eng.precompiled is not None) == precompiled
    n = before = 0
    caps: dict[str, str] = {}
    t_end = time.monotonic() + 300
    while eng.fusing and time.monotonic() < t_end:
        o = OBS[n % len(OBS)]
        was_fused = eng.fused
        a, b = eng.step(o), ref.step(o)
        if not was_fused and not eng.fused:  # the eager graph: bit for bit the unfused engine
            np.testing.assert_array_equal(a, b)
            before += 1
            if before == 3:
                caps = {"eng": eng.checkpoint().id, "ref": ref.checkpoint().id}
            if before == 6:  # both back to step 3
                eng.restore(caps["eng"])
                ref.restore(caps["ref"])
                assert eng.state_bytes() == ref.state_bytes()
        n += 1
    assert eng.fused, eng.late_fuse
    assert before > 6 and "of main, built in the background" in eng.late_fuse, eng.late_fuse
    assert eng.session("main").fused and eng.session("main").captured
    a, b = eng.step(OBS[0]), ref.step(OBS[0])
    assert not np.array_equal(a, b) and np.allclose(a, b, rtol=0, atol=1e-4)  # fused kernels
    eng.branch(eng.checkpoint().id, session="alt")  # a session after the swap: fused too
    assert eng.session("alt").fused and eng.session("alt").captured
    # what is served now is the fused engine's captured step, bit for bit, on both sessions
    fused = make(fuse=True)
    assert fused.fused
    for name in ("main", "alt"):
        cap = eng.checkpoint(session=name)
        got = fused.load_capsule(eng.save_capsule(cap.id, tmp_path / f"{name}.fcap"))
        if name == "main":
            fused.restore(got.id)
        else:
            fused.branch(got.id, session="alt")
        for o in OBS[:32]:
            np.testing.assert_array_equal(eng.step(o, name), fused.step(o, name))
    # the flight ring kept recording through the swap
    held = eng.flight()
    assert held == list(range(held[0], eng.session_step() + 1)) and len(held) == 16
