"""Camera images for a policy's image inputs, without ROS: which cameras, which encodings, and
the checks of one sensor_msgs/Image (rclpy's or a rosbags one). The node (node/cameras.py) and
the offline replay (replay/) apply the very same checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import numpy as np

from flashrt_ros.errors import BadRequest
from flashrt_ros.obs.keys import IMAGE_PREFIX

CAMERA_RE = r"[A-Za-z][A-Za-z0-9_]*(:(rgb8|bgr8|mono8))?"  # a `cameras` item: name[:encoding]
CHANNELS = {"rgb8": 3, "bgr8": 3, "mono8": 1}  # the encodings served, and their bytes per pixel
CAMERA_TEXT = "name or name:encoding; a name is a letter then letters, digits or _; encoding "
CAMERA_TEXT += "rgb8, bgr8 or mono8"


def parse_cameras(items: Iterable[str]) -> dict[str, str | None]:
    """`cameras` items -> {name: encoding or None (the policy's default)}, in order; BadRequest
    for a malformed item or a name given twice."""
    out: dict[str, str | None] = {}
    for item in items:
        if not isinstance(item, str) or not re.fullmatch(CAMERA_RE, item):
            raise BadRequest(f"camera {item!r}: want {CAMERA_TEXT}")
        name, _, enc = item.partition(":")
        if name in out:
            raise BadRequest(f"camera {name!r} is listed twice")
        out[name] = enc or None
    return out


def camera_key(name: str) -> str:
    return IMAGE_PREFIX + name


def image_names(spec: Mapping[str, Mapping]) -> list[str]:
    """The camera names of an observation spec (Engine.observation_spec()): its image inputs."""
    return [k[len(IMAGE_PREFIX) :] for k, v in spec.items() if v["kind"] == "image"]


def match_policy(cameras: Mapping[str, str | None], policy_images: list[str]) -> None:
    """BadRequest naming both sets unless the cameras are exactly the policy's image inputs."""
    if set(cameras) != set(policy_images):
        raise BadRequest(
            f"cameras {sorted(cameras)} do not match the policy's image inputs "
            f"{sorted(policy_images)} (observation.images.<name>); set the `cameras` parameter "
            "to exactly those names"
        )


def image_array(msg, shape: tuple[int, int, int], encoding: str, what: str = "image") -> np.ndarray:
    """A sensor_msgs/Image (rclpy's or a rosbags one: height, width, encoding, step, data) as an
    H x W x C uint8 view over its data, or BadRequest saying what is wrong. Checked: encoding
    (served, and the one configured), height, width, step (at least one row, and the data exactly
    step x height bytes). No pixel is read."""
    enc = msg.encoding
    if enc not in CHANNELS:
        raise BadRequest(
            f"{what}: encoding {enc!r} is not served (rgb8, bgr8, mono8; this camera: {encoding})"
        )
    if enc != encoding:
        raise BadRequest(f"{what}: encoding {enc!r}, but this camera is configured {encoding}")
    h, w, c = shape
    if msg.height != h or msg.width != w:
        raise BadRequest(f"{what}: {msg.width}x{msg.height} pixels, the policy takes {w}x{h}")
    row, step, n = w * c, int(msg.step), len(msg.data)
    if step < row:
        raise BadRequest(f"{what}: step {step} is shorter than a row ({w} x {c} = {row} bytes)")
    if n != step * h:
        raise BadRequest(f"{what}: {n} data bytes, step x height is {step * h}")
    a = np.frombuffer(msg.data, dtype=np.uint8)
    if step == row:
        return a.reshape(h, w, c)
    return a.reshape(h, step)[:, :row].reshape(h, w, c)  # padded rows: a strided view
