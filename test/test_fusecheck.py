"""The compiled (fused) step serves the eager step's actions, or is not served (CPU inductor).

Inductor can compute a value that reads the arena through a dtype view after a later write to
the arena (pytorch/pytorch#198101). Our step counter was such a write: a fused chunked policy
popped the next tick's row on queue ticks. These tests compile real steps with inductor's C++
backend (tens of seconds each on 2 cores).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from flashrt_ros import Engine
from flashrt_ros.policies.chunked import ChunkedPolicy
from flashrt_ros.runtime import fusecheck, session
from flashrt_ros.runtime.flight import record
from test import lerobot_like as ll
from test.test_chunked import OBS, run


def chunked(**kw) -> Engine:
    return Engine(ChunkedPolicy(ll.LeRobotLike()), device="cpu", seed=5, **kw)


def test_a_fused_chunked_policy_pops_its_queue_like_the_eager_step():
    """Queue, record and infer ticks (the history and the noise counter too) over three
    inferences: the fused step is served, its actions are the eager ones, and the check before
    capture left the state as built."""
    fused, eager = chunked(fuse=True), chunked(fuse=False)
    assert fused.fuse and fused.fused_mismatch == ""
    assert fused.state_bytes() == eager.state_bytes() and fused.session_step() == 0
    kinds = [fused.policy.tick_kind(i) for i in range(12)]
    assert set(kinds) == {0, 1, 2}, kinds  # infer, queue, record
    np.testing.assert_allclose(run(fused, OBS[:12]), run(eager, OBS[:12]), rtol=0, atol=1e-5)


def test_a_fused_step_that_differs_from_the_eager_one_is_not_served(monkeypatch, caplog):
    """A compiled step that gets one action wrong (the state right) is caught before capture:
    the engine says why, logs it, and serves the eager step, for later sessions too."""

    def wrong_fused_step():
        def step(*args) -> None:
            session.arena_step(*args)
            args[3].add_(0.5)  # args[3]: the action buffer

        return step

    monkeypatch.setattr(session, "fused_step", wrong_fused_step)
    with caplog.at_level(logging.ERROR, logger="flashrt_ros.runtime.engine"):
        eng = chunked(fuse=True)
    assert eng.fused_mismatch.startswith("tick kind 0 at step 0: 'action': max difference 0.5")
    assert "differs from the eager step" in caplog.text and eng.fused_mismatch in caplog.text
    eager = chunked(fuse=False)
    assert eng.state_bytes() == eager.state_bytes()
    np.testing.assert_array_equal(run(eng, OBS[:6]), run(eager, OBS[:6]))
    eng.branch(eng.checkpoint().id, session="alt")  # a later session: eager too, no new check
    np.testing.assert_array_equal(
        run(eng, OBS[6:10], session="alt"), run(eager, OBS[6:10], session="main")
    )


def test_a_fused_step_that_writes_the_wrong_ring_slot_is_not_served(monkeypatch):
    """Where the step function writes the flight ring itself (the CPU; CUDA without the ring
    kernel), the ring is compared too: a fused step whose actions and state are right but
    whose ring write lands in the wrong slot would rewind to a wrong state later."""

    def wrong_ring_step():
        def step(*args) -> None:
            policy, buf, obs, action, chunk, table, ring, kind, conv = args
            if ring is not None:  # the slot after the right one
                (counter,) = (
                    buf[o : o + n].view(d) for name, d, _s, o, n in table if name == "step"
                )
                record(ring, buf, counter + 1)
            session.arena_step(policy, buf, obs, action, chunk, table, None, kind, conv)

        return step

    monkeypatch.setattr(session, "fused_step", wrong_ring_step)
    eng = chunked(fuse=True, flight_ticks=4)
    assert "'flight ring'" in eng.fused_mismatch, eng.fused_mismatch
    eager = chunked(fuse=False, flight_ticks=4)
    np.testing.assert_array_equal(run(eng, OBS[:6]), run(eager, OBS[:6]))
    eng.rewind(2)
    eager.rewind(2)
    assert eng.state_bytes() == eager.state_bytes()


def test_differences_are_judged_by_dtype():
    f = torch.tensor([1.0, 2.0, float("nan")])
    assert fusecheck.differs(f + 1e-5, f) == ""  # float reassociation
    assert "max difference" in fusecheck.differs(f + 0.01, f)
    assert "max difference inf" in fusecheck.differs(torch.tensor([1.0, 2.0, 3.0]), f)
    i = torch.tensor([3, 4], dtype=torch.int64)
    assert fusecheck.differs(i + 1, i) == "2 of 2 values differ"
    b = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert fusecheck.differs(b * 1.01, b) == ""  # half types: looser
    assert fusecheck.differs(b * 1.2, b) != ""


def test_a_chunked_policy_is_compiled_by_default_unless_it_says_not():
    """Ensembling ones too, since the step that may be compiled no longer rewrites what it
    reads (next test). A module's own fuse_default wins."""
    assert ChunkedPolicy(ll.LeRobotLike()).fuse_default
    ens = ll.LeRobotLike(n_obs_steps=1, n_action_steps=1, chunk_size=5, coeff=0.01)
    assert ChunkedPolicy(ens).fuse_default
    off = ll.LeRobotLike()
    off.fuse_default = False
    assert not ChunkedPolicy(off).fuse_default


@pytest.mark.parametrize("coeff", [None, 0.01])
def test_the_step_that_may_be_compiled_leaves_what_it_reads_to_after_step(coeff):
    """On the H200 inductor computed ACT's ensemble count after its own shift in the same
    compiled step (the action came out about half of the eager one; bench/results/
    2026-12-01-b1100bf-*). So the part of a tick that may be compiled (session.raw_step) writes
    no region it reads before writing: of the arena it may only write the history ring (pushed
    before it is read) and the queue (on an infer tick, popped from the fresh chunk). The
    ensemble sums and counts and the noise counter are rewritten by Policy.after_step, which is
    never compiled. Every tick kind, through the ensemble counts' saturation."""
    n_action = 1 if coeff else 4
    pol = ChunkedPolicy(ll.LeRobotLike(n_obs_steps=2, n_action_steps=n_action, coeff=coeff))
    eng = Engine(pol, device="cpu", seed=5, fuse=False)
    s = eng._sessions["main"]
    may_write = {"queue", "hist.observation.state"} | {
        n for n in s.views if n.startswith("hist.observation.images.")
    }
    kinds, rewritten = set(), set()
    eng.step(OBS[0])
    for x in OBS[1:10]:
        kind = pol.tick_kind(s.steps)
        kinds.add(kind)
        before = {n: v.clone() for n, v in s.views.items()}
        obs = session.policy_inputs(s.inputs.dev, s.conversions(s.tick_names[kind]))
        with torch.no_grad():
            session.raw_step(pol, obs, s.views, s.action, s.chunk, kind)
            wrote = {n for n, v in s.views.items() if not torch.equal(v, before[n])}
            assert wrote <= may_write, f"tick kind {kind}: the step itself rewrote {wrote}"
            pol.after_step(kind, s.views, s.action, s.chunk)
            rewritten |= {n for n, v in s.views.items() if not torch.equal(v, before[n])} - wrote
            for n, v in s.views.items():  # back to the boundary; the engine takes the tick
                v.copy_(before[n])
        eng.step(x)
    assert kinds == ({0} if coeff else {0, 1, 2})
    assert rewritten == ({"ens_sum", "ens_count", "rng"} if coeff else {"rng"})


def test_a_fused_ensembling_policy_serves_the_eager_actions():
    """Temporal ensembling compiled (inductor's C++ backend): served, the same actions."""
    mk = lambda **kw: Engine(  # noqa: E731
        ChunkedPolicy(ll.LeRobotLike(n_obs_steps=1, n_action_steps=1, chunk_size=5, coeff=0.2)),
        device="cpu",
        seed=5,
        **kw,
    )
    fused, eager = mk(fuse=True), mk(fuse=False)
    assert fused.fuse and fused.fused_mismatch == ""
    np.testing.assert_allclose(run(fused, OBS[:9]), run(eager, OBS[:9]), rtol=0, atol=1e-5)


def test_the_check_runs_until_an_ensemble_queue_has_filled():
    """One tick kind is checked twice by default; an ensembling chunked policy asks for
    chunk_len + 1 ticks, so the saturated counts (and their clamp) are compared too."""
    ticks = []
    out = {"x": torch.zeros(2)}

    def check(min_ticks: int) -> int:
        ticks.clear()
        why = fusecheck.check_fused(
            lambda step: 0,
            lambda kind, fused: ticks.append(fused),
            lambda: None,
            [()],
            {},
            out,
            min_ticks=min_ticks,
        )
        assert why == ""
        return ticks.count(True)

    assert check(0) == fusecheck.SEEN
    assert check(21) == 21
    assert check(10_000) == fusecheck.MAX_TICKS
    ens = ll.LeRobotLike(n_obs_steps=1, n_action_steps=1, chunk_size=5, coeff=0.01)
    assert ChunkedPolicy(ens).check_ticks == 6 and ChunkedPolicy(ll.LeRobotLike()).check_ticks == 0
