"""The Engine's contract under bad input and faults: bounded inputs, poisoned sessions, argument
types, the session limit and the scratch session, all on the CPU with the real policy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashrt_ros import Engine, load_policy
from flashrt_ros.capsules.checksum import device_checksum
from flashrt_ros.errors import (
    BadName,
    BadRequest,
    CapacityError,
    CorruptCapsule,
    StepFault,
    UnknownReference,
)
from flashrt_ros.policies.hybrid import HybridConfig, HybridPolicy
from test.engine_util import make_engine, observations

OBS = observations(200, seed=7)


def warmed(n: int = 30, **kw) -> Engine:
    eng = make_engine(**kw)
    for o in OBS[:n]:
        eng.step(o)
    return eng


def snapshot(eng: Engine, session: str = "main") -> tuple:
    """Everything a refused request must leave alone."""
    s = eng.session(session)
    return (
        eng.state_bytes(session),
        s.obs.clone(),
        eng.session_step(session),
        eng.capsules(),
        eng.sessions(),
    )


def same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and torch.equal(a[1], b[1]) and a[2:] == b[2:]


def poison(eng: Engine, session: str = "main") -> None:
    """Drive a session into a non-finite action with a real, huge observation (the engine was
    built with a loose obs_limit so the value gets through)."""
    x = OBS[0].copy()
    x[3] = 1e30
    with pytest.raises(StepFault):
        for _ in range(5):
            eng.step(x, session=session)


# -- bounded observations and goals ---------------------------------------------------------------
@pytest.mark.parametrize("value", [1e30, -1e30, 1000.5, 3e38])
def test_huge_finite_observation_is_refused_before_any_buffer(value):
    eng = warmed()
    before = snapshot(eng)
    x = OBS[0].copy()
    x[4] = value
    with pytest.raises(BadRequest, match=r"observation\[4\].*1000"):
        eng.step(x)
    with pytest.raises(BadRequest, match=r"\[4\]"):
        eng.step_with_chunk(x)
    rows = OBS[:5].copy()
    rows[2, 4] = value
    with pytest.raises(BadRequest, match="row 2"):
        eng.rollout(rows)
    with pytest.raises(BadRequest, match="row 2"):
        eng.check_observations(rows)
    assert same(snapshot(eng), before)
    assert np.isfinite(eng.step(OBS[30])).all()  # and the session still serves


def test_huge_goal_is_refused_by_set_goal_and_branch():
    eng = warmed()
    cap = eng.checkpoint()
    before = snapshot(eng)
    with pytest.raises(BadRequest, match="1000"):
        eng.set_goal([0.0] * 5 + [1e30])
    with pytest.raises(BadRequest, match="1000"):
        eng.branch(cap.id, "alt", goal=[1e30] * 6)
    assert same(snapshot(eng), before) and "alt" not in eng.sessions()


def test_obs_limit_is_configurable_and_the_bound_itself_is_allowed():
    eng = make_engine(obs_limit=10.0)
    x = np.zeros(12)
    x[0] = 10.0
    assert np.isfinite(eng.step(x)).all()
    x[0] = 10.001
    with pytest.raises(BadRequest, match="10"):
        eng.step(x)
    # the default bound holds a sustained input at the bound without going non-finite
    eng = make_engine()
    for i in range(50):
        assert np.isfinite(eng.step(np.full(12, 1000.0 * (-1) ** i))).all()
    assert eng.checkpoint().step == 50


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "100", True, None, [10.0]])
def test_bad_obs_limit_is_refused(bad):
    with pytest.raises(BadRequest, match="obs_limit"):
        make_engine(obs_limit=bad)


# -- non-finite actions poison the session --------------------------------------------------------
def test_nonfinite_action_poisons_the_session_and_never_reaches_the_caller():
    eng = warmed(obs_limit=1e38)
    eng.create_session("alt")
    x = OBS[0].copy()
    x[3] = 1e30
    returned = []
    with pytest.raises(StepFault, match="non-finite"):
        for _ in range(5):
            returned.append(eng.step(x))
    assert all(np.isfinite(a).all() for a in returned)
    why = eng.poisoned()
    assert "non-finite" in why and f"step {eng.session_step()}" in why
    # a poisoned session refuses to step, saying how to recover, and changes nothing
    before = eng.state_bytes()
    for call in (
        lambda: eng.step(OBS[1]),
        lambda: eng.step_with_chunk(OBS[1]),
        lambda: eng.rollout(OBS[:3]),
    ):
        with pytest.raises(StepFault, match="restore.*reset|reset.*restore"):
            call()
    assert eng.state_bytes() == before
    # other sessions are untouched
    assert eng.poisoned("alt") == ""
    assert np.isfinite(eng.step(OBS[1], session="alt")).all()


class NaNChunkPolicy(HybridPolicy):
    """The builtin policy with a switch that makes the last point of its chunk NaN while the
    action stays finite (a policy bug in a head only the trajectory output uses)."""

    bad = False

    def step(self, obs, state, action, chunk) -> None:
        super().step(obs, state, action, chunk)
        if self.bad:
            chunk[0, -1, 0] = math.nan


def test_a_nonfinite_chunk_is_a_fault_when_the_chunk_is_returned():
    policy = NaNChunkPolicy(HybridConfig(d_model=16, n_heads=2))
    eng = Engine(policy, device="cpu")
    eng.step_with_chunk(OBS[0])
    policy.bad = True
    a = eng.step(OBS[1])  # the chunk is not returned: the finite action is served
    assert np.isfinite(a).all() and eng.poisoned() == ""
    with pytest.raises(StepFault, match="chunk"):
        eng.step_with_chunk(OBS[2])
    assert "chunk" in eng.poisoned() and "step 3" in eng.poisoned()


def test_checkpoint_refuses_a_poisoned_session_and_changes_no_pool_or_disk(tmp_path):
    eng = warmed(obs_limit=1e38, capsule_dir=tmp_path)
    poison(eng)
    with pytest.raises(BadRequest, match="poisoned"):
        eng.checkpoint()
    with pytest.raises(BadRequest, match="poisoned"):
        eng.checkpoint(name="x", persist=True)
    left = [p for p in tmp_path.iterdir() if not p.name.startswith(".flashrt.")]
    assert eng.capsules() == [] and left == []


def test_checkpoint_refuses_nan_or_inf_in_any_float_region(tmp_path):
    eng = warmed(capsule_dir=tmp_path)
    eng.checkpoint(name="good")
    before = eng.capsules()
    float_regions = [r["name"] for r in eng.layout if r["dtype"].startswith("float")]
    assert len(float_regions) >= 4
    for name in float_regions:
        v = eng.session("main").views[name]
        old = v.clone()
        v.view(-1)[-1] = math.inf if name == "goal" else math.nan
        with pytest.raises(BadRequest, match=name):
            eng.checkpoint()
        with pytest.raises(BadRequest, match=name):
            eng.checkpoint(name="persisted", persist=True)
        v.copy_(old)
    assert eng.capsules() == before
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".flashrt.")) == []
    assert eng.checkpoint().step == 30  # once finite again, it works


def test_reset_puts_the_session_back_to_its_initial_state():
    seed = 5
    eng = warmed(obs_limit=1e38, seed=seed)
    cap = eng.checkpoint()
    eng.branch(cap.id, "alt")
    poison(eng)
    eng.reset()
    fresh = make_engine(seed=seed)
    initial = fresh.state_bytes()
    assert eng.poisoned() == ""
    assert eng.state_bytes() == initial
    assert eng.session_step() == 0 and eng.session("main").parent_id == ""
    assert np.array_equal(
        np.array([eng.step(o) for o in OBS[:40]]), np.array([fresh.step(o) for o in OBS[:40]])
    )
    # a healthy branch resets too
    eng.reset("alt")
    assert eng.state_bytes("alt") == initial and eng.session_step("alt") == 0
    with pytest.raises(UnknownReference):
        eng.reset("nope")


def test_restore_and_branch_into_a_poisoned_session_clear_the_poison():
    eng = warmed(obs_limit=1e38)
    cap = eng.checkpoint()
    expect = np.array([eng.step(o) for o in OBS[30:60]])
    poison(eng)
    eng.restore(cap.id)
    assert eng.poisoned() == ""
    assert np.array_equal(np.array([eng.step(o) for o in OBS[30:60]]), expect)
    eng.branch(cap.id, "alt")
    poison(eng, "alt")
    eng.branch(cap.id, "alt")
    assert eng.poisoned("alt") == ""
    assert np.array_equal(np.array([eng.step(o, session="alt") for o in OBS[30:60]]), expect)


def test_a_nan_capsule_with_a_consistent_checksum_faults_instead_of_serving_nan():
    eng = warmed()
    cap = eng.checkpoint()
    pc = eng.pool.get(cap.id)
    row = next(r for r in eng.layout if r["role"] == "recurrent")
    region = eng.pool.slab[pc.slot, row["offset"] : row["offset"] + row["nbytes"]]
    region.view(torch.float32).fill_(math.nan)
    device_checksum(eng.pool.slab[pc.slot], out=pc.digest)  # the checksum agrees
    eng.restore(cap.id, verify=True)
    with pytest.raises(StepFault):
        for o in OBS[30:40]:
            assert np.isfinite(eng.step(o)).all()
    assert eng.poisoned()


class FailingPolicy(HybridPolicy):
    """The builtin policy with a switch that makes the device run out of memory mid-step."""

    fail = False

    def step(self, obs, state, action, chunk) -> None:
        if self.fail:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated by the policy)")
        super().step(obs, state, action, chunk)


def test_a_device_failure_during_a_step_is_a_step_fault_not_a_bad_request():
    policy = FailingPolicy(HybridConfig(d_model=16, n_heads=2))
    eng = Engine(policy, device="cpu")
    eng.step(OBS[0])
    policy.fail = True
    with pytest.raises(StepFault) as err:
        eng.step(OBS[1])
    assert not isinstance(err.value, ValueError)
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    assert "OutOfMemoryError" in eng.poisoned()
    policy.fail = False
    with pytest.raises(StepFault, match="poisoned"):
        eng.step(OBS[1])
    eng.reset()
    assert np.isfinite(eng.step(OBS[1])).all()


def test_rewritten_sessions_are_told_their_state_was_replaced():
    eng = warmed()
    cap = eng.checkpoint()
    eng.create_session("alt")
    calls: list[str] = []
    for name in ("main", "alt"):
        s = eng.session(name)
        s.state_replaced = lambda n=name: calls.append(n)
    eng.restore(cap.id)
    eng.branch(cap.id, "alt")
    eng.copy_session("main", "alt")
    eng.reset("alt")
    assert calls == ["main", "alt", "alt", "alt"]
    for o in OBS[:3]:
        eng.step(o)
    assert len(calls) == 4  # a step is not a replacement


# -- argument types -------------------------------------------------------------------------------
def bad_calls(eng: Engine, cap: str) -> list:
    o = OBS[0]
    grad = torch.zeros(12, requires_grad=True)
    return [
        lambda: eng.step(o, session=["main"]),
        lambda: eng.step(o, session=None),
        lambda: eng.step(grad),
        lambda: eng.step([str(v) for v in o]),
        lambda: eng.step([True] * 12),
        lambda: eng.step(list(o[:11]) + [True]),
        lambda: eng.step([list(o)]),
        lambda: eng.step({"a": 1}),
        lambda: eng.step(np.array(o, dtype=complex)),
        lambda: eng.step(torch.zeros(12, dtype=torch.bool)),
        lambda: eng.step("0" * 12),
        lambda: eng.step_with_chunk(o, session=1),
        lambda: eng.rollout([[0.0] * 12, [0.0] * 11]),
        lambda: eng.rollout([[0.0] * 11 + [True]]),
        lambda: eng.rollout("rows"),
        lambda: eng.rollout(None),
        lambda: eng.set_goal(5),
        lambda: eng.set_goal(np.float64(1.0)),
        lambda: eng.set_goal(["0.1"] * 6),
        lambda: eng.set_goal(torch.zeros(6, requires_grad=True)),
        lambda: eng.set_goal([0.0] * 6, session=("main",)),
        lambda: eng.get_goal(session=3),
        lambda: eng.branch(cap, "alt", goal=5),
        lambda: eng.branch(cap, "alt", goal=np.float32(1.0)),
        lambda: eng.branch(cap, "alt", goal="abcdef"),
        lambda: eng.branch(cap, ["alt"]),
        lambda: eng.branch(None, "alt"),
        lambda: eng.branch(["c0001"], "alt"),
        lambda: eng.checkpoint(session=["main"]),
        lambda: eng.checkpoint(name=5),
        lambda: eng.checkpoint(pin="yes"),
        lambda: eng.checkpoint(pin=1),
        lambda: eng.restore(cap, verify="no"),
        lambda: eng.restore(cap, session=None),
        lambda: eng.restore(None),
        lambda: eng.restore(["c0001"]),
        lambda: eng.capsule(7),
        lambda: eng.pin(cap, pinned=1),
        lambda: eng.pin({"id": cap}),
        lambda: eng.create_session(5),
        lambda: eng.create_session(None),
        lambda: eng.drop_session(["alt"]),
        lambda: eng.copy_session(["main"], "alt"),
        lambda: eng.copy_session("main", None),
        lambda: eng.session_step(1.5),
        lambda: eng.poisoned(None),
        lambda: eng.reset(["main"]),
        lambda: eng.fork_scratch(session=5),
        lambda: eng.fork_scratch(capsule=5),
        lambda: eng.fork_scratch(session="main", capsule=cap),
        lambda: eng.state_bytes(session=[]),
    ]


def test_every_bad_argument_is_a_bad_request_and_changes_nothing():
    eng = warmed()
    cap = eng.checkpoint(name="home").id
    before = snapshot(eng)
    calls = bad_calls(eng, cap)
    for i, call in enumerate(calls):
        try:
            call()
        except BadRequest:
            pass
        except Exception as e:  # pragma: no cover - the failure message names the call
            pytest.fail(f"bad call #{i} raised {type(e).__name__}: {e}")
        else:
            pytest.fail(f"bad call #{i} was accepted")
        assert same(snapshot(eng), before), f"bad call #{i} changed state"
        assert eng.poisoned() == ""


@pytest.mark.parametrize(
    "kw",
    [
        {"capsule_slots": None},
        {"capsule_slots": 2.5},
        {"capsule_slots": "4"},
        {"capsule_slots": True},
        {"capsule_slots": 0},
        {"host_capsule_slots": -1},
        {"host_capsule_slots": None},
        {"max_sessions": None},
        {"max_sessions": 0},
        {"max_sessions": 2.0},
        {"max_sessions": True},
        {"seed": None},
        {"seed": 1.5},
        {"seed": "0"},
        {"seed": False},
        {"seed": -1},  # the noise key takes 31 bits: -1 drew 2**31 - 1's noise
        {"seed": 2**31},  # and 2**31 drew seed 0's
        {"device": None},
        {"device": 0},
        {"device": "tpu"},
        {"device": "cuda:x"},
        {"use_graph": "yes"},
        {"fuse": 1},
        {"capsule_dir": 5},
    ],
)
def test_bad_constructor_arguments_are_bad_requests(kw):
    with pytest.raises(BadRequest):
        make_engine(**kw)


def test_constructor_refuses_a_non_policy():
    with pytest.raises(BadRequest, match="Policy"):
        Engine(torch.nn.Linear(2, 2), device="cpu")


def test_numpy_integers_and_tensors_are_accepted():
    eng = make_engine(seed=np.int64(3), capsule_slots=np.int32(2), max_sessions=np.int64(2))
    a = eng.step(torch.as_tensor(OBS[0], dtype=torch.float32))
    b = make_engine(seed=3).step(OBS[0].astype(np.float32))
    assert np.array_equal(a, b)
    eng.set_goal(np.zeros(6, dtype=np.int32))
    eng.branch(eng.checkpoint(pin=np.bool_(True)).id, "alt", goal=[])  # empty: keep the goal


def test_error_classes_name_what_went_wrong():
    eng = warmed(capsule_slots=1)
    with pytest.raises(UnknownReference, match="nope"):
        eng.step(OBS[0], session="nope")
    for call in (eng.restore, eng.capsule, lambda r: eng.branch(r, "alt")):
        with pytest.raises(UnknownReference):
            call("c9999")
    cap = eng.checkpoint(pin=True)
    with pytest.raises(CapacityError, match="pinned"):
        eng.checkpoint()
    eng.pin(cap.id, False)
    eng.pool.slab[eng.pool.get(cap.id).slot, 5] ^= 1
    with pytest.raises(CorruptCapsule):
        eng.restore(cap.id, verify=True)
    eng.checkpoint(name="x")
    with pytest.raises(BadName, match="taken"):
        eng.checkpoint(name="x")


# -- one owner of the session limit; the scratch session ------------------------------------------
def test_max_sessions_counts_user_sessions_and_scratch_is_hidden():
    eng = warmed(max_sessions=2)
    cap = eng.checkpoint()
    eng.create_session("alt")
    for call in (
        lambda: eng.create_session("third"),
        lambda: eng.branch(cap.id, "third"),
        lambda: eng.copy_session("main", "third"),
    ):
        with pytest.raises(CapacityError, match="max_sessions=2"):
            call()
    assert eng.sessions() == ["main", "alt"]
    name = eng.fork_scratch()  # does not count and is not listed
    assert name == "_scratch" and eng.sessions() == ["main", "alt"]
    eng.drop_session("alt")
    eng.create_session("again")  # dropping frees a place
    assert eng.sessions() == ["main", "again"]


def test_scratch_fork_of_a_session_rolls_out_without_touching_it():
    eng = warmed()
    main_before = eng.state_bytes()
    scratch = eng.fork_scratch()
    what_if = np.array([eng.step(o, session=scratch) for o in OBS[30:60]])
    assert eng.state_bytes() == main_before and eng.session_step() == 30
    assert eng.session_step(scratch) == 60
    assert np.array_equal(what_if, eng.rollout(OBS[30:60]))
    # a second fork starts again from the session, reusing the same captured session
    s = eng.session(scratch)
    assert eng.fork_scratch("main") == scratch and eng.session(scratch) is s
    assert eng.state_bytes(scratch) == eng.state_bytes()
    # committing the what-if into a named session works through copy_session
    eng.copy_session(scratch, "kept")
    assert eng.state_bytes("kept") == eng.state_bytes(scratch)


def test_scratch_fork_of_a_capsule_matches_a_branch():
    eng = warmed()
    cap = eng.checkpoint(name="here")
    for o in OBS[30:50]:
        eng.step(o)
    scratch = eng.fork_scratch(capsule="here")
    assert eng.session_step(scratch) == 30 and eng.session(scratch).parent_id == cap.id
    eng.branch(cap.id, "alt")
    a = eng.rollout(OBS[50:70], session=scratch)
    b = eng.rollout(OBS[50:70], session="alt")
    assert np.array_equal(a, b)
    with pytest.raises(UnknownReference):
        eng.fork_scratch(capsule="gone")
    with pytest.raises(UnknownReference):
        eng.fork_scratch(session="gone")


@pytest.mark.parametrize("name", ["_scratch", "_rollout", "_x"])
def test_names_starting_with_underscore_are_reserved(name):
    eng = warmed()
    cap = eng.checkpoint()
    eng.fork_scratch()
    before = snapshot(eng)
    scratch_before = eng.state_bytes("_scratch")
    for call in (
        lambda: eng.create_session(name),
        lambda: eng.branch(cap.id, name),
        lambda: eng.copy_session("main", name),
        lambda: eng.drop_session(name) if name == "_scratch" else eng.create_session(name),
    ):
        with pytest.raises(BadName, match="reserved|internal"):
            call()
    assert same(snapshot(eng), before) and eng.state_bytes("_scratch") == scratch_before


def test_a_poisoned_session_forks_a_poisoned_scratch():
    eng = warmed(obs_limit=1e38)
    poison(eng)
    scratch = eng.fork_scratch()
    assert eng.poisoned(scratch) == eng.poisoned() != ""
    before = eng.state_bytes(scratch)
    with pytest.raises(StepFault, match="poisoned"):
        eng.step(OBS[0], session=scratch)
    assert eng.state_bytes(scratch) == before  # refused before stepping
    eng.reset()
    eng.fork_scratch()
    assert np.isfinite(eng.step(OBS[0], session=scratch)).all()


# -- load_policy ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec, kw",
    [
        (None, {}),
        (5, {}),
        ("builtin:hybrid", {"kv_len": "64"}),
        ("builtin:hybrid", {"kv_len": 0}),
        ("builtin:hybrid", {"d_model": 2.5}),
        ("builtin:hybrid", {"n_heads": True}),
        ("builtin:hybrid", {"noise_std": math.nan}),
        ("builtin:hybrid", {"d_model": 30, "n_heads": 4}),
        ("builtin:hybrid", {"nope": 1}),
        ("builtin:hybrid", {"weights": 5}),
        ("builtin:nope", {}),
    ],
)
def test_load_policy_errors_are_bad_requests(spec, kw):
    with pytest.raises(BadRequest):
        load_policy(spec, **kw)


@pytest.mark.parametrize(
    "rows",
    [
        lambda: (np.zeros(12), np.ones(12, dtype=bool)),
        lambda: [[True] * 12, np.zeros(12)],
        lambda: [np.zeros(12), torch.ones(12, dtype=torch.bool)],
    ],
    ids=["bool-array-row", "bool-list-row", "bool-tensor-row"],
)
def test_a_bool_row_among_others_is_refused_and_nothing_steps(rows):
    """A bool row alone was refused, but mixed with float rows it was made 1.0s together with
    them, and the session stepped on it."""
    eng = make_engine()
    before = eng.state_bytes()
    with pytest.raises(BadRequest, match="observation row"):
        eng.rollout(rows())
    with pytest.raises(BadRequest, match="not a number"):
        eng.step([np.array(True)] + [0.0] * 11)
    assert eng.state_bytes() == before and eng.session_step() == 0


def test_a_flight_ring_too_big_to_allocate_is_a_capacity_error():
    """torch's allocator error came through raw; now it says what to lower."""
    with pytest.raises(CapacityError, match="lower flight_ticks"):
        make_engine(flight_ticks=2**50)  # its byte count does not fit in int64: no memory used
