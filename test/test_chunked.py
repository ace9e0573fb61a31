"""LeRobot-shaped chunked policies served from the arena (policies/chunked.py), on the CPU.

What users rely on: the observation history, the action queue and the noise are all in the
capsule (restore and branch continue bit for bit across re-inference boundaries; restoring only
part of it does not), the module runs exactly every n_action_steps ticks, temporal ensembling
is LeRobot's, images arrive as float CHW in [0, 1] in RGB order, and a module that draws its own
randomness is refused at load.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from flashrt_ros import Engine, load_policy
from flashrt_ros.errors import BadRequest
from flashrt_ros.policies.chunked import ChunkedPolicy
from flashrt_ros.runtime.recipes import restore_regions
from test import lerobot_like as ll


def obs_stream(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "observation.state": rng.normal(size=ll.STATE_DIM).astype(np.float32),
            "observation.images.top": rng.integers(0, 256, (*ll.TOP_HW, 3), dtype=np.uint8),
            "observation.images.wrist": rng.integers(0, 256, ll.WRIST_HW, dtype=np.uint8),
        }
        for _ in range(n)
    ]


def engine(module=None, **kw) -> Engine:
    return Engine(ChunkedPolicy(module or ll.LeRobotLike()), device="cpu", seed=5, **kw)


def run(eng: Engine, obs: list[dict], session: str = "main") -> np.ndarray:
    return np.array([eng.step(o, session=session) for o in obs])


OBS = obs_stream(40)


def test_restore_replays_queue_history_and_noise_across_inference_boundaries():
    eng = engine()
    run(eng, OBS[:5])  # mid-queue: cursor 1, a history of real steps, one noise draw used
    cap = eng.checkpoint(name="mid")
    before = eng.state_bytes()
    acts = run(eng, OBS[5:22])  # infers at ticks 8, 12, 16, 20
    after = eng.state_bytes()
    eng.restore(cap.id)
    assert eng.state_bytes() == before
    again = run(eng, OBS[5:22])
    assert np.array_equal(acts, again)
    assert eng.state_bytes() == after


# (role left out of the restore, the tick to checkpoint at): the history matters when the
# next tick infers from it (at 8), the queue when the next ticks pop it (at 5)
@pytest.mark.parametrize("role, at", [("history", 8), ("queue", 5), ("noise", 5)])
def test_restoring_all_but_one_kind_of_state_diverges(role, at):
    eng = engine()
    run(eng, OBS[:at])
    cap = eng.checkpoint()
    acts = run(eng, OBS[at:22])
    others = tuple({r["role"] for r in eng.layout} - {role})
    restore_regions(eng, cap.id, "main", others)  # step counter restored, `role` is not
    eng.session("main").steps = at
    again = run(eng, OBS[at:22])
    assert not np.array_equal(acts, again)
    eng.restore(cap.id)  # the whole arena: identical again
    assert np.array_equal(run(eng, OBS[at:22]), acts)


def test_branch_continues_like_the_original():
    eng = engine()
    run(eng, OBS[:7])
    cap = eng.checkpoint()
    main = run(eng, OBS[7:20])
    eng.branch(cap.id, "alt")
    assert np.array_equal(run(eng, OBS[7:20], session="alt"), main)


def test_the_module_runs_exactly_every_n_action_steps_ticks():
    module = ll.LeRobotLike(n_action_steps=4)
    eng = engine(module)
    module.calls = 0  # the load-time purity probes called it
    kinds = []
    for k, o in enumerate(OBS[:13]):
        kinds.append(eng.next_tick_kind())
        eng.step(o)
        assert module.calls == k // 4 + 1
    # n_obs_steps 2: the tick before an infer records its observation, which the infer reads
    assert kinds == ["infer", "queue", "queue", "record"] * 3 + ["infer"]


def test_only_ticks_whose_observation_an_infer_reads_stage_it():
    """A queue tick neither stages, uploads nor keeps the observation (an infer never reads
    it): with n_obs_steps 3 and 6 action steps, the two ticks before each infer record it, and
    the batch the module sees is the last 3 observations, as LeRobot's queue holds them."""
    module = ll.LeRobotLike(n_action_steps=6, n_obs_steps=3)
    eng = engine(module)
    s = eng.session("main")
    staged, kinds = [], []
    for o in OBS[:13]:
        kinds.append(eng.next_tick_kind())
        before = s.inputs.copies
        eng.step(o)
        staged.append(s.inputs.copies - before)
    assert kinds == (["infer", "queue", "queue", "queue", "record", "record"] * 2) + ["infer"]
    n_in = len(eng.observation_spec())
    assert staged == [0 if k == "queue" else n_in for k in kinds]
    # the infer at tick 12 saw ticks 10, 11, 12, in order
    top = module.batches[-1]["observation.images.top"][0]  # (T, C, H, W) in [0, 1]
    for t, k in enumerate((10, 11, 12)):
        want = torch.from_numpy(OBS[k]["observation.images.top"]).permute(2, 0, 1) / 255.0
        assert torch.equal(top[t], want.float())


def test_queue_ticks_pop_the_latest_chunk_in_order_and_the_chunk_is_the_plan_from_now():
    module = ll.LeRobotLike(n_action_steps=4, chunk_size=6)
    eng = engine(module)
    for k, o in enumerate(OBS[:8]):
        a, plan = eng.step_with_chunk(o)
        pred = module.outputs[-1][0].double().numpy()  # the latest chunk the module returned
        cursor = k % 4
        assert np.array_equal(a, pred[cursor])
        want = pred[np.minimum(np.arange(6) + cursor, 5)]  # past the chunk's end: hold
        assert np.array_equal(plan, want)


def test_noise_comes_from_the_arena_and_differs_per_inference_and_seed():
    a = engine()
    acts = run(a, OBS[:12])
    b = Engine(ChunkedPolicy(ll.LeRobotLike()), device="cpu", seed=6)
    assert not np.array_equal(acts, run(b, OBS[:12]))  # another seed, other noise
    quiet = engine(ll.LeRobotLike(noise=False))
    assert "rng" not in quiet.session("main").views  # no noise argument: no noise state
    run(quiet, OBS[:12])


def lerobot_ensembler(chunks: list[np.ndarray], coeff: float) -> list[np.ndarray]:
    """LeRobot's ACTTemporalEnsembler.update, transcribed to numpy (float64)."""
    c = chunks[0].shape[1]
    w = np.exp(-coeff * np.arange(c))
    cum = np.cumsum(w)
    ens, count, out = None, None, []
    for a in chunks:
        if ens is None:
            ens, count = a.copy(), np.ones((c, 1), dtype=np.int64)
        else:
            ens = ens * cum[count - 1]
            ens = ens + a[:, :-1] * w[count]
            ens = ens / cum[count]
            count = np.minimum(count + 1, c)
            ens = np.concatenate([ens, a[:, -1:]], 1)
            count = np.concatenate([count, np.ones_like(count[-1:])])
        out.append(ens[:, 0].copy())
        ens, count = ens[:, 1:], count[1:]
    return out


@pytest.mark.parametrize("coeff", [0.01, 0.7, -0.3])
def test_temporal_ensembling_matches_lerobots_ensembler(coeff):
    module = ll.LeRobotLike(n_obs_steps=1, n_action_steps=1, chunk_size=5, coeff=coeff)
    eng = engine(module)
    module.outputs.clear()
    built = module.calls  # the load-time probes' calls (the adapter's, the Engine's)
    acts = run(eng, OBS[:9])  # past chunk_size: the counts saturate
    assert module.calls == built + 9  # every tick infers
    chunks = [o.double().numpy() for o in module.outputs]
    ref = lerobot_ensembler(chunks, coeff)
    np.testing.assert_allclose(acts, np.concatenate(ref), rtol=0, atol=2e-6)


def test_ensembled_state_restores_exactly():
    eng = engine(ll.LeRobotLike(n_obs_steps=1, n_action_steps=1, chunk_size=5, coeff=0.2))
    run(eng, OBS[:3])
    cap = eng.checkpoint()
    acts = run(eng, OBS[3:12])
    eng.restore(cap.id)
    assert np.array_equal(run(eng, OBS[3:12]), acts)


@pytest.mark.parametrize("top", ["rgb8", "bgr8"])
@pytest.mark.parametrize("wrist", ["rgb8", "mono8"])
def test_images_reach_the_module_as_float_chw_in_0_1_in_rgb_order(top, wrist):
    eng = Engine(
        load_policy("test.lerobot_like:make_stats"),
        device="cpu",
        image_encodings={"observation.images.top": top, "observation.images.wrist": wrist},
    )
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (*ll.TOP_HW, 3), dtype=np.uint8)
    img[0, 0], img[-1, -1] = 0, 255  # min and max present
    w_shape = ll.WRIST_HW if wrist == "mono8" else (*ll.WRIST_HW, 3)
    w = rng.integers(0, 256, w_shape, dtype=np.uint8)
    a = eng.step(
        {
            "observation.state": np.zeros(4),
            "observation.images.top": img,
            "observation.images.wrist": w,
        }
    )
    want = ll.expected_stats(img, w, top, wrist)
    np.testing.assert_allclose(a, want, rtol=0, atol=1e-6)


def test_a_mono_camera_feeds_a_one_channel_input():
    eng = Engine(load_policy("test.lerobot_like:make_stats", wrist_c=1), device="cpu")
    assert eng.observation_spec()["observation.images.wrist"]["shape"] == (*ll.WRIST_HW, 1)
    w = np.full(ll.WRIST_HW, 51, dtype=np.uint8)
    img = np.zeros((*ll.TOP_HW, 3), dtype=np.uint8)
    a = eng.step(
        {
            "observation.state": np.zeros(4),
            "observation.images.top": img,
            "observation.images.wrist": w,
        }
    )
    np.testing.assert_allclose(a[5:8], [0.2, 0.2, 0.2], atol=1e-7)


def test_a_module_drawing_its_own_randomness_is_refused_at_load():
    with pytest.raises(BadRequest, match="not a pure function"):
        load_policy("test.lerobot_like:make_impure")


class OwnHistory(ll.LeRobotLike):
    """Keeps its own observation history, as LeRobot's policies do around their pure part
    (the first observation repeated to fill it): the same batch twice in a row gives the same
    chunk, but a capsule cannot hold the deque, so a restore would continue from another
    history."""

    def __init__(self):
        super().__init__(n_obs_steps=1)
        self.seen: list[torch.Tensor] = []

    def predict_action_chunk(self, batch: dict, noise: torch.Tensor | None = None):
        state = batch["observation.state"]
        self.seen = (self.seen or [state, state])[-1:] + [state]
        return self._predict_plain(batch) + 0.1 * self.seen[0].sum() + 0.1 * noise


def test_a_module_keeping_its_own_history_is_refused_at_load():
    with pytest.raises(BadRequest, match="not a pure function.*observation history"):
        ChunkedPolicy(OwnHistory())


def test_features_written_as_plain_dicts_are_read_like_lerobot_features():
    """LeRobot's config.json stores each feature as {"type": ..., "shape": [...]}."""
    m = ll.LeRobotLike()
    as_dicts = {
        name: {"type": f.type.name, "shape": list(f.shape)}
        for name, f in m.config.input_features.items()
    }
    m.config.input_features = as_dicts
    m.config.output_features = {"action": {"type": "ACTION", "shape": [ll.ACTION_DIM]}}
    eng = engine(m)
    ref = engine()
    obs = obs_stream(6)
    assert np.array_equal([eng.step(o) for o in obs], [ref.step(o) for o in obs])


def test_a_state_feature_of_more_than_one_dim_is_refused_not_trimmed():
    m = ll.LeRobotLike()
    m.config.input_features["observation.state"] = ll.PolicyFeature(
        ll.FeatureType.STATE, (2, ll.STATE_DIM)
    )
    with pytest.raises(BadRequest, match=r"want a shape \(n,\), got \(2, 4\)"):
        ChunkedPolicy(m)


def test_a_call_that_fails_at_load_says_what_the_module_was_given():
    class NoHistory(ll.LeRobotLike):  # written for (B, D) states, served with n_obs_steps 2
        def predict_action_chunk(self, batch: dict, noise: torch.Tensor | None = None):
            return batch["observation.state"].view(1, ll.STATE_DIM) @ torch.zeros(ll.STATE_DIM, 18)

    with pytest.raises(BadRequest) as e:
        ChunkedPolicy(NoHistory())
    msg = str(e.value)
    assert "observation.state (1, 2, 4)" in msg and "n_obs_steps 2" in msg, msg
    assert "impure predict_action_chunk" in msg


def test_a_pure_module_with_nan_on_the_example_batch_is_served_with_a_warning(caplog):
    """NaN never equals NaN: a pure module whose output on the example batch holds NaN (a
    square root of a negative state value) was refused as "drawing its own randomness". It is
    accepted, with a warning; the engine refuses a non-finite action at the step itself."""

    class SqrtOfNegative(ll.LeRobotLike):
        def predict_action_chunk(self, batch: dict, noise: torch.Tensor | None = None):
            out = self._predict_plain(batch)
            return out + (-1.0 - out.abs()).sqrt()  # NaN, the same NaN at every call

    with caplog.at_level(logging.WARNING, logger="flashrt_ros.policies.chunked"):
        ChunkedPolicy(SqrtOfNegative())
    assert "NaN or Inf on an example batch" in caplog.text


def test_modules_that_do_not_fit_are_refused_with_a_reason():
    m = ll.LeRobotLike()
    m.config.n_action_steps = 9  # > chunk_size
    with pytest.raises(BadRequest, match="n_action_steps"):
        ChunkedPolicy(m)
    m = ll.LeRobotLike(n_obs_steps=1, n_action_steps=2, coeff=0.1)
    with pytest.raises(BadRequest, match="n_action_steps must be 1"):
        ChunkedPolicy(m)
    with pytest.raises(BadRequest, match="LeRobot-shaped"):
        ChunkedPolicy(torch.nn.Linear(2, 2))


def test_rewind_of_the_flight_recorder_replays_a_chunked_policy():
    eng = engine(flight_ticks=8)
    acts = run(eng, OBS[:15])
    assert eng.rewind(6) == 9
    assert np.array_equal(run(eng, OBS[9:15]), acts[9:15])


@pytest.mark.parametrize("spec", ["builtin:act", "builtin:diffusion"])
def test_builtin_visuomotor_policies_restore_bit_for_bit(spec):
    kw = {"num_inference_steps": 2} if spec == "builtin:diffusion" else {}
    policy = load_policy(spec, **kw)
    eng = Engine(policy, device="cpu", seed=1)
    spec_in = eng.observation_spec()
    rng = np.random.default_rng(2)

    def o():
        return {
            k: rng.normal(size=v["shape"]).astype(np.float32) * 0.1
            if v["kind"] == "vector"
            else rng.integers(0, 256, v["shape"], dtype=np.uint8)
            for k, v in spec_in.items()
        }

    obs = [o() for _ in range(14)]
    run(eng, obs[:3])
    cap = eng.checkpoint()
    acts = run(eng, obs[3:14])  # diffusion (n_action_steps 8) infers at tick 8
    eng.restore(cap.id)
    assert np.array_equal(run(eng, obs[3:14]), acts)
    assert math.isfinite(float(np.abs(acts).sum()))
