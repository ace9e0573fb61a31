"""builtin:act — an ACT-style (Action Chunking Transformer) visuomotor policy, shaped like
LeRobot's ACTPolicy so the runtime adapter serves it like a LeRobot checkpoint.

A conv backbone (shared by the cameras, a learned embedding per camera) turns each image into a
grid of tokens with a 2-D sine position embedding; with a latent token (ACT's CVAE latent, zero at
inference as in ACT) and a state token they feed a transformer encoder; a decoder of
``chunk_size`` learned queries cross-attends to it and a linear head gives the action chunk.
Post-norm layers with DETR-style positions added to queries and keys, as in ACT.

Size "sim" adds a goal read-back (``goal_chain`` links, 0 disables it): a small CoordConv branch
with a spatial-softmax keypoint head finds the joints of the goal's ghost chain in the first
camera's image (expected x/y of one softmax map per joint), the goal's joint angles follow from
the directions of successive links (atan2, wrapped), and they enter the encoder as a goal token
(goal and goal - q). It is computed from the image inside ``predict_action_chunk``: the goal is
never an input. Training supervises the keypoints with the ghost's joint pixels.

``predict_action_chunk(batch)`` is pure: no queues, no randomness, static shapes, no host syncs.
Action chunking and temporal ensembling are the runtime's job; the config only says how
(``n_action_steps``, ``temporal_ensemble_coeff``).

Sizes: "sim" (small, trained by tools/train_act.py on the sim arm's camera, weights/act.pt) and
"lerobot" (LeRobot's default ACT: ResNet-18 trunk, dim 512, 8 heads, 4 encoder layers, 1 decoder
layer, feedforward 3200, chunk 100, two 480x640 cameras; random init, for benchmarks). The
training-only CVAE encoder of ACT is not part of the module (inference never runs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from flashrt_ros.policies.visuomotor_common import (
    IMAGE_PREFIX,
    STATE_KEY,
    WEIGHTS_DIR,
    SmallConvEncoder,
    VisuomotorConfig,
    check_cameras,
    check_dims,
    feature_hw,
    history,
    make_backbone,
    make_policy,
    register_normalization,
    sine_pos_1d,
    sine_pos_2d,
)

__all__ = ["ACTConfig", "ACTPolicy", "make_act", "ACT_WEIGHTS", "ACT_SIZES"]

ACT_WEIGHTS = WEIGHTS_DIR / "act.pt"


@dataclass
class ACTConfig(VisuomotorConfig):
    """What builds an ACTPolicy; the LeRobot-shaped fields the runtime reads are
    ``input_features``, ``output_features``, ``chunk_size``, ``n_action_steps``,
    ``n_obs_steps`` and ``temporal_ensemble_coeff``."""

    cameras: tuple[str, ...] = ("top",)
    image_hw: tuple[int, int] = (64, 64)
    state_dim: int = 12
    action_dim: int = 6
    chunk_size: int = 20
    n_action_steps: int = 1
    n_obs_steps: int = 1
    temporal_ensemble_coeff: float | None = 0.01
    backbone: str = "small"  # "small" (SmallConvEncoder) | "resnet18"
    backbone_channels: tuple[int, ...] = (32, 48, 64, 64)
    backbone_strides: tuple[int, ...] = (2, 2, 2, 1)  # 64x64 images -> 8x8 tokens
    dim_model: int = 96
    n_heads: int = 4
    dim_feedforward: int = 256
    n_encoder_layers: int = 2
    n_decoder_layers: int = 1
    dropout: float = 0.0
    latent_dim: int = 32
    # actions are predicted relative to the current joint positions (state[:, :action_dim])
    relative_actions: bool = True
    # goal read-back (0: none): a keypoint branch (CoordConv convs + spatial softmax) finds the
    # goal_chain + 1 joints of the goal's planar chain in the first camera's image; the angles
    # between successive links are the goal's joint angles, fed to the decoder as a goal token
    goal_chain: int = 6
    keypoint_channels: tuple[int, ...] = (24, 32, 32)
    keypoint_strides: tuple[int, ...] = (2, 1, 1)  # 64x64 images -> 32x32 keypoint maps


ACT_SIZES: dict[str, dict] = {
    "sim": {},
    "lerobot": dict(
        cameras=("top", "wrist"),
        image_hw=(480, 640),
        chunk_size=100,
        n_action_steps=100,
        temporal_ensemble_coeff=None,
        backbone="resnet18",
        dim_model=512,
        n_heads=8,
        dim_feedforward=3200,
        n_encoder_layers=4,
        n_decoder_layers=1,
        dropout=0.1,
        relative_actions=False,
        goal_chain=0,
    ),
}
# overrides that leave the trained weights valid (they change only how the runtime uses them)
RUNTIME_ONLY = ("n_action_steps", "temporal_ensemble_coeff", "dropout")


class _Attention(nn.Module):
    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.h = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, lq, d = q.shape
        dh = d // self.h

        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(b, -1, self.h, dh).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(q)), split(self.k(k)), split(self.v(v)))
        return self.o(y.transpose(1, 2).reshape(b, lq, d))


class _FFN(nn.Module):
    def __init__(self, d: int, d_ff: int, dropout: float):
        super().__init__()
        self.l1, self.l2, self.drop = nn.Linear(d, d_ff), nn.Linear(d_ff, d), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(F.relu(self.l1(x))))


class _EncoderLayer(nn.Module):
    def __init__(self, c: ACTConfig):
        super().__init__()
        d = c.dim_model
        self.attn, self.ffn = _Attention(d, c.n_heads), _FFN(d, c.dim_feedforward, c.dropout)
        self.n1, self.n2, self.drop = nn.LayerNorm(d), nn.LayerNorm(d), nn.Dropout(c.dropout)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        qk = x + pos
        x = self.n1(x + self.drop(self.attn(qk, qk, x)))
        return self.n2(x + self.drop(self.ffn(x)))


class _DecoderLayer(nn.Module):
    def __init__(self, c: ACTConfig):
        super().__init__()
        d = c.dim_model
        self.self_attn, self.cross_attn = _Attention(d, c.n_heads), _Attention(d, c.n_heads)
        self.ffn = _FFN(d, c.dim_feedforward, c.dropout)
        self.n1, self.n2, self.n3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, mem, mem_pos, query_pos) -> torch.Tensor:
        qk = x + query_pos
        x = self.n1(x + self.drop(self.self_attn(qk, qk, x)))
        x = self.n2(x + self.drop(self.cross_attn(x + query_pos, mem + mem_pos, mem)))
        return self.n3(x + self.drop(self.ffn(x)))


class ChainReadout(nn.Module):
    """Reads a planar chain of ``n`` links (the sim camera's goal ghost) from an image: CoordConv
    convs give ``n + 1`` keypoint maps, a spatial softmax their expected pixel positions (x right,
    y down; pixel centres at integers, as flashrt_ros.sim.camera draws them), and the link angles
    follow: link i points along (-sin, -cos) of theta_i = q_0 + ... + q_i, so q_i is the wrapped
    difference of successive link directions. Pure: convs, softmax, atan2, no branching."""

    # outside the state dict, computed from the config (policy_checks.py)
    derived_buffers = ("grid",)

    def __init__(self, n: int, image_hw, channels, strides):
        super().__init__()
        self.n = n
        self.net = SmallConvEncoder(tuple(channels), n + 1, tuple(strides))
        fh, fw = feature_hw(self.net, image_hw)
        h, w = image_hw
        ys = (torch.arange(fh, dtype=torch.float32) + 0.5) * h / fh - 0.5  # cell centres, pixels
        xs = (torch.arange(fw, dtype=torch.float32) + 0.5) * w / fw - 0.5
        gy, gx = torch.meshgrid(ys, xs, indexing="ij")
        self.register_buffer("grid", torch.stack([gx.ravel(), gy.ravel()], -1), persistent=False)

    def forward(self, img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(keypoints (B, n + 1, 2) in pixels, joint angles (B, n)) from images in [0, 1]."""
        att = torch.softmax(self.net(img).flatten(2), -1)  # (B, n + 1, HW)
        kp = att @ self.grid.to(att.dtype)
        d = kp[:, 1:] - kp[:, :-1]
        theta = torch.atan2(-d[..., 0], -d[..., 1])  # absolute link angles (B, n)
        prev = F.pad(theta[:, :-1], (1, 0))
        rel = theta - prev
        return kp, torch.atan2(rel.sin(), rel.cos())


class ACTPolicy(nn.Module):
    """See the module docstring. Normalization lives in buffers: ``state_mean/std``,
    ``image_mean/std`` (ImageNet's by default, as LeRobot's ACT), ``action_mean/std``
    (per chunk step; added to the current joint positions when ``relative_actions``)."""

    # outside the state dict, computed from the config (policy_checks.py)
    derived_buffers = ("image_pos",)

    name = "act"

    def __init__(self, config: ACTConfig | None = None):
        super().__init__()
        c = self.config = config or ACTConfig()
        c.cameras, c.image_hw = check_cameras(c.cameras, c.image_hw)
        check_dims(c)
        if not 0 <= c.goal_chain <= c.state_dim:
            raise ValueError(
                f"goal_chain={c.goal_chain} must be in 0..state_dim={c.state_dim} (it reads "
                "that many joint positions from the state)"
            )
        if c.n_heads < 1 or c.dim_model % c.n_heads or c.dim_model % 4:
            raise ValueError(
                f"dim_model={c.dim_model} must be a multiple of n_heads={c.n_heads} and of 4"
            )
        if c.n_obs_steps != 1:
            raise ValueError("ACT observes one step (n_obs_steps=1)")
        if not 1 <= c.n_action_steps <= c.chunk_size:
            raise ValueError(f"n_action_steps must be in 1..chunk_size, got {c.n_action_steps}")
        d = c.dim_model
        self.backbone = make_backbone(c.backbone, "batch", c.backbone_channels, c.backbone_strides)
        fh, fw = feature_hw(self.backbone, c.image_hw)
        self.input_proj = nn.Conv2d(self.backbone.out_channels, d, 1)
        self.camera_embed = nn.Parameter(torch.zeros(len(c.cameras), d))
        self.latent_proj = nn.Linear(c.latent_dim, d)
        self.state_proj = nn.Linear(c.state_dim, d)
        self.readout = None
        if c.goal_chain:
            self.readout = ChainReadout(
                c.goal_chain, c.image_hw, c.keypoint_channels, c.keypoint_strides
            )
            self.goal_proj = nn.Linear(2 * c.goal_chain, d)
        n_tok = 3 if c.goal_chain else 2
        self.token_pos = nn.Parameter(torch.zeros(n_tok, d))  # latent, state (, goal)
        self.encoder = nn.ModuleList(_EncoderLayer(c) for _ in range(c.n_encoder_layers))
        self.decoder = nn.ModuleList(_DecoderLayer(c) for _ in range(c.n_decoder_layers))
        self.decoder_norm = nn.LayerNorm(d)
        self.query_pos = nn.Parameter(sine_pos_1d(c.chunk_size, d) * 0.1)
        self.action_head = nn.Linear(d, c.action_dim)
        self.register_buffer("image_pos", sine_pos_2d(fh, fw, d), persistent=False)
        register_normalization(self, c.state_dim)
        self.register_buffer("action_mean", torch.zeros(c.chunk_size, c.action_dim))
        self.register_buffer("action_std", torch.ones(c.chunk_size, c.action_dim))

    def read_goal(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The goal chain read from the first camera: (keypoints (B, n + 1, 2) in pixels,
        joint angles (B, n)). Only when ``goal_chain`` > 0."""
        img = history(batch[IMAGE_PREFIX + self.config.cameras[0]], 3, 1)[:, -1]
        return self.readout(img)

    def encode(
        self, batch: dict[str, torch.Tensor], goal: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Transformer-encoder memory (B, 2 [+ 1] + cameras x tokens, dim_model) and its
        positions. ``goal`` (B, goal_chain) replaces the read-back (training only)."""
        c = self.config
        state = history(batch[STATE_KEY], 1, 1)[:, -1]
        b = state.shape[0]
        s = (state - self.state_mean) / self.state_std
        latent = self.latent_proj.bias.expand(b, 1, -1)  # the projection of a zero latent
        tokens = [latent, self.state_proj(s)[:, None]]
        if self.readout is not None:
            if goal is None:
                goal = self.read_goal(batch)[1]
            q = state[:, : c.goal_chain]
            tokens.append(self.goal_proj(torch.cat([goal, goal - q], -1))[:, None])
        pos = [self.token_pos]
        for i, cam in enumerate(c.cameras):
            img = history(batch[IMAGE_PREFIX + cam], 3, 1)[:, -1]
            f = self.input_proj(self.backbone((img - self.image_mean) / self.image_std))
            tokens.append(f.flatten(2).transpose(1, 2))
            pos.append(self.image_pos + self.camera_embed[i])
        x = torch.cat(tokens, 1)
        p = torch.cat(pos, 0)[None]
        for layer in self.encoder:
            x = layer(x, p)
        return x, p

    def predict_action_chunk(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, chunk_size, action_dim) joint targets from ``observation.state`` (B, 12) and each
        ``observation.images.<cam>`` (B, 3, H, W) in [0, 1] (a (B, 1, ...) history also works)."""
        x, p = self.encode(batch)
        return self.decode(x, p, history(batch[STATE_KEY], 1, 1)[:, -1])

    def decode(self, x: torch.Tensor, p: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The chunk from the encoder memory ``x`` (positions ``p``) and the state (B, 12)."""
        c = self.config
        q = self.query_pos[None]
        y = torch.zeros(x.shape[0], c.chunk_size, c.dim_model, dtype=x.dtype, device=x.device)
        for layer in self.decoder:
            y = layer(y, x, p, q)
        out = self.action_head(self.decoder_norm(y)) * self.action_std + self.action_mean
        if c.relative_actions:
            out = out + state[:, None, : c.action_dim]
        return out

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.predict_action_chunk(batch)


def make_act(
    size: str = "sim",
    cameras: tuple[str, ...] | None = None,
    image_hw: tuple[int, int] | None = None,
    weights: str | Path | None = None,
    **overrides,
) -> ACTPolicy:
    """builtin:act in eval mode. ``cameras`` / ``image_hw`` default to the size's (sim: ("top",),
    64x64; lerobot: ("top", "wrist"), 480x640); ``overrides`` set ACTConfig fields. Size "sim"
    loads weights/act.pt when the config matches the one it was trained with (runtime-only
    fields such as n_action_steps and temporal_ensemble_coeff may differ); ``weights`` loads a
    given file instead. Otherwise the init is seeded (torch seed 0) and a warning says so."""
    return make_policy(
        "act",
        ACTConfig,
        ACTPolicy,
        ACT_SIZES,
        size,
        overrides,
        weights=weights,
        trained=ACT_WEIGHTS,
        runtime_only=RUNTIME_ONLY,
        cameras=cameras,
        image_hw=image_hw,
    )
