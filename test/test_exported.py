"""A user's functional policy saved with torch.export, served through the arena and capsules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flashrt_ros import Engine, load_policy
from test.engine_util import observations


class UserPolicy(torch.nn.Module):
    """(obs, goal, h, count) -> (action, new_h, new_count): a recurrent policy, functional."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.cell = torch.nn.GRUCell(18, 16)
        self.out = torch.nn.Linear(16, 6)

    def forward(self, obs, goal, h, count):
        h2 = self.cell(torch.cat([obs, goal])[None], h[None])[0]
        action = obs[:6] + 0.1 * torch.tanh(self.out(h2))
        return action, h2, count + 1


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    m = UserPolicy().eval()
    args = (torch.zeros(12), torch.zeros(6), torch.zeros(16), torch.zeros(1, dtype=torch.int64))
    path = tmp_path_factory.mktemp("export") / "user_policy.pt2"
    torch.export.save(torch.export.export(m, args), str(path))
    return m, path


def test_exported_policy_matches_the_module_step_by_step(program):
    module, path = program
    policy = load_policy(str(path))
    assert (policy.obs_dim, policy.action_dim, policy.goal_dim) == (12, 6, 6)
    eng = Engine(policy, device="cpu")
    assert [r["name"] for r in eng.layout][:2] == ["s0", "s1"]
    h, count = torch.zeros(16), torch.zeros(1, dtype=torch.int64)
    obs = observations(40, seed=9)
    eng.set_goal([0.2] * 6)
    goal = torch.full((6,), 0.2)
    with torch.no_grad():
        for o in obs:
            a, h, count = module(torch.as_tensor(o, dtype=torch.float32), goal, h, count)
            assert np.allclose(eng.step(o), a.numpy(), atol=1e-6)
    assert int(eng.session("main").views["s1"][0, 0]) == 40


def test_exported_policy_capsules_restore_exactly(program):
    _, path = program
    eng = Engine(load_policy(str(path)), device="cpu")
    obs = observations(60, seed=4)
    for o in obs[:20]:
        eng.step(o)
    cap = eng.checkpoint()
    first = np.array([eng.step(o) for o in obs[20:]])
    eng.restore(cap.id)
    assert np.array_equal(np.array([eng.step(o) for o in obs[20:]]), first)


class DelayLine(torch.nn.Module):
    """(obs, goal, cur, prev) -> (prev, obs, cur): acts on the observation of two ticks ago.
    Its last new state is an input returned as it is."""

    def forward(self, obs, goal, cur, prev):
        return prev * 1.0, obs * 1.0, cur


def test_a_state_returned_as_it_is_keeps_its_old_value(tmp_path):
    """A new state that is a state input unchanged (a delay line) was copied back after the
    state it came from had been overwritten: the engine acted on the observation one tick old
    instead of two. The engine's actions are now the program's own."""
    m = DelayLine()
    path = tmp_path / "delay.pt2"
    args = tuple(torch.zeros(3) for _ in range(4))  # four tensors, none aliasing another
    torch.export.save(torch.export.export(m, args), path)
    eng = Engine(load_policy(str(path)), device="cpu")
    cur = prev = torch.zeros(3)
    for t in range(1, 6):
        obs = np.full(3, float(t), np.float32)
        want, cur, prev = m(torch.from_numpy(obs), torch.zeros(3), cur, prev)
        assert np.array_equal(eng.step(obs), want.numpy()), t


def test_export_without_state_or_bad_arity_is_refused(tmp_path):
    class NoGoal(torch.nn.Module):
        def forward(self, obs):
            return (obs[:6],)

    p = tmp_path / "nogoal.pt2"
    torch.export.save(torch.export.export(NoGoal(), (torch.zeros(12),)), str(p))
    with pytest.raises(ValueError, match="obs, goal"):
        load_policy(str(p))


def test_a_program_whose_state_would_broadcast_or_that_draws_noise_is_refused(tmp_path):
    """A new state of another shape than its input would be broadcast into the arena (and
    another dtype cast) after every step; randomness drawn inside the program is not in the
    arena, so no restore could replay it. Both are refused at load, naming the problem."""

    class WrongStateShape(torch.nn.Module):
        def forward(self, obs, goal, h):
            return obs[:6], (h.sum() + obs.sum())[None]

    class DrawsNoise(torch.nn.Module):
        def forward(self, obs, goal, h):
            return obs[:6] + torch.randn(6), h + 1

    args = (torch.zeros(12), torch.zeros(6), torch.zeros(16))
    for m, match in ((WrongStateShape(), "shape and dtype"), (DrawsNoise(), "randomness")):
        p = tmp_path / f"{type(m).__name__}.pt2"
        torch.export.save(torch.export.export(m, args), str(p))
        with pytest.raises(ValueError, match=match):
            load_policy(str(p))
