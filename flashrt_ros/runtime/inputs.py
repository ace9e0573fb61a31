"""Observation inputs: host checks, pinned staging, static device buffers, image conversion.

Every input of `Policy.input_spec()` gets a static device buffer in its wire layout (a vector
as float32, an image as H x W x C uint8, as ROS delivers it) and, on CUDA, a pinned host
staging buffer; the captured graph uploads each one with a memcpy node, so a tick costs the
host one memcpy per input into pinned memory. The conversion of an image to the policy's
layout (float32 CHW in [0, 1], channels in the policy's order) is `to_policy`, which runs
inside the captured step: uint8 crosses PCIe, not float32, and the host does no arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from flashrt_ros.errors import BadRequest
from flashrt_ros.policies.base import InputSpec

ENCODINGS = ("rgb8", "bgr8", "mono8")  # what a camera may deliver (sensor_msgs/Image names)

_NOT_NUMBERS = (bool, np.bool_, str, bytes)
_F32_MAX = float(np.finfo(np.float32).max)


def _bool_array(v) -> bool:
    """An array or tensor of bools inside a list (np.asarray would make 1.0 of True)."""
    dtype = getattr(v, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype == torch.bool
    return isinstance(dtype, np.dtype) and dtype.kind == "b"


def numeric(x, what: str) -> np.ndarray:
    """x as a float64 array: numbers only (no strings, bools, objects, grad-tracking tensors)."""
    if type(x) is np.ndarray and x.dtype.kind == "f":  # the common case, kept cheap
        return x.astype(np.float64, copy=False)
    if isinstance(x, torch.Tensor):
        if x.requires_grad:
            raise BadRequest(f"{what} is a tensor that requires grad; pass it .detach()ed")
        try:
            x = x.detach().cpu().numpy()
        except (TypeError, RuntimeError) as e:
            raise BadRequest(f"{what}: cannot read this tensor ({e})") from None
    elif isinstance(x, list | tuple):
        bad = next((v for v in x if isinstance(v, _NOT_NUMBERS) or _bool_array(v)), None)
        if bad is not None:
            raise BadRequest(f"{what} holds {type(bad).__name__} {bad!r}, not a number")
    elif isinstance(x, str | bytes) or x is None:
        raise BadRequest(f"{what} must be numbers, got {type(x).__name__}")
    try:
        a = np.asarray(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise BadRequest(f"{what} is not numeric: {e}") from None
    if a.dtype.kind not in "iuf":
        raise BadRequest(f"{what} must be real numbers, got dtype {a.dtype}")
    return a.astype(np.float64, copy=False)


def vector(x, n: int, what: str, limit: float = math.inf) -> np.ndarray:
    """A finite float32 vector of length n with every |value| <= limit, or BadRequest; never
    touches a device buffer."""
    a = numeric(x, what)
    if a.shape != (n,):
        raise BadRequest(f"{what} must have shape ({n},), got {a.shape}")
    peak = float(np.abs(a).max()) if n else 0.0
    if not peak <= min(limit, _F32_MAX):  # one reduction; NaN fails every comparison
        if not np.isfinite(a).all():
            raise BadRequest(f"{what} has NaN or Inf at index {int(np.argmin(np.isfinite(a)))}")
        if peak > limit:
            i = int(np.argmax(np.abs(a) > limit))
            raise BadRequest(
                f"{what}[{i}] = {a[i]:g} is beyond the bound |x| <= {limit:g} (obs_limit)"
            )
        raise BadRequest(f"{what} overflows float32")
    return a.astype(np.float32)


def image(x, shape: tuple[int, int, int], what: str) -> np.ndarray:
    """An H x W x C uint8 numpy array of exactly `shape` (an H x W array when C == 1), or
    BadRequest. No copy: the caller's array is staged as it is (strided views too)."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise BadRequest(f"{what} must be a host array, got a tensor on {x.device}")
        x = x.detach().numpy()
    if not isinstance(x, np.ndarray):
        raise BadRequest(f"{what} must be a uint8 numpy array (H x W x C), got {type(x).__name__}")
    if x.dtype != np.uint8:
        raise BadRequest(f"{what} must have dtype uint8 (raw camera bytes), got {x.dtype}")
    if x.shape != shape and not (shape[2] == 1 and x.shape == shape[:2]):
        raise BadRequest(f"{what} must have shape {shape} (H x W x C), got {x.shape}")
    return x


def resolve_encodings(
    specs: list[InputSpec], encodings: Mapping[str, str] | None
) -> dict[str, str]:
    """Each image input's camera encoding: the given one, else rgb8 (3 channels) or mono8 (1).
    mono8 into a 3-channel policy repeats the grey channel; rgb8/bgr8 need 3 channels."""
    images = {i.name: i for i in specs if i.kind == "image"}
    if not isinstance(encodings, Mapping | None):
        raise BadRequest(f"image_encodings must be a dict name -> encoding, got {encodings!r}")
    given = dict(encodings or {})
    unknown = sorted(set(given) - set(images))
    if unknown:
        raise BadRequest(
            f"image_encodings names {unknown}, which are not image inputs of this policy "
            f"(image inputs: {sorted(images)})"
        )
    out = {}
    for name, spec in images.items():
        enc = given.get(name, "rgb8" if spec.shape[0] == 3 else "mono8")
        if enc not in ENCODINGS:
            raise BadRequest(f"image_encodings[{name!r}] = {enc!r}: one of {ENCODINGS}")
        if enc != "mono8" and spec.shape[0] != 3:
            raise BadRequest(f"{name}: the policy takes 1 channel, so the camera must be mono8")
        out[name] = enc
    return out


def wire_shape(spec: InputSpec, encoding: str | None) -> tuple[int, ...]:
    """The shape an input arrives in (no batch): (D,) or (H, W, C) with C from the encoding."""
    if spec.kind == "vector":
        return tuple(spec.shape)
    _, h, w = spec.shape
    return (h, w, 1 if encoding == "mono8" else 3)


def to_policy(raw: torch.Tensor, encoding: str, channels: int) -> torch.Tensor:
    """(1, H, W, Ce) uint8 -> (1, C, H, W) float32 in [0, 1] (x / 255, as LeRobot divides),
    contiguous, channels in RGB order: bgr8 is reversed here, mono8 repeated to C. Pure tensor
    ops of static shapes: capturable, and fused into one kernel by inductor."""
    x = raw.flip(-1) if encoding == "bgr8" else raw
    x = x.permute(0, 3, 1, 2).to(torch.float32) / 255.0
    if x.shape[1] != channels:
        x = x.expand(-1, channels, -1, -1)
    return x.contiguous()


def policy_inputs(raw: dict[str, torch.Tensor], conv: tuple) -> dict[str, torch.Tensor]:
    """The tensors a policy's tick sees: vectors as they are, images converted. `conv` rows are
    (name, encoding or None, channels), fixed when the step is built."""
    return {n: raw[n] if enc is None else to_policy(raw[n], enc, c) for n, enc, c in conv}


def immutable(x: np.ndarray) -> bool:
    """Whether `x`'s bytes can never change: a view whose memory is a `bytes` object (what a
    camera message decoded in place gives, node/cameras.py). Such an array, staged once, is
    still in the staging buffer as long as that array is the one staged."""
    b = x
    while isinstance(b, np.ndarray):
        b = b.base
    if isinstance(b, memoryview):
        b = b.obj if b.readonly else None
    return isinstance(b, bytes)


class InputBuffers:
    """Per input: `dev` (the static device buffer, (1, *wire shape)), `host` (pinned staging on
    CUDA, the device buffer itself on the CPU) and `np` (a numpy view of host row 0, so staging
    allocates nothing per tick)."""

    def __init__(self, specs: list[InputSpec], encodings: dict[str, str], device: torch.device):
        self.specs = {s.name: s for s in specs}
        self.shapes = {s.name: wire_shape(s, encodings.get(s.name)) for s in specs}
        self.dev: dict[str, torch.Tensor] = {}
        self.host: dict[str, torch.Tensor] = {}
        self.np: dict[str, np.ndarray] = {}
        cuda = torch.device(device).type == "cuda"
        # Only a staging buffer of its own keeps what was staged: on the CPU the step reads the
        # device buffer itself, which a policy could write.
        self.keeps = cuda
        self.staged: dict[str, np.ndarray | None] = {}  # name -> the immutable array staged last
        self.copies = 0  # staging copies made (tests, benchmarks)
        for s in specs:
            dt = torch.float32 if s.kind == "vector" else torch.uint8
            shape = (1, *self.shapes[s.name])
            self.dev[s.name] = torch.zeros(shape, dtype=dt, device=device)
            self.host[s.name] = (
                torch.zeros(shape, dtype=dt, pin_memory=True) if cuda else self.dev[s.name]
            )
            self.np[s.name] = self.host[s.name][0].numpy()

    def stage(self, name: str, x: np.ndarray) -> None:
        """Copy one checked input into its host buffer (one memcpy; an H x W mono image lands
        in the H x W x 1 buffer). An image that is the immutable array staged last is there
        already: a camera at 30 Hz feeding a 500 Hz loop is copied 30 times a second, not 500
        (1.8 MB a step for two 640x480 rgb8 images, ~200 us of host time on the H200 machine)."""
        if self.keeps and self.staged.get(name) is x:
            return
        dst = self.np[name]
        # One thread's copy: torch's, split over its intra-op threads, was 4x faster back to
        # back but woke sleeping threads in a real loop, up to 2-10 ms p99 on the H200 machine
        # (bench/staging_probe.py and queue_probe.py, 59f9ea8).
        np.copyto(dst, x if x.ndim == dst.ndim else x.reshape(dst.shape))
        self.copies += 1
        if self.keeps:
            self.staged[name] = x if x.dtype == np.uint8 and immutable(x) else None


def check_dict(
    obs: Mapping, specs: list[InputSpec], shapes: dict[str, tuple], limit: float
) -> dict[str, np.ndarray]:
    """Every key of a dict observation checked (name, shape, dtype, finite, obs_limit) before
    anything is staged; BadRequest names the key. Missing and extra keys are refused."""
    names = [s.name for s in specs]
    extra = sorted(repr(k) if not isinstance(k, str) else k for k in obs if k not in shapes)
    missing = [n for n in names if n not in obs]
    if extra or missing:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"unknown {[str(k) for k in extra]}")
        raise BadRequest(f"observation keys: {'; '.join(parts)} (this policy takes {names})")
    out = {}
    for s in specs:
        what = f"observation[{s.name!r}]"
        if s.kind == "vector":
            out[s.name] = vector(obs[s.name], s.shape[0], what, limit)
        else:
            out[s.name] = image(obs[s.name], shapes[s.name], what)
    return out
