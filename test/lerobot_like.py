"""Small torch modules shaped like LeRobot policies (config.input_features of typed features,
predict_action_chunk), for the chunked-adapter tests: real modules, CPU-fast.

- `LeRobotLike`: a camera, a mono wrist camera and the joint state over n_obs_steps, noise in,
  a chunk out; it counts its calls and keeps its outputs so tests can check cadence and
  compare with reference code. Its outputs depend on every input, every history step and the
  noise, so any piece of state restored wrong shows up in the actions.
- `ImageStats`: returns statistics of the images it is given (channel means, single pixels), so
  the layout, scale and channel order the runtime hands it can be checked.
- `Impure`: draws its own noise with torch.randn, which no capsule can hold: refused at load.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import nn


class FeatureType(enum.Enum):  # an enum whose *name* is the type, as LeRobot's
    STATE = 1
    VISUAL = 2
    ACTION = 3


@dataclass(frozen=True)
class PolicyFeature:
    type: FeatureType
    shape: tuple[int, ...]


@dataclass
class Config:
    input_features: dict = field(default_factory=dict)
    output_features: dict = field(default_factory=dict)
    chunk_size: int = 6
    n_action_steps: int = 4
    n_obs_steps: int = 2
    temporal_ensemble_coeff: float | None = None


STATE_DIM, ACTION_DIM = 4, 3
TOP_HW, WRIST_HW = (8, 10), (6, 6)


def features(top_c: int = 3, wrist: bool = True) -> dict:
    f = {
        "observation.state": PolicyFeature(FeatureType.STATE, (STATE_DIM,)),
        "observation.images.top": PolicyFeature(FeatureType.VISUAL, (top_c, *TOP_HW)),
    }
    if wrist:
        f["observation.images.wrist"] = PolicyFeature(FeatureType.VISUAL, (1, *WRIST_HW))
    return f


class LeRobotLike(nn.Module):
    """predict_action_chunk(batch, noise) -> (1, chunk_size, 3): a linear map of the state
    history and per-step image statistics, plus 0.1 * noise."""

    def __init__(
        self,
        n_obs_steps: int = 2,
        n_action_steps: int = 4,
        chunk_size: int = 6,
        coeff: float | None = None,
        noise: bool = True,
    ):
        super().__init__()
        self.config = Config(
            input_features=features(),
            output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))},
            chunk_size=chunk_size,
            n_action_steps=n_action_steps,
            n_obs_steps=n_obs_steps,
            temporal_ensemble_coeff=coeff,
        )
        n_feat = n_obs_steps * (STATE_DIM + 3 + 1 + 2)
        g = torch.Generator().manual_seed(3)
        self.w = nn.Parameter(torch.randn(n_feat, chunk_size * ACTION_DIM, generator=g) * 0.3)
        self.uses_noise = noise
        self.calls = 0  # host-side count of real calls (CPU eager: one per inference)
        self.outputs: list[torch.Tensor] = []
        self.batches: list[dict] = []  # what each real call was given
        if not noise:  # no `noise` parameter at all: the runtime must not pass one
            self.predict_action_chunk = self._predict_plain

    def _features(self, batch: dict) -> torch.Tensor:
        T = self.config.n_obs_steps
        state = batch["observation.state"]
        top = batch["observation.images.top"]
        wrist = batch["observation.images.wrist"]
        if T == 1 and state.dim() == 2:  # no history axis
            state, top, wrist = state[:, None], top[:, None], wrist[:, None]
        b = state.shape[0]
        parts = [
            state,
            top.mean((-1, -2)),  # (B, T, 3) channel means
            wrist.mean((-1, -2, -3))[..., None],  # (B, T, 1)
            top[:, :, 0, 0, :2],  # (B, T, 2) two pixels of the first channel
        ]
        return torch.cat(parts, -1).reshape(b, -1)

    def predict_action_chunk(self, batch: dict, noise: torch.Tensor | None = None):
        out = self._predict_plain(batch)
        if noise is not None:
            out = out + 0.1 * noise
        self.outputs.append(out.detach().clone())
        return out

    def _predict_plain(self, batch: dict) -> torch.Tensor:
        self.calls += 1
        self.batches.append({k: v.detach().clone() for k, v in batch.items()})
        c = self.config
        y = torch.tanh(self._features(batch) @ self.w).view(-1, c.chunk_size, ACTION_DIM)
        if not self.uses_noise:
            self.outputs.append(y.detach().clone())
        return y


class ImageStats(nn.Module):
    """One observation step, chunk 1: the action is (top channel means (3), top[0, 0, 1] and
    top[2, 1, 0] as (c, h, w) pixels, wrist channel means (3), top min, top max)."""

    def __init__(self, wrist_c: int = 3):
        super().__init__()
        f = features()
        f["observation.images.wrist"] = PolicyFeature(FeatureType.VISUAL, (wrist_c, *WRIST_HW))
        self.config = Config(
            input_features=f,
            output_features={"action": PolicyFeature(FeatureType.ACTION, (10,))},
            chunk_size=1,
            n_action_steps=1,
            n_obs_steps=1,
        )
        self.wrist_c = wrist_c

    def predict_action_chunk(self, batch: dict) -> torch.Tensor:
        top = batch["observation.images.top"]  # (B, 3, H, W)
        wrist = batch["observation.images.wrist"]
        wm = wrist.mean((-1, -2))
        if self.wrist_c == 1:
            wm = wm.expand(-1, 3)
        a = torch.cat(
            [
                top.mean((-1, -2)),
                top[:, 0, 0, 1, None],
                top[:, 2, 1, 0, None],
                wm,
                top.amin((1, 2, 3))[:, None],
                top.amax((1, 2, 3))[:, None],
            ],
            -1,
        )
        return a[:, None]


def expected_stats(img, wrist, top_enc: str, wrist_enc: str):
    """What ImageStats must return for these wire images (numpy, float32): the reference the
    runtime's upload and conversion (layout, scale, channel order) are checked against."""
    import numpy as np

    rgb = (img[..., ::-1] if top_enc == "bgr8" else img).astype(np.float32) / 255
    wrgb = wrist[..., None].repeat(3, -1) if wrist_enc == "mono8" else wrist
    return np.concatenate(
        [
            rgb.mean((0, 1)),
            [rgb[0, 1, 0], rgb[1, 0, 2]],  # (c, h, w) = (0, 0, 1) and (2, 1, 0)
            (wrgb.astype(np.float32) / 255).mean((0, 1)),
            [rgb.min(), rgb.max()],
        ]
    )


class Impure(LeRobotLike):
    """Draws its own noise: two calls on the same inputs differ."""

    def predict_action_chunk(self, batch: dict, noise: torch.Tensor | None = None):
        return self._predict_plain(batch) + 0.1 * torch.randn(1, self.config.chunk_size, 3)


def make(**kw) -> LeRobotLike:
    return LeRobotLike(**kw)


def make_impure() -> Impure:
    return Impure()


def make_stats(wrist_c: int = 3) -> ImageStats:
    return ImageStats(wrist_c)


class JointsOnly(nn.Module):
    """A LeRobot-shaped policy on joint positions alone (observation.state of 6, no camera, as
    most LeRobot arm policies are): a chunk of 4 from tanh(state @ w), 2 rows executed per
    inference, no noise. The node serves it with `state_fields: [position]`."""

    def __init__(self, actions: int = 6):
        super().__init__()
        self.config = Config(
            input_features={"observation.state": PolicyFeature(FeatureType.STATE, (6,))},
            output_features={"action": PolicyFeature(FeatureType.ACTION, (actions,))},
            chunk_size=4,
            n_action_steps=2,
            n_obs_steps=1,
        )
        g = torch.Generator().manual_seed(5)
        self.w = nn.Parameter(torch.randn(6, 4 * actions, generator=g) * 0.5)
        self.actions = actions

    def predict_action_chunk(self, batch: dict) -> torch.Tensor:
        return torch.tanh(batch["observation.state"] @ self.w).view(-1, 4, self.actions)


def make_joints() -> JointsOnly:
    return JointsOnly()


def make_joints_seven_actions() -> JointsOnly:
    """6 joint positions in, 7 actions out (a gripper command besides 6 joints)."""
    return JointsOnly(actions=7)


def act_positions():
    """builtin:act's module (seeded init) on joint positions alone: observation.state of 6 and a
    64x64 top camera, no goal input (the demo serves it with state_fields [position])."""
    from flashrt_ros.policies.act import make_act

    return make_act(state_dim=6)
