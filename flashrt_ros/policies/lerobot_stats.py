"""A LeRobot policy with its dataset statistics: normalize in, unnormalize out, inside the step.

From LeRobot 0.4 on, a policy's `predict_action_chunk` takes normalized inputs and returns
normalized actions; the normalization lives in separate pre/post processor pipelines, which
are Python objects outside the module (LeRobot's `make_pre_post_processors`). Served alone,
such a policy would command the robot in normalized units. `with_stats(policy, stats)` puts
the same arithmetic around the module (LeRobot's formulas, modes and eps), so the whole thing
is one pure function of static buffers that the Engine captures into its graph, and the
result is LeRobot-shaped again:

    from lerobot.policies.act.modeling_act import ACTPolicy
    from flashrt_ros.policies.lerobot_stats import with_stats

    def make():  # load_policy("my_robot.policy:make")
        policy = ACTPolicy.from_pretrained("outputs/train/act/checkpoints/last/pretrained_model")
        return with_stats(policy, stats)  # the dataset's stats (dataset.meta.stats), or the
                                          # ones its saved normalizer processor holds

`stats` maps a feature name ("observation.state", "observation.images.top", "action") to a
dict of tensors or arrays: "mean"/"std" (MEAN_STD), "min"/"max" (MIN_MAX), "q01"/"q99"
(QUANTILES), "q10"/"q90" (QUANTILE10). Which mode each feature gets comes from the policy's
`config.normalization_mapping` (feature type -> mode), as in LeRobot; a type it does not map,
or a feature without stats, passes through unchanged, also as in LeRobot. Entries for names
the config does not declare (a dataset's `timestamp`, `frame_index`, `index`, a camera the
policy does not use) are ignored, as LeRobot's normalizer ignores them, and logged once. This
module imports no LeRobot code.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from flashrt_ros.errors import BadRequest
from flashrt_ros.policies.chunked import feature_field, feature_type, lerobot_config, type_name

EPS = 1e-8  # LeRobot's NormalizerProcessorStep default
# mode -> (the two stats it reads: offset, scale-ish), as LeRobot's _apply_transform
MODES: dict[str, tuple[str, str]] = {
    "MEAN_STD": ("mean", "std"),
    "MIN_MAX": ("min", "max"),
    "QUANTILES": ("q01", "q99"),
    "QUANTILE10": ("q10", "q90"),
}

log = logging.getLogger(__name__)


def _features(cfg) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (type name, shape) of the config's inputs and outputs."""
    out = {}
    for group in ("input_features", "output_features"):
        for name, f in dict(getattr(cfg, group, None) or {}).items():
            out[name] = (feature_type(f), tuple(feature_field(f, "shape") or ()))
    return out


def _stat(stats: Mapping, name: str, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """One statistic as float32, checked: present, finite, and broadcastable to the feature."""
    per = stats.get(name)
    if not isinstance(per, Mapping) or key not in per:
        raise BadRequest(f"stats[{name!r}] needs {key!r} for its normalization mode")
    try:
        t = torch.as_tensor(np.asarray(per[key], dtype=np.float32))
    except (TypeError, ValueError) as e:
        raise BadRequest(f"stats[{name!r}][{key!r}] is not numeric: {e}") from e
    if not torch.isfinite(t).all():
        raise BadRequest(f"stats[{name!r}][{key!r}] holds NaN or Inf")
    if shape:
        try:
            ok = torch.broadcast_shapes(t.shape, shape) == torch.Size(shape)
        except RuntimeError:
            ok = False
        if not ok:
            raise BadRequest(
                f"stats[{name!r}][{key!r}] has shape {tuple(t.shape)}, which does not "
                f"broadcast to the feature's {shape}"
            )
    return t


class WithStats(nn.Module):
    """`policy` with normalization around predict_action_chunk (module docstring)."""

    def __init__(self, policy: nn.Module, stats: Mapping, eps: float = EPS):
        super().__init__()
        cfg = lerobot_config(policy)
        if not isinstance(stats, Mapping):
            raise BadRequest(f"stats must be a dict of feature -> dict, got {type(stats)}")
        if not (isinstance(eps, int | float) and math.isfinite(eps) and eps > 0):
            raise BadRequest(f"eps must be a positive number, got {eps!r}")
        self.policy = policy
        self.config = cfg
        self.eps = float(eps)
        mapping = {
            type_name(k): type_name(v)
            for k, v in dict(getattr(cfg, "normalization_mapping", {})).items()
        }
        feats = _features(cfg)
        unknown = sorted(map(str, set(stats) - set(feats)))
        if unknown:  # a dataset's stats cover all its columns: only the declared ones are used
            log.info("with_stats: ignoring stats of %s, which the config does not declare", unknown)
        self._plan: dict[str, tuple[str, str, str]] = {}  # name -> (mode, buffer a, buffer b)
        for i, (name, (ftype, shape)) in enumerate(feats.items()):
            mode = mapping.get(ftype, "IDENTITY")
            if mode == "IDENTITY" or name not in stats:
                continue
            if mode not in MODES:
                raise BadRequest(f"normalization mode {mode!r} of {ftype} is not known")
            a, b = MODES[mode]
            self.register_buffer(f"stat{i}_{a}", _stat(stats, name, a, shape))
            self.register_buffer(f"stat{i}_{b}", _stat(stats, name, b, shape))
            self._plan[name] = (mode, f"stat{i}_{a}", f"stat{i}_{b}")
        self._actions = [n for n, (t, _) in feats.items() if t == "ACTION"]
        # what the runtime adapter reads off the module (chunked.py), passed through
        for attr in ("fuse_default", "noise_shape"):
            if hasattr(policy, attr):
                setattr(self, attr, getattr(policy, attr))
        parts = getattr(policy, "fuse_parts", ())
        self.fuse_parts = tuple(
            f"policy.{p}" for p in ((parts,) if isinstance(parts, str) else parts)
        )

    @property
    def normalized(self) -> dict[str, str]:
        """feature -> the mode applied to it (what the log and a user may want to see)."""
        return {n: m for n, (m, _, _) in self._plan.items()}

    def _norm(self, name: str, x: torch.Tensor, inverse: bool) -> torch.Tensor:
        plan = self._plan.get(name)
        if plan is None:
            return x
        mode, a, b = plan
        lo, hi = getattr(self, a), getattr(self, b)
        if mode == "MEAN_STD":  # LeRobot: (x - mean) / (std + eps); back: x * std + mean
            return x * hi + lo if inverse else (x - lo) / (hi + self.eps)
        span = hi - lo
        span = torch.where(span == 0, torch.full_like(span, self.eps), span)
        return (x + 1) / 2 * span + lo if inverse else 2 * (x - lo) / span - 1

    def _normalize(self, batch: Mapping) -> dict:
        return {k: self._norm(k, v, inverse=False) for k, v in batch.items()}

    def _unnormalize(self, actions: torch.Tensor) -> torch.Tensor:
        for name in self._actions:
            actions = self._norm(name, actions, inverse=True)
        return actions

    def predict_action_chunk(self, batch: dict) -> torch.Tensor:
        return self._unnormalize(self.policy.predict_action_chunk(self._normalize(batch)))


class WithStatsNoise(WithStats):
    """The same for a policy whose predict_action_chunk takes `noise` (drawn by the runtime)."""

    def predict_action_chunk(self, batch: dict, noise: torch.Tensor | None = None) -> torch.Tensor:
        out = self.policy.predict_action_chunk(self._normalize(batch), noise=noise)
        return self._unnormalize(out)


def with_stats(policy: nn.Module, stats: Mapping, eps: float = EPS) -> WithStats:
    """`policy` normalized with `stats` as LeRobot's processors would (module docstring); the
    result takes `noise` exactly when the policy's predict_action_chunk does."""
    pac = getattr(policy, "predict_action_chunk", None)
    takes_noise = callable(pac) and "noise" in inspect.signature(pac).parameters
    return (WithStatsNoise if takes_noise else WithStats)(policy, stats, eps)
