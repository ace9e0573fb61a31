"""builtin:diffusion — a Diffusion-Policy-style visuomotor policy, shaped like LeRobot's
DiffusionPolicy so the runtime adapter serves it like a LeRobot checkpoint.

Per observation step a conv encoder (shared by the cameras) reads each image into keypoints
(spatial softmax, as Diffusion Policy) and a linear layer; with the normalized state, over
``n_obs_steps`` steps of history, that is the global condition. A 1-D conv UNet over the action
horizon (Diffusion Policy's ConditionalUnet1D: residual blocks with FiLM scale and bias from the
condition and the diffusion-step embedding) predicts the noise, and ``num_inference_steps``
deterministic DDIM steps (eta 0, cosine schedule of 100 training steps, x0 clipped to [-1, 1])
turn the ``noise`` argument into the chunk, all inside ``predict_action_chunk``: a fixed Python
loop over static per-step coefficients, so the whole denoising is one capturable function.

Unlike LeRobot (which slices the horizon inside), ``predict_action_chunk`` returns the whole
horizon (``chunk_size`` = ``horizon``) starting at the current step, so the noise and the output
have one shape; the runtime executes the first ``n_action_steps``.

Sizes: "sim" (small; seeded init unless weights/diffusion.pt exists) and "lerobot" (Diffusion
Policy's default: ResNet-18 trunk with GroupNorm, 84x84 centre crop, 32 keypoints, UNet down dims
512/1024/2048, kernel 5, horizon 16, n_action_steps 8, n_obs_steps 2; random init, for
benchmarks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from flashrt_ros.cuda import skinny
from flashrt_ros.policies.visuomotor_common import (
    IMAGE_PREFIX,
    STATE_KEY,
    WEIGHTS_DIR,
    SpatialSoftmax,
    VisuomotorConfig,
    check_cameras,
    check_dims,
    feature_hw,
    history,
    make_backbone,
    make_policy,
    register_normalization,
)

__all__ = ["DiffusionConfig", "DiffusionPolicy", "make_diffusion", "DIFFUSION_SIZES"]

DIFFUSION_WEIGHTS = WEIGHTS_DIR / "diffusion.pt"


@dataclass
class DiffusionConfig(VisuomotorConfig):
    """What builds a DiffusionPolicy; ``chunk_size`` (= ``horizon``), ``n_action_steps``,
    ``n_obs_steps``, ``temporal_ensemble_coeff`` (None) and the features are what the runtime
    reads."""

    cameras: tuple[str, ...] = ("top",)
    image_hw: tuple[int, int] = (64, 64)
    crop_hw: tuple[int, int] | None = None  # centre crop at inference (Diffusion Policy: 84x84)
    state_dim: int = 12
    action_dim: int = 6
    horizon: int = 16
    n_action_steps: int = 8
    n_obs_steps: int = 2
    num_inference_steps: int = 10
    num_train_timesteps: int = 100
    backbone: str = "small"  # "small" | "resnet18"
    backbone_channels: tuple[int, ...] = (32, 48, 64, 64)
    num_keypoints: int = 32
    down_dims: tuple[int, ...] = (32, 64, 128)
    kernel_size: int = 5
    n_groups: int = 8
    diffusion_step_embed_dim: int = 64
    clip_sample_range: float = 1.0
    relative_actions: bool = True

    temporal_ensemble_coeff = None  # Diffusion Policy executes chunks, no ensembling

    @property
    def chunk_size(self) -> int:
        return self.horizon


DIFFUSION_SIZES: dict[str, dict] = {
    "sim": {},
    "lerobot": dict(
        cameras=("top", "wrist"),
        image_hw=(480, 640),
        crop_hw=(84, 84),
        backbone="resnet18",
        down_dims=(512, 1024, 2048),
        diffusion_step_embed_dim=128,
        relative_actions=False,
    ),
}
RUNTIME_ONLY = ("n_action_steps", "num_inference_steps")


def cosine_alphas_cumprod(steps: int) -> torch.Tensor:
    """The "squaredcos_cap_v2" schedule (betas capped at 0.999), as float64."""

    def bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = [min(1 - bar((i + 1) / steps) / bar(i / steps), 0.999) for i in range(steps)]
    return torch.cumprod(1.0 - torch.tensor(betas, dtype=torch.float64), 0)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Diffusion Policy's SinusoidalPosEmb: (B,) -> (B, dim)."""
    half = dim // 2
    f = torch.exp(
        torch.arange(half, device=t.device, dtype=torch.float32) * -(math.log(10000) / (half - 1))
    )
    a = t.float()[:, None] * f[None]
    return torch.cat([a.sin(), a.cos()], -1)


class _Conv1d(nn.Conv1d):
    """nn.Conv1d (same parameters and state_dict) computed as one matrix product over the
    unfolded input. The denoiser convolves a horizon of 4 to 16 steps with up to 2048 channels:
    cuDNN's kernels for that shape leave the GPU idle (about 3.6 ms per UNet call at the
    lerobot size on the H200), while as a product it is a weight-bandwidth-bound GEMM with N =
    the horizon."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, s, p = self.kernel_size[0], self.stride[0], self.padding[0]
        b, c, _ = x.shape
        if k == 1 and s == 1 and p == 0:
            cols = x.transpose(1, 2)  # (B, L, C)
        else:
            cols = nn.functional.pad(x, (p, p)).unfold(2, k, s)  # (B, C, L_out, k)
            cols = cols.permute(0, 2, 1, 3).reshape(b, -1, c * k)
        w = self.weight.reshape(self.out_channels, c * k)
        return skinny.linear(cols.contiguous(), w, self.bias).transpose(1, 2)


class _ConvTranspose1d(nn.ConvTranspose1d):
    """nn.ConvTranspose1d (same parameters and state_dict; no output padding, dilation or
    groups) as one matrix product and an overlap-add (F.fold): cuDNN's kernel for the UNet's
    upsampling took ~47 us a call at the lerobot size on the H200, for 4 to 16 MB of weights."""

    def forward(self, x: torch.Tensor, output_size=None) -> torch.Tensor:
        plain = (0,) == self.output_padding and (1,) == self.dilation and self.groups == 1
        if output_size is not None or not plain:  # what the product does not cover
            return super().forward(x, output_size)
        k, s, p = self.kernel_size[0], self.stride[0], self.padding[0]
        b, c, n = x.shape
        w = self.weight.reshape(c, self.out_channels * k).t().contiguous()  # (C_out * k, C_in)
        cols = skinny.linear(x.transpose(1, 2).contiguous(), w)  # (B, L, C_out * k)
        length = (n - 1) * s - 2 * p + k
        y = F.fold(cols.transpose(1, 2), (1, length), (1, k), padding=(0, p), stride=(1, s))
        y = y[:, :, 0]
        return y if self.bias is None else y + self.bias[:, None]


class _ConvBlock(nn.Sequential):
    def __init__(self, c_in: int, c_out: int, k: int, groups: int):
        super().__init__(
            _Conv1d(c_in, c_out, k, padding=k // 2), nn.GroupNorm(groups, c_out), nn.Mish()
        )


class _ResBlock(nn.Module):
    """Two conv blocks with FiLM (scale and bias from the condition) between them."""

    def __init__(self, c_in: int, c_out: int, cond_dim: int, k: int, groups: int):
        super().__init__()
        self.conv1 = _ConvBlock(c_in, c_out, k, groups)
        self.cond_encoder = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, 2 * c_out))
        self.conv2 = _ConvBlock(c_out, c_out, k, groups)
        self.residual = _Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        y = self.conv1(x)
        scale, bias = self.cond_encoder(cond)[..., None].chunk(2, 1)
        return self.conv2(scale * y + bias) + self.residual(x)


class ConditionalUnet1D(nn.Module):
    """Diffusion Policy's denoiser over (B, horizon, action_dim)."""

    def __init__(self, c: DiffusionConfig, global_cond_dim: int):
        super().__init__()
        e = c.diffusion_step_embed_dim
        self.embed_dim = e
        self.step_encoder = nn.Sequential(nn.Linear(e, 4 * e), nn.Mish(), nn.Linear(4 * e, e))
        cond = e + global_cond_dim
        dims = (c.action_dim, *c.down_dims)
        pairs = list(zip(dims[:-1], dims[1:], strict=True))
        k, g = c.kernel_size, c.n_groups
        self.down = nn.ModuleList()
        for i, (a, b) in enumerate(pairs):
            last = i == len(pairs) - 1
            self.down.append(
                nn.ModuleList(
                    [
                        _ResBlock(a, b, cond, k, g),
                        _ResBlock(b, b, cond, k, g),
                        nn.Identity() if last else _Conv1d(b, b, 3, 2, 1),
                    ]
                )
            )
        top = c.down_dims[-1]
        self.mid = nn.ModuleList([_ResBlock(top, top, cond, k, g), _ResBlock(top, top, cond, k, g)])
        self.up = nn.ModuleList()
        for b, a in reversed(pairs[1:]):
            self.up.append(
                nn.ModuleList(
                    [
                        _ResBlock(a * 2, b, cond, k, g),
                        _ResBlock(b, b, cond, k, g),
                        _ConvTranspose1d(b, b, 4, 2, 1),
                    ]
                )
            )
        d0 = c.down_dims[0]
        self.final = nn.Sequential(_ConvBlock(d0, d0, k, g), _Conv1d(d0, c.action_dim, 1))

    def forward(self, x: torch.Tensor, t: torch.Tensor, global_cond: torch.Tensor) -> torch.Tensor:
        cond = torch.cat(
            [self.step_encoder(timestep_embedding(t, self.embed_dim)), global_cond], -1
        )
        x = x.transpose(1, 2)
        skips = []
        for r1, r2, down in self.down:
            x = r2(r1(x, cond), cond)
            skips.append(x)
            x = down(x)
        for r in self.mid:
            x = r(x, cond)
        for r1, r2, up in self.up:
            x = torch.cat([x, skips.pop()], 1)
            x = up(r2(r1(x, cond), cond))
        return self.final(x).transpose(1, 2)


class DiffusionPolicy(nn.Module):
    """See the module docstring. Normalization buffers: ``state_mean/std``, ``image_mean/std``,
    and ``action_mean/scale`` mapping the [-1, 1] diffusion space to actions (added to the
    current joint positions when ``relative_actions``)."""

    # outside the state dict, computed from the config (policy_checks.py)
    derived_buffers = ("alphas_cumprod", "ddim_t", "ddim_coef")

    name = "diffusion"
    # What the Engine compiles when it fuses: the UNet alone, compiled once and called K times
    # a tick, not the whole step (its unrolled denoising loop takes inductor minutes at the
    # lerobot size). There, on the H200, the captured tick went from 12.0 ms (eager kernels)
    # to 8.0 ms with the UNet compiled (19 s to compile, cold).
    fuse_parts = ("unet",)

    def __init__(self, config: DiffusionConfig | None = None):
        super().__init__()
        c = self.config = config or DiffusionConfig()
        c.cameras, c.image_hw = check_cameras(c.cameras, c.image_hw)
        check_dims(c)
        if not c.down_dims:
            raise ValueError("down_dims must name at least one UNet level, got ()")
        if c.horizon % 2 ** (len(c.down_dims) - 1):
            raise ValueError(f"horizon {c.horizon} must divide by 2^(levels - 1)")
        if not 1 <= c.n_action_steps <= c.horizon:
            raise ValueError(f"n_action_steps must be in 1..horizon, got {c.n_action_steps}")
        if not 1 <= c.num_inference_steps <= c.num_train_timesteps:
            raise ValueError(
                f"num_inference_steps must be in 1..{c.num_train_timesteps}, got "
                f"{c.num_inference_steps}"
            )
        if c.n_obs_steps < 1:
            raise ValueError(f"n_obs_steps must be >= 1, got {c.n_obs_steps}")
        in_hw = tuple(c.crop_hw) if c.crop_hw else c.image_hw
        if c.crop_hw and (in_hw[0] > c.image_hw[0] or in_hw[1] > c.image_hw[1]):
            raise ValueError(f"crop_hw {in_hw} larger than image_hw {c.image_hw}")
        self.backbone = make_backbone(c.backbone, "group", c.backbone_channels)
        fhw = feature_hw(self.backbone, in_hw)
        self.keypoints = SpatialSoftmax(self.backbone.out_channels, fhw, c.num_keypoints)
        feat = 2 * c.num_keypoints
        self.image_out = nn.Linear(feat, feat)
        cond_dim = c.n_obs_steps * (c.state_dim + feat * len(c.cameras))
        self.unet = ConditionalUnet1D(c, cond_dim)
        register_normalization(self, c.state_dim)
        self.register_buffer("action_mean", torch.zeros(c.horizon, c.action_dim))
        self.register_buffer("action_scale", torch.ones(c.horizon, c.action_dim))
        self._set_schedule()

    def _set_schedule(self) -> None:
        """Static DDIM coefficients for the ``num_inference_steps`` steps (non-persistent)."""
        c = self.config
        ac = cosine_alphas_cumprod(c.num_train_timesteps)
        self.register_buffer("alphas_cumprod", ac.float(), persistent=False)
        ratio = c.num_train_timesteps // c.num_inference_steps
        ts = [i * ratio for i in reversed(range(c.num_inference_steps))]
        a_t = torch.stack([ac[t] for t in ts])
        a_prev = torch.stack(
            [
                ac[t - ratio] if t - ratio >= 0 else torch.tensor(1.0, dtype=torch.float64)
                for t in ts
            ]
        )
        coef = torch.stack([a_t.sqrt(), (1 - a_t).sqrt(), a_prev.sqrt(), (1 - a_prev).sqrt()], 1)
        self.register_buffer("ddim_t", torch.tensor(ts, dtype=torch.float32), persistent=False)
        self.register_buffer("ddim_coef", coef.float(), persistent=False)

    def global_condition(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, n_obs_steps * (state_dim + 2 * num_keypoints * cameras)) from the history."""
        c = self.config
        state = history(batch[STATE_KEY], 1, c.n_obs_steps)
        b, t = state.shape[:2]
        parts = [(state - self.state_mean) / self.state_std]
        for cam in c.cameras:
            img = history(batch[IMAGE_PREFIX + cam], 3, c.n_obs_steps).flatten(0, 1)
            if c.crop_hw:
                h, w = img.shape[-2:]
                ch, cw = c.crop_hw
                top, left = (h - ch) // 2, (w - cw) // 2
                img = img[..., top : top + ch, left : left + cw]
            kp = self.keypoints(self.backbone((img - self.image_mean) / self.image_std))
            parts.append(F.relu(self.image_out(kp.flatten(1))).view(b, t, -1))
        return torch.cat(parts, -1).flatten(1)

    def denoise(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Run the DDIM steps from ``x`` (B, horizon, action_dim); returns the clean sample."""
        r = self.config.clip_sample_range
        b = x.shape[0]
        for i in range(self.config.num_inference_steps):
            sa, s1a, sp, s1p = self.ddim_coef[i]
            eps = self.unet(x, self.ddim_t[i].expand(b), cond)
            x0 = ((x - s1a * eps) / sa).clamp(-r, r)
            x = sp * x0 + s1p * eps
        return x

    def predict_action_chunk(
        self, batch: dict[str, torch.Tensor], noise: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, horizon, action_dim) joint targets from a history of ``n_obs_steps`` states
        (B, T, 12) and images (B, T, 3, H, W) in [0, 1], denoised from ``noise`` (B, horizon,
        action_dim) standard normal. Without noise it starts from zeros (deterministic, for
        tests and tracing; the runtime always passes noise)."""
        c = self.config
        cond = self.global_condition(batch)
        if noise is None:
            noise = torch.zeros(
                cond.shape[0], c.horizon, c.action_dim, device=cond.device, dtype=cond.dtype
            )
        out = self.denoise(noise, cond) * self.action_scale + self.action_mean
        if c.relative_actions:
            state = history(batch[STATE_KEY], 1, c.n_obs_steps)[:, -1]
            out = out + state[:, None, : c.action_dim]
        return out

    def forward(
        self, batch: dict[str, torch.Tensor], noise: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.predict_action_chunk(batch, noise)


def make_diffusion(
    size: str = "sim",
    cameras: tuple[str, ...] | None = None,
    image_hw: tuple[int, int] | None = None,
    num_inference_steps: int = 10,
    weights: str | Path | None = None,
    **overrides,
) -> DiffusionPolicy:
    """builtin:diffusion in eval mode. ``cameras`` / ``image_hw`` default to the size's (sim:
    ("top",), 64x64; lerobot: ("top", "wrist"), 480x640); ``num_inference_steps`` is K (10 or
    100 ...; the training schedule has 100 steps); ``overrides`` set DiffusionConfig fields.
    Size "sim" loads weights/diffusion.pt when it exists and fits the config, ``weights`` a given
    file; otherwise the init is seeded (torch seed 0) and a warning says so."""
    return make_policy(
        "diffusion",
        DiffusionConfig,
        DiffusionPolicy,
        DIFFUSION_SIZES,
        size,
        overrides,
        weights=weights,
        trained=DIFFUSION_WEIGHTS,
        runtime_only=RUNTIME_ONLY,
        cameras=cameras,
        image_hw=image_hw,
        num_inference_steps=int(num_inference_steps),
    )
