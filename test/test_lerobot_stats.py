"""with_stats (policies/lerobot_stats.py): a LeRobot 0.4-style policy, which expects normalized
inputs and returns normalized actions, served with its dataset statistics inside the step.

What users rely on: the module sees exactly what LeRobot's normalizer would hand it (each
mode's formula, eps, per-channel image stats, the history axis), the robot gets actions in
its own units, a feature the mapping leaves alone passes through, the noise argument and
capsules keep working, and bad statistics are refused by name before anything runs.
(bench/lerobot_act_check.py checks the same against LeRobot's own processors and ACTPolicy.)
"""

from __future__ import annotations

import enum

import numpy as np
import pytest
import torch

from flashrt_ros import Engine
from flashrt_ros.errors import BadRequest
from flashrt_ros.policies.chunked import ChunkedPolicy
from flashrt_ros.policies.lerobot_stats import WithStatsNoise, with_stats
from test import lerobot_like as ll
from test.test_chunked import obs_stream


class Mode(str, enum.Enum):  # noqa: UP042 - LeRobot's NormalizationMode is a str enum like this
    MEAN_STD = "MEAN_STD"
    MIN_MAX = "MIN_MAX"
    QUANTILES = "QUANTILES"
    IDENTITY = "IDENTITY"


def stats(rng=None) -> dict:
    g = rng or np.random.default_rng(4)
    return {
        "observation.state": {
            "mean": g.normal(0, 0.5, ll.STATE_DIM).astype(np.float32),
            "std": g.uniform(0.3, 2.0, ll.STATE_DIM).astype(np.float32),
        },
        "observation.images.top": {
            "min": np.array([0.1, 0.0, 0.2], np.float32).reshape(3, 1, 1),
            "max": np.array([0.9, 1.0, 0.2], np.float32).reshape(3, 1, 1),  # blue: zero span
        },
        "observation.images.wrist": {"min": [[[0.05]]], "max": [[[0.95]]]},
        "action": {
            "mean": g.normal(0, 0.5, ll.ACTION_DIM).astype(np.float32),
            "std": g.uniform(0.1, 1.0, ll.ACTION_DIM).astype(np.float32),
        },
    }


def module(mapping=None, **kw) -> ll.LeRobotLike:
    m = ll.LeRobotLike(**kw)
    m.config.normalization_mapping = mapping or {
        "STATE": Mode.MEAN_STD,
        "VISUAL": Mode.MIN_MAX,
        "ACTION": Mode.MEAN_STD,
    }
    return m


def test_the_module_sees_normalized_inputs_and_the_robot_gets_its_own_units():
    st = stats()
    inner = module({"STATE": Mode.MEAN_STD, "VISUAL": "MIN_MAX", "ACTION": "MEAN_STD"})
    eng = Engine(ChunkedPolicy(with_stats(inner, st)), device="cpu", seed=5)
    obs = obs_stream(1, seed=9)[0]
    n_calls = inner.calls
    action = eng.step(obs)
    assert inner.calls == n_calls + 1  # this tick inferred
    seen = inner.batches[-1]

    s, s_st = obs["observation.state"], st["observation.state"]
    want = (s - s_st["mean"]) / (s_st["std"] + 1e-8)
    np.testing.assert_allclose(seen["observation.state"][0, -1].numpy(), want, rtol=1e-5, atol=1e-6)

    top = obs["observation.images.top"].astype(np.float32).transpose(2, 0, 1) / 255.0
    lo, hi = st["observation.images.top"]["min"], st["observation.images.top"]["max"]
    span = np.where(hi - lo == 0, 1e-8, hi - lo)
    want_top = 2 * (top - lo) / span - 1
    got_top = seen["observation.images.top"][0, -1].numpy()
    np.testing.assert_allclose(got_top[:2], want_top[:2], rtol=1e-5, atol=1e-5)
    # a zero span divides by eps, as LeRobot does: huge, and finite
    np.testing.assert_allclose(got_top[2], want_top[2], rtol=1e-4)

    a_st = st["action"]
    chunk = inner.outputs[-1][0].numpy()  # the module's normalized chunk, row 0 is this tick's
    np.testing.assert_allclose(action, chunk[0] * a_st["std"] + a_st["mean"], rtol=1e-5, atol=1e-6)


def test_quantile_modes_and_unmapped_features_as_lerobot():
    st = stats()
    st["observation.images.wrist"] = {"q01": [[[0.05]]], "q99": [[[0.95]]]}
    # top has min/max but no q01/q99: refused by name rather than silently left alone
    with pytest.raises(BadRequest, match=r"observation.images.top.*'q01'"):
        with_stats(module({"VISUAL": Mode.QUANTILES}), st)
    del st["observation.images.top"]
    w = with_stats(module({"VISUAL": Mode.QUANTILES}), st)
    assert w.normalized == {"observation.images.wrist": "QUANTILES"}
    x = torch.rand(1, 2, 1, *ll.WRIST_HW)
    y = w._normalize({"observation.images.wrist": x, "observation.state": torch.ones(1, 2, 4)})
    torch.testing.assert_close(y["observation.images.wrist"], 2 * (x - 0.05) / 0.9 - 1)
    torch.testing.assert_close(y["observation.state"], torch.ones(1, 2, 4))  # not mapped


def test_no_stats_changes_nothing_and_noise_and_capsules_still_work():
    obs = obs_stream(14, seed=3)
    bare = Engine(ChunkedPolicy(ll.LeRobotLike()), device="cpu", seed=5)
    wrapped_policy = with_stats(module(), {})
    assert isinstance(wrapped_policy, WithStatsNoise)  # LeRobotLike takes noise: so does this
    wrapped = Engine(ChunkedPolicy(wrapped_policy), device="cpu", seed=5)
    assert wrapped.policy.takes_noise
    a = np.stack([bare.step(o) for o in obs])
    b = np.stack([wrapped.step(o) for o in obs])
    np.testing.assert_array_equal(a, b)

    eng = Engine(ChunkedPolicy(with_stats(module(), stats())), device="cpu", seed=5)
    for o in obs[:3]:
        eng.step(o)
    cap = eng.checkpoint()
    first = np.stack([eng.step(o) for o in obs[3:]])  # across re-inference boundaries
    eng.restore(cap.id)
    np.testing.assert_array_equal(np.stack([eng.step(o) for o in obs[3:]]), first)
    assert not np.array_equal(first, a[3:])  # the statistics did change the actions

    plain = with_stats(ll.LeRobotLike(noise=False), {})
    assert not ChunkedPolicy(plain).takes_noise  # no noise parameter: none passed


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s["observation.state"].pop("std"), r"observation.state.*'std'"),
        (lambda s: s["action"]["mean"].__setitem__(0, np.nan), r"action.*NaN"),
        (lambda s: s["action"].__setitem__("std", np.ones(5)), r"shape \(5,\).*\(3,\)"),
        (lambda s: s["action"].__setitem__("mean", "abc"), r"not numeric"),
    ],
)
def test_bad_statistics_are_refused_by_name(edit, match):
    st = stats()
    edit(st)
    with pytest.raises(BadRequest, match=match):
        with_stats(module(), st)


def test_bad_policy_mode_or_eps_is_refused():
    with pytest.raises(BadRequest, match="not LeRobot-shaped"):
        with_stats(torch.nn.Linear(2, 2), {})
    with pytest.raises(BadRequest, match="'LOG' of STATE is not known"):
        with_stats(module({"STATE": "LOG"}), stats())
    with pytest.raises(BadRequest, match="eps"):
        with_stats(module(), stats(), eps=0.0)
    with pytest.raises(BadRequest, match="stats must be a dict"):
        with_stats(module(), [1, 2])


def test_a_datasets_stats_with_columns_the_policy_does_not_declare_are_taken():
    """dataset.meta.stats holds every column of the dataset (timestamp, frame_index, index,
    episode_index, task_index, cameras the policy does not use): only the declared features
    are normalized, the rest is ignored as LeRobot's normalizer ignores it."""
    st = stats()
    plain = with_stats(module(), st)
    extra = {k: {"mean": np.zeros(1), "std": np.ones(1)} for k in ("timestamp", "index")}
    extra["observation.images.side"] = {"mean": np.zeros((3, 1, 1)), "std": np.ones((3, 1, 1))}
    wider = with_stats(module(), {**st, **extra})
    assert [n for n, _ in wider.named_buffers()] == [n for n, _ in plain.named_buffers()]
    assert all(torch.equal(a, b) for a, b in zip(wider.buffers(), plain.buffers(), strict=True))
