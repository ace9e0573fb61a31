"""What a policy author gets wrong, caught before a robot sees it (a policy author's review).

Each case is a `Policy` subclass written the way the README describes, with one typical
mistake. Before, every one of them served: outputs left unwritten went out as zeros, and
state kept outside the arena made capsules, restores and resets continue differently while
every checksum agreed. Now an unwritten output faults like a NaN at its step, and the Engine's
build refuses a step that is not a function of its arena and inputs, naming the cause.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from flashrt_ros.errors import BadRequest, StepFault
from flashrt_ros.policies.base import InputSpec, Policy, StateEntry
from flashrt_ros.runtime.engine import Engine

OBS = np.random.default_rng(3).uniform(-0.5, 0.5, size=(4, 12)).astype(np.float32)


class Gru(Policy):
    """A correct policy: a float hidden state, written in place."""

    policy_id = "test:mistakes"
    obs_dim, action_dim, goal_dim, chunk_len = 12, 6, 6, 2

    def __init__(self):
        super().__init__()
        self.cell = torch.nn.GRUCell(12, 6)

    def state_spec(self) -> list[StateEntry]:
        return [StateEntry("h", torch.float32, (1, 6), "recurrent")]

    def new_h(self, obs, state) -> torch.Tensor:
        return self.cell(obs, state["h"])

    def step(self, obs, state, action, chunk) -> None:
        h = self.new_h(obs, state)
        state["h"].copy_(h)
        action.copy_(h + 0.01 * state["goal"])
        chunk.copy_(action.unsqueeze(1).expand_as(chunk))


class ActionRebound(Gru):
    def step(self, obs, state, action, chunk) -> None:
        state["h"].copy_(self.new_h(obs, state))
        action = state["h"].clone()  # noqa: F841 - the mistake: a new local, nothing written
        chunk.copy_(state["h"].unsqueeze(1).expand_as(chunk))


class ActionPartial(Gru):
    def step(self, obs, state, action, chunk) -> None:
        h = self.new_h(obs, state)
        state["h"].copy_(h)
        action[:, :3].copy_(h[:, :3])  # the mistake: joints 4-6 never written
        chunk.copy_(h.unsqueeze(1).expand_as(chunk))


class CounterAttribute(Gru):
    def __init__(self):
        super().__init__()
        self.ticks = 0  # the mistake: state in a Python attribute

    def step(self, obs, state, action, chunk) -> None:
        self.ticks += 1
        super().step(obs * self.ticks, state, action, chunk)


class OwnBuffer(Gru):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.zeros(1, 6))  # the mistake: a buffer it updates

    def step(self, obs, state, action, chunk) -> None:
        self.bias.add_(0.1)
        super().step(obs, state, action, chunk)
        action.add_(self.bias)


class StateReplaced(Gru):
    def step(self, obs, state, action, chunk) -> None:
        state["h"] = self.new_h(obs, state)  # the mistake: replaced, not written in place
        action.copy_(state["h"])
        chunk.copy_(action.unsqueeze(1).expand_as(chunk))


class TorchNoise(Gru):
    def step(self, obs, state, action, chunk) -> None:
        super().step(obs + 0.01 * torch.randn_like(obs), state, action, chunk)


class PythonNoise(Gru):
    def step(self, obs, state, action, chunk) -> None:
        super().step(obs * random.random(), state, action, chunk)


class NoisyOptedOut(TorchNoise):
    probe_purity = False  # the author's own call: its capsules continue only approximately


def build(cls) -> Engine:
    torch.manual_seed(0)
    return Engine(cls().eval(), device="cpu", seed=1)


def test_a_correct_policy_builds_and_continues_bit_for_bit_after_a_restore():
    eng = build(Gru)
    eng.step(OBS[0])
    cap = eng.checkpoint()
    first = [eng.step(o) for o in OBS[1:]]
    eng.restore(cap.id)
    assert np.array_equal(first, [eng.step(o) for o in OBS[1:]])


@pytest.mark.parametrize("cls", [ActionRebound, ActionPartial])
def test_an_output_left_unwritten_faults_instead_of_going_out_as_zeros(cls):
    eng = build(cls)
    with pytest.raises(StepFault, match="left unwritten"):
        eng.step(OBS[0])
    assert "non-finite action" in eng.poisoned("main")


@pytest.mark.parametrize(
    ("cls", "said"),
    [
        (
            CounterAttribute,
            r"two steps from the same state \(step 0\) and inputs differ in the state",
        ),
        (OwnBuffer, "differ in action"),
        (TorchNoise, "draws randomness of its own"),
        (PythonNoise, "draws randomness of its own"),
        (StateReplaced, "replaced state 'h' instead of writing it in place"),
    ],
)
def test_a_step_that_is_not_a_function_of_its_arena_is_refused_at_build(cls, said):
    with pytest.raises(BadRequest, match=said) as e:
        build(cls)
    assert "test:mistakes" in str(e.value) and "state_spec" in str(e.value)


def test_a_policy_may_opt_out_of_the_probe_for_kernels_that_are_not_deterministic():
    eng = build(NoisyOptedOut)
    assert eng.step(OBS[0]).shape == (6,)


class Declared(Gru):
    """Gru with its declaration taken from the test: one mistake at a time."""

    def __init__(self, spec=None, inputs=None, **attrs):
        super().__init__()
        self._spec, self._inputs = spec, inputs
        for k, v in attrs.items():
            setattr(self, k, v)

    def state_spec(self):
        return super().state_spec() if self._spec is None else self._spec

    def input_spec(self):
        return super().input_spec() if self._inputs is None else self._inputs


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        (
            {"spec": [StateEntry("h", torch.float32, (1, -6))]},
            r"state_spec\(\)\[0\] \('h'\): shape",
        ),
        ({"spec": [StateEntry("h", "float32", (1, 6))]}, r"\('h'\): dtype must be a torch.dtype"),
        ({"spec": [StateEntry("goal", torch.float32, (1, 6))]}, "a region the Engine adds"),
        ({"spec": ("h", torch.float32)}, r"state_spec\(\)\[0\] is str"),
        ({"action_dim": 0}, "action_dim must be an integer >= 1"),
        (
            {"obs_dim": 10, "inputs": [InputSpec("observation.state", (12,), "vector")]},
            r"obs_dim is 10 but its input 'observation.state' has shape \(12,\)",
        ),
        ({"obs_dim": 10}, r"fails on the state at step 0 \(kind 0\) and example inputs: Runtime"),
        (
            {"spec": [StateEntry("h", torch.float32, (1, 6)), StateEntry("h", torch.int64, (1,))]},
            r"state_spec\(\)\[0\]: the name 'h' is declared more than once",
        ),
        ({"spec": [StateEntry("h", torch.float32, (1, 6), "memory")]}, r"role must be one of"),
        (
            {
                "inputs": [
                    InputSpec("observation.state", (12,), "vector"),
                    InputSpec("observation.force", (3,), "vector"),
                ]
            },
            "set takes_dict = True",
        ),
    ],
)
def test_a_declaration_that_does_not_hold_together_is_refused_naming_the_field(kw, said):
    """Raw torch or Python errors before (a RuntimeError from the arena for a negative shape),
    or nothing at all (a second vector input staged and never given to the step)."""
    with pytest.raises(BadRequest, match=said):
        Engine(Declared(**kw).eval(), device="cpu")


def test_weights_outside_the_state_dict_are_warned_about(caplog):
    """The engine fingerprint reads the state dict: a capsule made with other values of a
    plain tensor attribute, or of a buffer registered with persistent=False, loaded and
    restored unseen."""
    p = Gru()
    p.scale = torch.ones(6)  # the mistake: a weight that is not registered
    p.cell.register_buffer("shift", torch.zeros(6), persistent=False)  # nor is this one
    with caplog.at_level("WARNING", logger="flashrt_ros.engine"):
        Engine(p.eval(), device="cpu")
    assert "tensor(s) scale, cell.shift are outside the state dict" in caplog.text


@pytest.mark.parametrize("spec", ["builtin:hybrid", "builtin:act", "builtin:diffusion"])
def test_the_builtins_are_not_warned_about_their_config_tensors(spec):
    """The built-ins keep index ranges, schedules and grids computed from their configuration
    outside the state dict (the policy id covers them), named in `derived_buffers`: every start
    of the default node warned the user to register them as weights. A tensor not named there
    is still warned about."""
    from flashrt_ros import load_policy
    from flashrt_ros.runtime.policy_checks import warn_unregistered_tensors

    p = load_policy(spec)
    assert warn_unregistered_tensors(p) == []
    p.stray = torch.ones(3)
    assert warn_unregistered_tensors(p) == ["stray"]


def test_numpy_integer_sizes_are_taken():
    """`obs_dim = np.prod(shape)` is a numpy integer: served before the checks, and still."""
    eng = Engine(Declared(obs_dim=np.int64(12)).eval(), device="cpu")
    assert eng.step(OBS[0]).shape == (6,)


class PopAfterInfer(Gru):
    """Two tick kinds: an infer every 4 ticks fills a queue and sets how many rows are left;
    the pops in between read the queue at N - left. From the initial state (left 0) a pop
    would index past the queue: the build's probe follows the policy's own order."""

    tick_kinds = ("infer", "pop")
    N = 4

    def state_spec(self):
        return [
            *super().state_spec(),
            StateEntry("queue", torch.float32, (1, self.N, 6)),
            StateEntry("left", torch.int64, (1,)),
        ]

    def tick_kind(self, step: int) -> int:
        return 0 if step % self.N == 0 else 1

    def step_kind(self, kind, obs, state, action, chunk) -> None:
        if kind == 0:
            h = self.new_h(obs, state)
            state["h"].copy_(h)
            state["queue"].copy_(h[:, None] * torch.arange(1, self.N + 1)[None, :, None])
        row = state["queue"].index_select(1, self.N - state["left"] if kind else state["left"])
        action.copy_(row[:, 0])
        chunk.copy_(row[:, :1].expand_as(chunk))

    def after_step(self, kind, state, action, chunk) -> None:
        if kind == 0:
            state["left"].fill_(self.N - 1)
        else:
            state["left"].sub_(1)


def test_the_probe_runs_a_policy_in_its_own_order_of_tick_kinds():
    """The probe ran every kind from the initial state, where a pop indexes past the queue: a
    valid policy was refused ("INDICES element is out of DATA bounds", core diff review)."""
    eng = build(PopAfterInfer)
    acts = [eng.step(o) for o in np.resize(OBS, (9, 12))]
    assert np.isfinite(acts).all()
