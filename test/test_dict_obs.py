"""Dict observations (`engine.step({"observation.state": ..., "observation.images.<cam>": ...})`):
every key checked before any buffer is touched, a bad one refused naming the key and changing
nothing; the plain vector form still serves builtin:hybrid."""

from __future__ import annotations

import numpy as np
import pytest

from flashrt_ros import Engine, load_policy
from flashrt_ros.errors import BadRequest
from flashrt_ros.policies.chunked import ChunkedPolicy
from test import lerobot_like as ll
from test.engine_util import observations
from test.test_chunked import obs_stream

TOP, WRIST, STATE = "observation.images.top", "observation.images.wrist", "observation.state"


def eng() -> Engine:
    e = Engine(ChunkedPolicy(ll.LeRobotLike()), device="cpu", obs_limit=100.0)
    for o in obs_stream(6, seed=9):  # a history, a queue and used noise to lose
        e.step(o)
    return e


def good() -> dict:
    return obs_stream(1, seed=3)[0]


def with_(key, value) -> dict:
    o = good()
    o[key] = value
    return o


def without(key) -> dict:
    o = good()
    del o[key]
    return o


img = np.zeros((*ll.TOP_HW, 3), dtype=np.uint8)
nan_state = np.array([0.0, np.nan, 0.0, 0.0])
BAD = [
    (with_(STATE, nan_state), STATE, "NaN"),
    (with_(STATE, np.array([0.0, 0.0, np.inf, 0.0])), STATE, "NaN or Inf"),
    (with_(STATE, np.array([0.0, 0.0, 0.0, 1e3])), STATE, "obs_limit"),
    (with_(STATE, np.zeros(5)), STATE, "shape"),
    (with_(STATE, ["a", 1, 2, 3]), STATE, "not a number"),
    (with_(TOP, img.astype(np.float32)), TOP, "uint8"),
    (with_(TOP, img[:, :, :1]), TOP, "shape"),
    (with_(TOP, img.transpose(2, 0, 1)), TOP, "shape"),  # CHW is not the wire layout
    (with_(TOP, img.tolist()), TOP, "numpy array"),
    (with_(WRIST, np.zeros((*ll.WRIST_HW, 3), dtype=np.uint8)), WRIST, "shape"),
    (without(WRIST), WRIST, "missing"),
    (with_("observation.images.side", img), "observation.images.side", "unknown"),
]


@pytest.mark.parametrize("obs, key, why", BAD, ids=[f"{k}-{w}" for _, k, w in BAD])
def test_a_bad_key_is_refused_naming_it_and_changes_nothing(obs, key, why):
    e = eng()
    s = e.session("main")
    before = e.state_bytes(), e.session_step()
    staged = {n: t.clone() for n, t in s.inputs.dev.items()}
    with pytest.raises(BadRequest, match=why) as err:
        e.step(obs)
    assert key in str(err.value)
    assert (e.state_bytes(), e.session_step()) == before
    assert all(np.array_equal(staged[n], t) for n, t in s.inputs.dev.items())
    with pytest.raises(BadRequest):
        e.rollout([good(), obs])  # a bad later row: not even the first row is stepped
    assert (e.state_bytes(), e.session_step()) == before


def test_the_vector_form_is_refused_for_a_policy_with_images():
    e = eng()
    with pytest.raises(BadRequest, match="dict observation"):
        e.step(np.zeros(4))


def test_a_goal_for_a_policy_that_takes_none_is_refused_saying_so():
    e = eng()
    assert e.goal_dim == 0
    before = e.state_bytes()
    with pytest.raises(BadRequest, match="takes no goal"):
        e.set_goal([0.1] * 6)
    with pytest.raises(BadRequest, match="not a number|must be numbers"):
        e.set_goal("abc")  # not a goal at all: that is said first
    cap = e.checkpoint().id
    with pytest.raises(BadRequest, match="takes no goal"):
        e.branch(cap, "alt", goal=np.ones(6))
    assert "alt" not in e.sessions() and e.state_bytes() == before
    e.set_goal([])  # the empty goal is this policy's goal


def test_rollout_of_dicts_equals_stepping():
    a, b = eng(), eng()
    rows = obs_stream(7, seed=4)
    assert np.array_equal(a.rollout(rows), np.array([b.step(o) for o in rows]))


def test_observation_spec_tells_the_wire_layout():
    spec = eng().observation_spec()
    assert spec[STATE] == {"kind": "vector", "shape": (4,), "dtype": "float32", "encoding": None}
    assert spec[TOP]["shape"] == (*ll.TOP_HW, 3) and spec[TOP]["encoding"] == "rgb8"
    assert spec[WRIST]["shape"] == (*ll.WRIST_HW, 1) and spec[WRIST]["encoding"] == "mono8"


@pytest.mark.parametrize(
    "enc, why",
    [
        ({TOP: "yuv422"}, "one of"),
        ({"observation.images.nope": "rgb8"}, "not image inputs"),
        ({WRIST: "rgb8"}, "mono8"),
        ({STATE: "rgb8"}, "not image inputs"),
    ],
)
def test_bad_image_encodings_are_refused(enc, why):
    with pytest.raises(BadRequest, match=why):
        Engine(ChunkedPolicy(ll.LeRobotLike()), device="cpu", image_encodings=enc)


def test_the_vector_form_and_the_dict_form_serve_builtin_hybrid_alike():
    policy = load_policy("builtin:hybrid", d_model=16, n_heads=2)
    a = Engine(policy, device="cpu")
    b = Engine(policy, device="cpu")
    obs = observations(12)
    va = np.array([a.step(o) for o in obs])
    vb = np.array([b.step({STATE: o}) for o in obs])
    assert np.array_equal(va, vb)
    assert a.observation_spec() == {
        STATE: {"kind": "vector", "shape": (12,), "dtype": "float32", "encoding": None}
    }
    with pytest.raises(BadRequest, match="unknown"):
        a.step({STATE: obs[0], TOP: img})


def test_immutable_tells_arrays_over_bytes_from_arrays_that_can_change():
    """What the staging may keep (runtime/inputs.py): only memory that is a bytes object, as a
    camera message decoded in place (strided views and read-only memoryviews of it too)."""
    import array

    from flashrt_ros.runtime.inputs import immutable

    raw = bytes(range(256)) * 12
    over_bytes = np.frombuffer(raw, dtype=np.uint8)
    assert immutable(over_bytes.reshape(16, 16, 12))
    assert immutable(over_bytes.reshape(16, 192)[:, :150])  # padded rows: a strided view
    assert immutable(np.frombuffer(memoryview(raw), dtype=np.uint8))
    writable = bytearray(raw)
    assert not immutable(np.frombuffer(writable, dtype=np.uint8))  # bytearray can change
    assert not immutable(np.frombuffer(array.array("B", raw), dtype=np.uint8))  # rclpy's data
    read_only = np.zeros(10, np.uint8)
    read_only.flags.writeable = False  # a flag, not a promise: its owner may still write
    assert not immutable(read_only) and not immutable(read_only[2:])


def test_on_the_cpu_every_step_copies_its_images():
    """On the CPU the step reads the staging buffer itself, which a policy could write: nothing
    is kept there, even for an immutable image (the CUDA test covers the keeping)."""
    eng = Engine(load_policy("test.lerobot_like:make_stats"), device="cpu")
    inputs = eng.session("main").inputs
    spec = eng.observation_spec()
    obs = {
        k: np.zeros(v["shape"], np.float32)
        if v["kind"] == "vector"
        else np.frombuffer(bytes(int(np.prod(v["shape"]))), np.uint8).reshape(v["shape"])
        for k, v in spec.items()
    }
    n = inputs.copies
    for _ in range(3):
        eng.step(obs)
    assert not inputs.keeps and inputs.copies == n + 3 * len(obs)


def test_prestage_refuses_what_is_not_an_image_input_and_keeps_nothing_on_the_cpu():
    """Engine.prestage checks the name, shape and dtype like a step's image (BadRequest naming
    it); on the CPU nothing is kept, so it returns False and the steps are unchanged."""
    eng = Engine(load_policy("test.lerobot_like:make_stats"), device="cpu")
    ref = Engine(load_policy("test.lerobot_like:make_stats"), device="cpu")
    top = np.frombuffer(bytes(range(256)) * (ll.TOP_HW[0] * ll.TOP_HW[1] * 3 // 256 + 1), np.uint8)
    top = top[: ll.TOP_HW[0] * ll.TOP_HW[1] * 3].reshape(*ll.TOP_HW, 3)
    for name, img, why in [
        ("observation.images.nope", top, "not an image input"),
        ("observation.state", top, "not an image input"),
        ("observation.images.top", top[:-1], "must have shape"),
        ("observation.images.top", top.astype(np.float32), "dtype uint8"),
        ("observation.images.top", [1, 2], "numpy array"),
    ]:
        with pytest.raises(BadRequest, match=why):
            eng.prestage(name, img)
    inputs = eng.session("main").inputs
    n = inputs.copies
    assert eng.prestage("observation.images.top", top) is False
    assert inputs.copies == n
    spec = eng.observation_spec()
    obs = {k: np.zeros(v["shape"], np.uint8) for k, v in spec.items() if v["kind"] == "image"}
    obs["observation.state"] = np.ones(4, np.float32)
    obs["observation.images.top"] = top
    np.testing.assert_array_equal(eng.step(obs), ref.step(obs))


def test_keys_of_other_types_and_a_non_dict_encoding_are_bad_requests():
    """Mixed-type extra keys could not even be sorted for the message (TypeError), and a
    string for image_encodings failed in dict() before its own check (Python's message)."""
    e = eng()
    before = e.state_bytes(), e.session_step()
    obs = good()
    obs[0] = img
    obs["extra"] = img
    with pytest.raises(BadRequest, match="0.*extra|extra.*0"):
        e.step(obs)
    assert (e.state_bytes(), e.session_step()) == before
    with pytest.raises(BadRequest, match="image_encodings must be a dict"):
        Engine(ChunkedPolicy(ll.LeRobotLike()), device="cpu", image_encodings="bgr8")
