"""ArmModel and the expert: limits, tracking, input validation, determinism. No ROS."""

import numpy as np
import pytest

from flashrt_ros.sim.dynamics import ArmModel, expert_action, random_goal


def test_defaults_and_observation():
    arm = ArmModel()
    assert arm.n == 6 and arm.dt == 0.01
    obs = arm.observation()
    assert obs.shape == (12,) and obs.dtype == np.float64
    assert np.array_equal(obs, np.concatenate([arm.q, arm.dq]))
    q = arm.q
    q[0] = 99.0  # a copy: the model is untouched
    assert arm.q[0] == 0.0


def test_tracks_a_target():
    arm = ArmModel()
    target = np.array([0.5, -0.3, 1.0, 0.0, -1.2, 0.7])
    for _ in range(400):
        arm.step(target)
    np.testing.assert_allclose(arm.q, target, atol=1e-4)
    np.testing.assert_allclose(arm.dq, 0.0, atol=1e-3)


def test_velocity_and_position_limits():
    arm = ArmModel(lower=-1.0, upper=1.0, max_vel=0.8)
    for _ in range(500):
        arm.step(np.full(6, 5.0))  # far outside: clamped to the upper limit
        assert np.all(np.abs(arm.dq) <= 0.8 + 1e-12)
        assert np.all(arm.q <= 1.0) and np.all(arm.q >= -1.0)
    np.testing.assert_allclose(arm.q, 1.0, atol=1e-6)
    for _ in range(500):
        arm.step(np.full(6, -5.0))
        assert np.all(arm.q >= -1.0)
    np.testing.assert_allclose(arm.q, -1.0, atol=1e-6)


def test_limit_zeroes_velocity():
    # stiff, undamped servo overshoots: hitting the limit must stop it there.
    arm = ArmModel(lower=-0.2, upper=0.2, damping=0.0, max_vel=5.0, max_acc=1e3)
    arm.reset(np.full(6, -0.2))
    hit = False
    for _ in range(200):
        arm.step(np.full(6, 0.2))
        if np.all(arm.q == 0.2):
            hit = True
            assert np.all(arm.dq == 0.0)
            break
    assert hit


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros(5),
        np.zeros(7),
        np.zeros((2, 6)),
        [0, 0, np.nan, 0, 0, 0],
        [0, 0, 0, np.inf, 0, 0],
        "abc",
    ],
)
def test_bad_target_leaves_state_unchanged(bad):
    arm = ArmModel()
    for _ in range(10):
        arm.step(np.full(6, 0.3))
    before = (arm.q, arm.dq, arm.target, arm.steps)
    with pytest.raises(ValueError):
        arm.step(bad)
    after = (arm.q, arm.dq, arm.target, arm.steps)
    for a, b in zip(before[:3], after[:3], strict=True):
        assert a.tobytes() == b.tobytes()
    assert before[3] == after[3]


def test_reset_validates():
    arm = ArmModel()
    with pytest.raises(ValueError):
        arm.reset(np.full(6, 10.0))
    with pytest.raises(ValueError):
        arm.reset(np.zeros(3))
    arm.reset(np.full(6, 0.25))
    assert np.array_equal(arm.q, np.full(6, 0.25)) and np.array_equal(arm.dq, np.zeros(6))
    with pytest.raises(ValueError):
        ArmModel(lower=1.0, upper=0.0)


def _rollout(seed):
    arm = ArmModel(seed=seed)
    goal = arm.random_goal()
    obs = []
    for _ in range(200):
        arm.step(arm.expert_action(goal))
        obs.append(arm.observation())
    return goal, np.array(obs)


def test_deterministic_given_seed():
    g1, o1 = _rollout(3)
    g2, o2 = _rollout(3)
    g3, _ = _rollout(4)
    assert g1.tobytes() == g2.tobytes() and o1.tobytes() == o2.tobytes()
    assert not np.array_equal(g1, g3)


def test_random_goal_within_limits():
    rng = np.random.default_rng(0)
    for _ in range(100):
        g = random_goal(rng)
        assert g.shape == (6,) and np.all(g > -2.5) and np.all(g < 2.5)
    arm = ArmModel(lower=[-1, -2, -1, -2, -1, -0.5], upper=[1, 2, 1, 2, 1, 0.5])
    for _ in range(100):
        g = arm.random_goal(rng)
        assert np.all(g >= arm.lower) and np.all(g <= arm.upper)


def test_expert_step_bounded_and_clamped():
    q = np.array([0.0, 0.0, 2.45, 0.0, 0.0, 0.0])
    goal = np.array([3.0, -3.0, 3.0, 0.01, 0.0, 0.0])
    a = expert_action(q, np.zeros(6), goal, max_step=0.05)
    assert np.all(np.abs(a - q) <= 0.05 + 1e-15)
    assert a[2] == 2.5  # clamped to the upper limit
    np.testing.assert_allclose(a[3], 0.3 * 0.01)
    assert a[4] == 0.0
    # velocity damping pulls the target against the motion
    b = expert_action(np.zeros(6), np.full(6, 0.5), np.zeros(6))
    assert np.all(b < 0)
    with pytest.raises(ValueError):
        expert_action(np.zeros(6), np.zeros(5), np.zeros(6))


def test_expert_converges_in_sim():
    for seed in range(5):
        arm = ArmModel(seed=seed)
        arm.reset(arm.random_goal())
        goal = arm.random_goal()
        for _ in range(1500):
            target = arm.expert_action(goal)
            assert np.all(np.abs(target - arm.q) <= 0.05 + 1e-12)
            arm.step(target)
        np.testing.assert_allclose(arm.q, goal, atol=1e-3)
        assert np.abs(arm.dq).max() < 1e-2
