"""The runtime core on the CPU: static arena, the step plan, validation, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flashrt_ros import Engine, load_policy
from flashrt_ros.errors import BadRequest, CapacityError, UnknownReference
from flashrt_ros.policies.hybrid import HybridPolicy
from flashrt_ros.runtime.arena import ALIGN
from test.engine_util import make_engine, observations


def eager_reference(policy: HybridPolicy, seed: int, obs: np.ndarray) -> np.ndarray:
    """Plain eager PyTorch: the same policy over ordinary, separately allocated tensors."""
    state = {e.name: torch.zeros(e.shape, dtype=e.dtype) for e in policy.state_spec()}
    state["goal"] = torch.zeros(1, policy.goal_dim)
    state["step"] = torch.zeros(1, dtype=torch.int64)
    policy.init_state(state, seed)
    out = []
    with torch.no_grad():
        for o in obs:
            x = torch.as_tensor(o, dtype=torch.float32)[None]
            act, _ = policy.forward_state(x, state, inplace=False)
            state["step"] = state["step"] + 1
            out.append(act[0].numpy().astype(np.float64))
    return np.array(out)


def test_plan_matches_eager_reference_for_500_steps():
    eng = make_engine()
    obs = observations(500)
    served = np.array([eng.step(o) for o in obs])
    ref = eager_reference(load_policy("builtin:hybrid"), 0, obs)
    assert np.array_equal(served, ref)


def test_same_seed_engines_agree_bit_for_bit_and_seed_matters():
    obs = observations(120)
    a, b = make_engine(seed=3), make_engine(seed=3)
    ra = np.array([a.step(o) for o in obs])
    rb = np.array([b.step(o) for o in obs])
    assert np.array_equal(ra, rb)
    assert a.state_bytes() == b.state_bytes()
    c = make_engine(seed=4)
    rc = np.array([c.step(o) for o in obs])
    assert not np.array_equal(ra, rc)  # the noise key comes from the seed


def test_policy_is_stateful():
    eng = make_engine()
    o = observations(1)[0]
    first = eng.step(o)
    for x in observations(30, seed=5):
        eng.step(x)
    assert not np.array_equal(first, eng.step(o))


@pytest.mark.parametrize(
    "bad",
    [
        np.full(12, np.nan),
        np.r_[np.zeros(11), np.inf],
        np.r_[np.zeros(11), -np.inf],
        np.zeros(11),
        np.zeros(13),
        np.zeros((1, 12)),
        np.r_[np.zeros(11), 1e39],  # overflows float32
        np.r_[np.zeros(11), 1e30],  # finite, but would overflow the state (beyond obs_limit)
        ["a"] * 12,
        ["0.5"] * 12,  # strings are not numbers, even when they parse as one
        [True] * 12,
        torch.zeros(12, requires_grad=True),
        None,
    ],
)
def test_refused_observation_changes_nothing(bad):
    eng = make_engine()
    for o in observations(10):
        eng.step(o)
    before, obs_before, step = (
        eng.state_bytes(),
        eng.session("main").obs.clone(),
        eng.session_step(),
    )
    with pytest.raises(ValueError):
        eng.step(bad)
    assert eng.state_bytes() == before
    assert torch.equal(eng.session("main").obs, obs_before)
    assert eng.session_step() == step


def test_rollout_checks_every_row_first():
    eng = make_engine()
    obs = observations(5)
    obs[3, 2] = np.nan
    before = eng.state_bytes()
    with pytest.raises(ValueError, match="row 3"):
        eng.rollout(obs)
    assert eng.state_bytes() == before


def test_step_allocates_nothing_new():
    """The arena and the IO buffers are the same storage for the session's whole life."""
    eng = make_engine()
    s = eng.session("main")
    base = s.arena.buf.data_ptr()
    ptrs = {k: v.data_ptr() for k, v in s.views.items()}
    io = (s.obs.data_ptr(), s.action.data_ptr(), s.chunk.data_ptr())
    assert base % ALIGN == 0
    for k, v in s.views.items():
        assert base <= v.data_ptr() < base + s.arena.nbytes, k
        assert (v.data_ptr() - base) % ALIGN == 0, k
    for o in observations(1000):
        eng.step(o)
    assert s.arena.buf.data_ptr() == base
    assert {k: v.data_ptr() for k, v in s.views.items()} == ptrs
    assert (s.obs.data_ptr(), s.action.data_ptr(), s.chunk.data_ptr()) == io
    assert int(s.views["step"][0]) == 1000 == eng.session_step()


def test_layout_table_and_fingerprint():
    eng = make_engine()
    roles = {r["role"] for r in eng.layout}
    assert {"kv", "recurrent", "conv", "queue", "noise", "goal", "counter", "meta"} <= roles
    ends = [r["offset"] + r["nbytes"] for r in eng.layout]
    assert max(ends) <= eng.state_nbytes
    assert all(r["offset"] % ALIGN == 0 for r in eng.layout)
    # other weights or another layout give another fingerprint
    other = Engine(load_policy("builtin:hybrid", kv_len=32), device="cpu")
    assert other.fingerprint != eng.fingerprint
    p = load_policy("builtin:hybrid")
    with torch.no_grad():
        p.head.bias.add_(1e-3)
    assert Engine(p, device="cpu").fingerprint != eng.fingerprint


def test_set_goal_validated_and_applied():
    eng = make_engine()
    ref = make_engine()
    obs = observations(40)
    for o in obs[:20]:
        eng.step(o)
        ref.step(o)
    before = eng.state_bytes()
    for bad in ([1.0] * 5, [math.nan] * 6, [[0.0] * 6]):
        with pytest.raises(ValueError):
            eng.set_goal(bad)
    assert eng.state_bytes() == before
    eng.set_goal([0.5] * 6)
    assert np.allclose(eng.get_goal(), 0.5)
    a = np.array([eng.step(o) for o in obs[20:]])
    b = np.array([ref.step(o) for o in obs[20:]])
    assert not np.array_equal(a, b)


def test_sessions_limits_and_names():
    eng = make_engine(max_sessions=2)
    eng.create_session("alt")
    with pytest.raises(CapacityError, match="max_sessions"):
        eng.create_session("third")
    with pytest.raises(ValueError):
        eng.create_session("bad/name")
    with pytest.raises(UnknownReference, match="unknown session"):
        eng.step(observations(1)[0], session="nope")
    eng.drop_session("alt")
    with pytest.raises(BadRequest):
        eng.drop_session("main")
    with pytest.raises(UnknownReference):
        eng.drop_session("alt")


def test_device_resolution():
    assert make_engine(device="auto").device.type in ("cpu", "cuda")
    with pytest.raises(ValueError):
        make_engine(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            make_engine(device="cuda")


def test_load_policy_specs(tmp_path):
    assert load_policy("builtin:hybrid").obs_dim == 12
    p = load_policy("test.engine_util:make_engine".replace("make_engine", "tiny_policy"))
    assert p.config.d_model == 16
    for bad in (
        "builtin:nope",
        "",
        "no_such_module:f",
        "test.engine_util:observations",
        str(tmp_path / "missing.pt2"),
        "plain words",
    ):
        with pytest.raises(ValueError):
            load_policy(bad)
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a program")
    with pytest.raises(ValueError, match="torch.export"):
        load_policy(str(junk))


def test_a_policy_module_that_fails_says_which_error_and_where(tmp_path, monkeypatch):
    """A user's module that raises while it is imported (a missing robot SDK, a bad config
    read) or a factory that raises: the error names the module, the exception's type and the
    line, since the node logs one line for a failed configure, never a traceback."""
    (tmp_path / "broken_at_import.py").write_text(
        "x = 1\nraise RuntimeError('missing my_robot_sdk')\n"
    )
    (tmp_path / "broken_factory.py").write_text(
        "def make():\n    cfg = {}\n    return cfg['hidden']\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(BadRequest) as e:
        load_policy("broken_at_import:make")
    msg = str(e.value)
    assert "importing 'broken_at_import' raised RuntimeError: missing my_robot_sdk" in msg, msg
    assert "broken_at_import.py:2" in msg, msg
    with pytest.raises(BadRequest) as e:
        load_policy("broken_factory:make")
    msg = str(e.value)
    assert "failed: KeyError: 'hidden'" in msg and "broken_factory.py:3" in msg, msg


def test_a_weights_file_reaches_the_factory_or_is_refused(tmp_path):
    """The node's `weights` parameter is never silently unused: a factory that takes `weights`
    gets the path, one that does not and a .pt2 (which carries its own) refuse it."""
    path = tmp_path / "gain.pt"
    torch.save({"gain": 0.125}, path)
    p = load_policy("test.tiny_policy:tiny_from", weights=str(path))
    assert float(p.gain) == 0.125
    with pytest.raises(BadRequest, match="takes no `weights` argument"):
        load_policy("test.tiny_policy:tiny", weights=str(path))
    program = tmp_path / "any.pt2"
    program.write_bytes(b"refused before it is read")
    with pytest.raises(BadRequest, match="carries its own weights"):
        load_policy(str(program), weights=str(path))
    assert float(load_policy("test.tiny_policy:tiny", weights="").gain) == 0.5  # '' = none
    # LeRobot-shaped in its attributes, but not a torch module: refused at load, not at build
    with pytest.raises(BadRequest, match="neither a flashrt Policy"):
        load_policy("test.tiny_policy:not_a_module")


def test_weights_digest_tells_dtypes_and_shapes_and_takes_bfloat16():
    """The same bytes as another dtype or shape are other weights (the digest hashed bytes
    only); a bfloat16 parameter, which numpy cannot hold, digests instead of failing."""
    from test.tiny_policy import TinyPolicy

    def digest(t: torch.Tensor) -> str:
        p = TinyPolicy()
        p.register_buffer("extra", t)
        return p.weights_digest()

    a, b = digest(torch.zeros(2, 3)), digest(torch.zeros(3, 2))
    c = digest(torch.zeros(6, dtype=torch.int32))
    assert len({a, b, c}) == 3
    half = digest(torch.ones(4, dtype=torch.bfloat16))
    assert half != digest(torch.ones(4, dtype=torch.float16))
    p = TinyPolicy().to(torch.bfloat16)
    assert len(p.weights_digest()) == 32


def test_an_explicit_weights_file_of_another_config_is_refused():
    """Weights trained with another head count have the same shapes, so they loaded without a
    word when given explicitly (the shipped file was compared, an explicit one was not)."""
    from flashrt_ros.policies.loader import BUILTIN_WEIGHTS
    from flashrt_ros.policies.visuomotor_common import WEIGHTS_DIR

    with pytest.raises(BadRequest, match="n_heads=4 .asked 8."):
        load_policy("builtin:hybrid", weights=str(BUILTIN_WEIGHTS), n_heads=8)
    assert load_policy("builtin:hybrid", weights=str(BUILTIN_WEIGHTS), kv_len=128).obs_dim == 12
    act = WEIGHTS_DIR / "act.pt"
    with pytest.raises(BadRequest, match="n_heads"):
        load_policy("builtin:act", weights=str(act), n_heads=8)
