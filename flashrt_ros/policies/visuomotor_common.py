"""Pieces shared by builtin:act and builtin:diffusion: LeRobot-shaped feature descriptions and
the config mixin, conv image encoders written in plain torch (no torchvision), positional
embeddings, the normalization buffers, the factory, and the weights file helpers (loader.py
loads builtin:hybrid's with them too). The modules here are pure and capturable (static shapes,
no host syncs)."""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from flashrt_ros.errors import BadRequest
from flashrt_ros.obs.keys import IMAGE_PREFIX, STATE_KEY

log = logging.getLogger(__name__)

WEIGHTS_DIR = Path(__file__).parent / "weights"
ACTION_KEY = "action"


class FeatureType(enum.StrEnum):
    """Kinds of features, named as LeRobot names them (the value equals the name)."""

    STATE = "STATE"
    VISUAL = "VISUAL"
    ACTION = "ACTION"


@dataclass(frozen=True)
class PolicyFeature:
    """One input or output of a policy: its kind and its shape without batch or time."""

    type: FeatureType
    shape: tuple[int, ...]


def make_features(
    state_dim: int, cameras: tuple[str, ...], image_hw: tuple[int, int], action_dim: int
) -> tuple[dict[str, PolicyFeature], dict[str, PolicyFeature]]:
    """(input_features, output_features) as a LeRobot config holds them."""
    inputs = {STATE_KEY: PolicyFeature(FeatureType.STATE, (state_dim,))}
    for cam in cameras:
        inputs[IMAGE_PREFIX + cam] = PolicyFeature(FeatureType.VISUAL, (3, *image_hw))
    return inputs, {ACTION_KEY: PolicyFeature(FeatureType.ACTION, (action_dim,))}


class VisuomotorConfig:
    """What ACTConfig and DiffusionConfig (dataclasses) share: the LeRobot-shaped features
    from ``state_dim``, ``cameras``, ``image_hw`` and ``action_dim``, and ``to_dict`` (the
    JSON-ready form a weights file stores, tuples as lists)."""

    @property
    def input_features(self) -> dict[str, PolicyFeature]:
        return make_features(self.state_dim, self.cameras, self.image_hw, self.action_dim)[0]

    @property
    def output_features(self) -> dict[str, PolicyFeature]:
        return make_features(self.state_dim, self.cameras, self.image_hw, self.action_dim)[1]

    def to_dict(self) -> dict:
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }


def check_dims(c) -> None:
    """The state and action sizes of a builtin's config (ValueError naming the field): actions
    relative to the joint positions read the first `action_dim` state values, so a config
    that asks for more would only fail at the first step."""
    for name in ("state_dim", "action_dim"):
        v = getattr(c, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if c.relative_actions and c.action_dim > c.state_dim:
        raise ValueError(
            f"action_dim={c.action_dim} > state_dim={c.state_dim}: relative_actions adds the "
            "first action_dim state values (the joint positions) to the actions; set "
            "relative_actions=False, or action_dim <= state_dim"
        )


def check_cameras(cameras, image_hw) -> tuple[tuple[str, ...], tuple[int, int]]:
    """Normalized (cameras, image_hw); ValueError for an empty or repeated name or a bad size."""
    if isinstance(cameras, str):
        cameras = (cameras,)
    cameras = tuple(cameras)
    if not cameras or any(not isinstance(c, str) or not c for c in cameras):
        raise ValueError(f"cameras must be one or more non-empty names, got {cameras!r}")
    if len(set(cameras)) != len(cameras):
        raise ValueError(f"camera names must be unique, got {cameras!r}")
    hw = tuple(int(x) for x in image_hw)
    if len(hw) != 2 or min(hw) < 16:
        raise ValueError(f"image_hw must be (height, width), each >= 16, got {image_hw!r}")
    return cameras, hw


def history(x: torch.Tensor, per_step_ndim: int, n_obs_steps: int) -> torch.Tensor:
    """``x`` as (B, n_obs_steps, ...): a batch without a time axis is taken as one step (only
    valid when n_obs_steps == 1). Shapes only, so it is static under capture."""
    if x.dim() == per_step_ndim + 1:
        if n_obs_steps != 1:
            raise ValueError(f"expected a history of {n_obs_steps} steps, got shape {x.shape}")
        return x[:, None]
    if x.dim() != per_step_ndim + 2 or x.shape[1] != n_obs_steps:
        raise ValueError(f"expected (B, {n_obs_steps}, ...) history, got shape {tuple(x.shape)}")
    return x


# -- image encoders -------------------------------------------------------------------------------
class SmallConvEncoder(nn.Module):
    """A few 3x3 convs (with x/y coordinate channels, so positions are easy to read), each of
    its stride: (B, 3, H, W) -> (B, C, H / prod(strides), W / prod(strides)) feature map."""

    def __init__(
        self,
        channels: tuple[int, ...] = (32, 48, 64, 64),
        out_channels: int = 64,
        strides: tuple[int, ...] | None = None,
    ):
        super().__init__()
        strides = tuple(strides) if strides is not None else (2,) * len(channels)
        if len(strides) != len(channels):
            raise ValueError(f"one stride per conv: {len(channels)} channels, strides {strides}")
        layers: list[nn.Module] = []
        c_in = 5
        for c, st in zip(channels, strides, strict=True):
            layers += [nn.Conv2d(c_in, c, 3, st, 1), nn.GroupNorm(min(8, c), c), nn.SiLU()]
            c_in = c
        layers.append(nn.Conv2d(c_in, out_channels, 1))
        self.net = nn.Sequential(*layers)
        self.out_channels = out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        ys = torch.linspace(-1.0, 1.0, h, device=x.device, dtype=x.dtype)
        xs = torch.linspace(-1.0, 1.0, w, device=x.device, dtype=x.dtype)
        coords = torch.stack(torch.meshgrid(ys, xs, indexing="ij"))[None].expand(b, 2, h, w)
        return self.net(torch.cat([x, coords], 1))


def _norm2d(kind: str, c: int) -> nn.Module:
    return nn.BatchNorm2d(c) if kind == "batch" else nn.GroupNorm(c // 16, c)


class BasicBlock(nn.Module):
    """ResNet BasicBlock (two 3x3 convs and a shortcut), as torchvision's resnet18 has it."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = _norm2d(norm, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = _norm2d(norm, c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), _norm2d(norm, c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet18Trunk(nn.Module):
    """ResNet-18 without its pooling and classifier (what LeRobot's ACT and Diffusion Policy use
    as backbone): (B, 3, H, W) -> (B, 512, H/32, W/32). ``norm`` "batch" (ACT, frozen in eval)
    or "group" (Diffusion Policy replaces BatchNorm by GroupNorm)."""

    out_channels = 512

    def __init__(self, norm: str = "batch"):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = _norm2d(norm, 64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = (64, 128, 256, 512)
        c_in = 64
        for i, c in enumerate(widths):
            stride = 1 if i == 0 else 2
            layer = nn.Sequential(BasicBlock(c_in, c, stride, norm), BasicBlock(c, c, 1, norm))
            setattr(self, f"layer{i + 1}", layer)
            c_in = c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


def make_backbone(
    kind: str, norm: str, channels: tuple[int, ...], strides: tuple[int, ...] | None = None
) -> nn.Module:
    """The image encoder a config names: "resnet18" (ResNet18Trunk with ``norm``) or "small"
    (SmallConvEncoder of ``channels`` and ``strides``)."""
    if kind == "resnet18":
        return ResNet18Trunk(norm)
    if kind == "small":
        return SmallConvEncoder(
            tuple(channels), strides=tuple(strides) if strides is not None else None
        )
    raise ValueError(f"backbone must be 'small' or 'resnet18', got {kind!r}")


def register_normalization(module: nn.Module, state_dim: int) -> None:
    """The input normalization buffers: ``state_mean/std`` (identity until trained) and
    ``image_mean/std`` (ImageNet's, as LeRobot's policies have them)."""
    module.register_buffer("state_mean", torch.zeros(state_dim))
    module.register_buffer("state_std", torch.ones(state_dim))
    module.register_buffer("image_mean", torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1))
    module.register_buffer("image_std", torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1))


def feature_hw(encoder: nn.Module, image_hw: tuple[int, int]) -> tuple[int, int]:
    """Spatial size of ``encoder``'s feature map for one image size (a dry run on the CPU)."""
    was_training = encoder.training
    encoder.eval()  # no BatchNorm statistics updated by the dry run
    try:
        with torch.no_grad():
            y = encoder(torch.zeros(1, 3, *image_hw))
    finally:
        encoder.train(was_training)
    return int(y.shape[-2]), int(y.shape[-1])


def sine_pos_2d(h: int, w: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """DETR/ACT 2-D sinusoidal position embedding, (h * w, dim): half the channels encode y,
    half x."""
    if dim % 4:
        raise ValueError(f"dim must be a multiple of 4 for a 2-D sine embedding, got {dim}")
    n = dim // 2
    freqs = temperature ** (2 * (torch.arange(n) // 2) / n)
    ys = (torch.arange(h, dtype=torch.float32) + 1) / h * 2 * math.pi
    xs = (torch.arange(w, dtype=torch.float32) + 1) / w * 2 * math.pi
    py = ys[:, None] / freqs  # (h, n)
    px = xs[:, None] / freqs  # (w, n)
    py = torch.stack([py[:, 0::2].sin(), py[:, 1::2].cos()], -1).flatten(1)
    px = torch.stack([px[:, 0::2].sin(), px[:, 1::2].cos()], -1).flatten(1)
    pos = torch.cat(
        [py[:, None, :].expand(h, w, n), px[None, :, :].expand(h, w, n)], -1
    )  # (h, w, dim)
    return pos.reshape(h * w, dim)


def sine_pos_1d(n: int, dim: int) -> torch.Tensor:
    """1-D sinusoidal embedding of positions 0..n-1, (n, dim)."""
    pos = torch.arange(n, dtype=torch.float32)[:, None]
    i = torch.arange(dim // 2, dtype=torch.float32)
    ang = pos / (10000.0 ** (2 * i / dim))
    return torch.cat([ang.sin(), ang.cos()], -1)


class SpatialSoftmax(nn.Module):
    """Keypoints as Diffusion Policy reads them: a 1x1 conv to ``num_kp`` maps, a softmax over
    the pixels of each, and the expected (x, y) of each map: (B, C, H, W) -> (B, num_kp, 2)."""

    # outside the state dict, computed from the config (policy_checks.py)
    derived_buffers = ("grid",)

    def __init__(self, c_in: int, hw: tuple[int, int], num_kp: int = 32):
        super().__init__()
        self.kp = nn.Conv2d(c_in, num_kp, 1)
        h, w = hw
        ys, xs = torch.meshgrid(
            torch.linspace(-1.0, 1.0, h), torch.linspace(-1.0, 1.0, w), indexing="ij"
        )
        self.register_buffer("grid", torch.stack([xs.ravel(), ys.ravel()], -1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        att = torch.softmax(self.kp(x).flatten(2), -1)  # (B, K, HW)
        return att @ self.grid.to(att.dtype)  # (B, K, 2)


# -- weights files ---------------------------------------------------------------------------------
def load_weights(
    module: nn.Module,
    path: str | Path,
    what: str,
    config: dict | None = None,
    runtime_only: tuple[str, ...] = (),
) -> dict:
    """Load a ``{"config", "state_dict", "meta"}`` file (builtin:hybrid's, act's, diffusion's)
    into ``module`` (``what`` names it in errors); returns its meta. BadRequest (a ValueError)
    when the file is missing, unreadable or does not fit. With ``config`` (the module's, as a
    dict) the file's config must agree on every field but ``runtime_only``: weights trained
    with another head count, say, have the same shapes and would load without a word."""
    path = Path(path)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        sd = blob["state_dict"]
    except FileNotFoundError:
        raise BadRequest(f"weights file not found: {path}") from None
    except Exception as e:
        raise BadRequest(f"{path}: not a flashrt {what} weights file ({e})") from e
    saved = blob.get("config") if isinstance(blob, dict) else None
    if config is not None and isinstance(saved, dict):
        differ = sorted(
            k for k, v in config.items() if k not in runtime_only and k in saved and saved[k] != v
        )
        if differ:
            pairs = ", ".join(f"{k}={saved[k]!r} (asked {config[k]!r})" for k in differ)
            raise BadRequest(f"{path}: weights trained with another {what} config: {pairs}")
    try:
        module.load_state_dict(sd)
    except RuntimeError as e:
        raise BadRequest(f"{path}: weights do not fit {what}: {e}") from e
    return dict(blob.get("meta", {}))


def saved_config(path: Path) -> dict | None:
    """The config dict stored in a weights file, or None when there is no readable file."""
    if not path.is_file():
        return None
    try:
        return dict(torch.load(path, map_location="cpu", weights_only=True)["config"])
    except Exception:  # noqa: BLE001 - an unreadable file is reported when it is loaded
        return None


def make_policy(
    kind: str,
    config_cls: type,
    policy_cls: type[nn.Module],
    sizes: dict[str, dict],
    size: str,
    overrides: dict,
    *,
    weights: str | Path | None,
    trained: Path,
    runtime_only: tuple[str, ...],
    **fields,
) -> nn.Module:
    """builtin:<kind> in eval mode: the config of ``size`` (a key of ``sizes``) with
    ``overrides`` (config fields, checked) and ``fields`` (set when not None), built under torch
    seed 0. ``weights`` loads that file; otherwise size "sim" loads ``trained`` when its config
    matches (``runtime_only`` fields may differ), and without it the init stays seeded and a
    warning says why."""
    what = f"builtin:{kind}"
    if size not in sizes:
        raise ValueError(f"unknown {kind} size {size!r} (known: {', '.join(sizes)})")
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{what}: unknown override(s) {unknown} (known: {sorted(known)})")
    kw = {**sizes[size], **overrides}
    kw.update((k, v) for k, v in fields.items() if v is not None)
    cfg = config_cls(**kw)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        policy = policy_cls(cfg)
    if weights is not None:
        load_weights(policy, weights, what, cfg.to_dict(), runtime_only)
    elif size == "sim":
        saved = saved_config(trained)
        mine = cfg.to_dict()
        if saved is not None and all(
            saved.get(k) == v for k, v in mine.items() if k not in runtime_only
        ):
            load_weights(policy, trained, what)
        else:
            why = (
                "no trained weights"
                if saved is None
                else f"the config differs from {trained.name}'s"
            )
            logging.getLogger(policy_cls.__module__).warning(  # the policy module's logger
                "%s size %s: %s: running with seeded init", what, size, why
            )
    return policy.eval()


def count_parameters(module: nn.Module) -> int:
    """Number of parameters (buffers excluded)."""
    return sum(p.numel() for p in module.parameters())
