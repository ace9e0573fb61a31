"""The flight recorder on the CPU: every tick's state kept, rewind to any of them bit for bit,
frozen into capsules and files; bad requests refused without changing anything."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashrt_ros import Engine, load_policy
from flashrt_ros.errors import BadRequest, StepFault, UnknownReference
from flashrt_ros.policies.base import Policy, StateEntry
from test.engine_util import observations

OBS = observations(40, seed=7)


def tiny(ticks: int, **kw) -> Engine:
    """A small hybrid (test.engine_util's tiny_policy shape) with seeded weights, so two engines
    serve the same policy and capsules move between them."""
    policy = load_policy("builtin:hybrid", d_model=16, n_heads=2)
    return Engine(policy, device="cpu", seed=0, flight_ticks=ticks, **kw)


def run(eng: Engine, obs, session: str = "main") -> tuple[np.ndarray, dict[int, bytes]]:
    """Step through obs; the actions and the state bytes after each step, by step number."""
    acts, snaps = [], {}
    for o in obs:
        acts.append(eng.step(o, session=session))
        snaps[eng.session_step(session)] = eng.state_bytes(session)
    return np.array(acts), snaps


def test_ring_holds_the_last_n_states_and_wraps():
    eng = tiny(4)
    assert eng.flight() == [0]  # a fresh session holds its initial state
    assert eng.flight_bytes() == 4 * eng.state_nbytes
    run(eng, OBS[:3])
    assert eng.flight() == [0, 1, 2, 3]
    run(eng, OBS[3:10])
    assert eng.flight() == [7, 8, 9, 10]  # wrapped: only the last 4
    eng.fork_scratch()  # internal what-if session: no ring, no memory
    assert eng.flight_bytes() == 4 * eng.state_nbytes


@pytest.mark.parametrize("k", [1, 2, 5])
def test_rewind_then_same_observations_replays_bit_identically(k):
    eng = tiny(6)
    acts, snaps = run(eng, OBS[:20])  # 20 steps through a ring of 6: wrapped three times
    assert eng.rewind(k) == 20 - k
    assert eng.session_step() == 20 - k
    assert eng.state_bytes() == snaps[20 - k]
    assert eng.flight() == list(range(15, 21 - k))  # older steps of this line stay held
    again, snaps2 = run(eng, OBS[20 - k : 20])
    assert np.array_equal(again, acts[20 - k :])
    assert snaps2[20] == snaps[20]
    assert eng.flight() == list(range(15, 21))


def test_rewind_twice_and_continue_past_the_old_end():
    eng, ref = tiny(8), tiny(0)
    acts, _ = run(ref, OBS[:30])
    run(eng, OBS[:12])
    assert eng.rewind(3) == 9
    assert eng.rewind(2) == 7  # a second rewind reaches further back on the same line
    assert eng.flight() == [5, 6, 7]
    again, _ = run(eng, OBS[7:30])
    assert np.array_equal(again, acts[7:])
    assert eng.state_bytes() == ref.state_bytes()


def test_a_goal_swapped_between_steps_is_part_of_the_recorded_state():
    """The ring keeps the state each step started from, so a rewind across a goal change
    replays the steps that saw the new goal exactly."""
    eng = tiny(8)
    run(eng, OBS[:4])
    eng.set_goal([0.3, -0.2, 0.1, 0.4, 0.0, -0.5])
    acts, snaps = run(eng, OBS[4:10])
    assert eng.rewind(6) == 4
    assert np.allclose(eng.get_goal(), [0.3, -0.2, 0.1, 0.4, 0.0, -0.5])
    again, _ = run(eng, OBS[4:10])
    assert np.array_equal(again, acts)
    assert eng.state_bytes() == snaps[10]


def test_restore_branch_copy_and_reset_start_a_new_line():
    eng = tiny(8, max_sessions=3)
    run(eng, OBS[:5])
    cap = eng.checkpoint()
    run(eng, OBS[5:9])
    assert eng.flight() == list(range(1, 10))[-8:]
    eng.restore(cap.id)
    assert eng.flight() == [5]  # the steps after 5 belonged to another line
    with pytest.raises(BadRequest):
        eng.rewind(1)
    acts, _ = run(eng, OBS[5:8])
    assert eng.flight() == [5, 6, 7, 8]
    eng.branch(cap.id, session="alt")
    assert eng.flight("alt") == [5]  # the branch session has its own ring
    assert eng.flight() == [5, 6, 7, 8]
    alt, _ = run(eng, OBS[5:8], session="alt")
    assert np.array_equal(alt, acts)
    assert eng.rewind(2, session="alt") == 6
    assert eng.flight() == [5, 6, 7, 8]  # main's ring is untouched
    assert eng.flight_bytes() == 2 * 8 * eng.state_nbytes
    eng.copy_session("main", "b")
    assert eng.flight("b") == [8]
    eng.reset()
    assert eng.flight() == [0] and eng.session_step() == 0


BAD = [
    (0, "main"),
    (4, "main"),  # == len(flight()): the current state is not "back"
    (-1, "main"),
    (True, "main"),
    ("1", "main"),
    (1.0, "main"),
    (None, "main"),
    (1, "nope"),
    (1, "_scratch"),
    (1, None),
]


@pytest.mark.parametrize("k,session", BAD)
def test_bad_rewinds_are_refused_and_change_nothing(k, session):
    eng = tiny(4)
    run(eng, OBS[:3])
    eng.fork_scratch()
    before = (eng.state_bytes(), eng.session_step(), eng.flight())
    with pytest.raises(ValueError) as e:
        eng.rewind(k, session=session)
    assert isinstance(e.value, BadRequest)
    if session in ("nope", "_scratch"):
        assert isinstance(e.value, UnknownReference)
    assert (eng.state_bytes(), eng.session_step(), eng.flight()) == before
    assert eng.rewind(np.int64(3)) == 0  # numpy ints are ints


def test_a_session_that_has_not_stepped_says_there_is_nothing_to_rewind_to():
    eng = tiny(4)
    before = eng.state_bytes()
    with pytest.raises(BadRequest, match="holds only its current step 0: nothing to rewind"):
        eng.rewind(1)  # it said "k must be in [1, 0]"
    assert eng.state_bytes() == before and eng.session_step() == 0
    one = tiny(1)  # a ring of one never holds a step to go back to
    run(one, OBS[:3])
    with pytest.raises(BadRequest, match="nothing to rewind to with flight_ticks 1"):
        one.rewind(1)


def test_recorder_off_allocates_nothing_and_refuses_rewind():
    eng = tiny(0)
    assert eng.session("main").flight is None and eng.flight_bytes() == 0
    run(eng, OBS[:3])
    before = eng.state_bytes()
    assert eng.flight() == [3]
    with pytest.raises(BadRequest, match="flight_ticks"):
        eng.rewind(1)
    assert eng.state_bytes() == before and eng.session_step() == 3


@pytest.mark.parametrize("ticks", [-1, True, 2.0, "8", None])
def test_bad_flight_ticks_are_refused(ticks):
    with pytest.raises(BadRequest, match="flight_ticks"):
        tiny(ticks)


def test_checkpoint_at_a_past_step_survives_a_file_and_continues_like_the_original(tmp_path):
    eng = tiny(8)
    acts, snaps = run(eng, OBS[:12])
    info = eng.checkpoint_at(7, name="t7", pin=True)
    assert (info.step, info.session, info.name, info.pinned) == (7, "main", "t7", True)
    assert eng.session_step() == 12 and eng.flight() == list(range(5, 13))  # nothing moved
    path = eng.save_capsule("t7", tmp_path / "t7.fcap")
    fresh = tiny(8)
    loaded = fresh.load_capsule(path)
    assert (loaded.step, loaded.checksum) == (7, info.checksum)
    fresh.restore("t7")
    assert fresh.state_bytes() == snaps[7]
    again, _ = run(fresh, OBS[7:12])
    assert np.array_equal(again, acts[7:])
    current = eng.checkpoint_at(12)  # the current step is an ordinary checkpoint
    assert current.checksum == eng.state_checksum()


@pytest.mark.parametrize("step", [4, 13, -1, True, "7", 7.0])
def test_checkpoint_at_an_unrecorded_step_is_refused(step):
    eng = tiny(8)
    run(eng, OBS[:12])
    before = (eng.capsules(), eng.state_bytes(), eng.flight())
    with pytest.raises(BadRequest):
        eng.checkpoint_at(step)
    assert (eng.capsules(), eng.state_bytes(), eng.flight()) == before


def test_save_flight_step_writes_a_loadable_capsule_file(tmp_path):
    eng = tiny(8, max_sessions=2)
    eng.branch(eng.checkpoint().id, session="arm2")
    _, snaps = run(eng, OBS[:10], session="arm2")
    path = eng.save_flight_step(6, tmp_path / "dump.fcap", session="arm2")
    header, _ = eng.store.read(path)
    assert (header["id"], header["step"], header["session"]) == ("arm2-6", 6, "arm2")
    fresh = tiny(0)
    info = fresh.load_capsule(path)
    assert (info.step, info.session) == (6, "arm2")
    fresh.restore(info.id)
    assert fresh.state_bytes() == snaps[6]
    with pytest.raises(UnknownReference):
        eng.save_flight_step(1, tmp_path / "old.fcap", session="arm2")
    with pytest.raises(BadRequest, match="does not exist"):
        eng.save_flight_step(6, tmp_path / "no_such_folder" / "x.fcap", session="arm2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump.fcap"]


def test_save_flight_step_never_overwrites_a_file_or_follows_a_link(tmp_path):
    eng = tiny(4)
    run(eng, OBS[:3])
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    (tmp_path / "taken.fcap").write_bytes(b"mine")
    (tmp_path / "link.fcap").symlink_to(outside)
    for name in ("taken", "link"):
        with pytest.raises(BadRequest, match="exists"):
            eng.save_flight_step(2, tmp_path / f"{name}.fcap")
    assert (tmp_path / "taken.fcap").read_bytes() == b"mine"
    assert outside.read_bytes() == b"precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.fcap", "outside", "taken.fcap"]


class BlowUp(Policy):
    """A real policy that misbehaves: its action is NaN once |obs| > 900 (an accumulating state
    stays finite until then), as a learned policy can on out-of-distribution input."""

    policy_id = "test-blowup"
    obs_dim, action_dim, goal_dim, chunk_len = 2, 2, 2, 1

    def state_spec(self) -> list[StateEntry]:
        return [StateEntry("acc", torch.float32, (1, 2), "recurrent")]

    def step(self, obs, state, action, chunk) -> None:
        state["acc"].mul_(0.5).add_(obs)
        action.copy_(torch.sqrt(900.0 - obs.abs()) + state["acc"])
        chunk.copy_(action[:, None])


def test_rewind_brings_a_poisoned_session_back_to_the_state_before_the_fault(tmp_path):
    eng = Engine(BlowUp(), device="cpu", flight_ticks=8)
    ref = Engine(BlowUp(), device="cpu")
    good = [[0.1 * i, -0.2 * i] for i in range(6)]
    for o in good[:4]:
        eng.step(o)
        ref.step(o)
    with pytest.raises(StepFault):
        eng.step([950.0, 0.0])
    assert eng.poisoned() and eng.flight() == [0, 1, 2, 3, 4, 5]
    # the state it acted from, and the state it ended in, can be written out for a post-mortem
    for t in (4, 5):
        eng.save_flight_step(t, tmp_path / f"t{t}.fcap")
    header, _ = eng.store.read(tmp_path / "t5.fcap")
    assert header["step"] == 5
    assert eng.rewind(1) == 4
    assert eng.poisoned() == ""
    assert eng.state_bytes() == ref.state_bytes()
    for o in good[4:]:
        assert np.array_equal(eng.step(o), ref.step(o))
