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

# a `cameras` item: name[:encoding], or name:compressed (sensor_msgs/CompressedImage)
CAMERA_RE = r"[A-Za-z][A-Za-z0-9_]*(:(rgb8|bgr8|mono8|compressed))?"
CHANNELS = {"rgb8": 3, "bgr8": 3, "mono8": 1}  # the encodings served, and their bytes per pixel
COMPRESSED = "compressed"  # a camera whose JPEG or PNG frames are decoded to rgb8 (or mono8)
# Pillow modes of 8-bit (or 1-bit) samples: converted exactly; 16-bit grey and float are not
EIGHT_BIT = ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "YCbCr")
CAMERA_TEXT = "name, name:encoding or name:compressed; a name is a letter then letters, digits "
CAMERA_TEXT += "or _; encoding rgb8, bgr8 or mono8"


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


def engine_encoding(encoding: str | None) -> str | None:
    """The encoding the captured step converts from: a compressed camera is decoded to rgb8
    (mono8 for a 1-channel input), the policy's default, so it gives None as an unset one."""
    return None if encoding == COMPRESSED else encoding


def decode_compressed(data, shape: tuple[int, int, int], what: str = "image") -> np.ndarray:
    """A JPEG or PNG frame (the bytes of a sensor_msgs/CompressedImage) as an H x W x 3 RGB
    array (H x W grey for a 1-channel `shape`), or BadRequest. The size is read from the header
    and checked before anything is decoded, so a frame of the wrong size (or a decompression
    bomb) costs no decode. The array is a view over a bytes object, so Engine staging may keep
    it (inputs.immutable)."""
    h, w, c = shape
    jpeg = bytes(data[:2]) == b"\xff\xd8"
    raw = _decode_jpeg(data, h, w, c, what) if jpeg else _decode_png(data, h, w, c, what)
    a = np.frombuffer(raw, dtype=np.uint8)
    return a.reshape(h, w, 3) if c == 3 else a.reshape(h, w)


def _decode_jpeg(data, h: int, w: int, c: int, what: str) -> bytes:
    """libjpeg-turbo through simplejpeg, strict: the warnings libjpeg gives for damaged scan
    data ("premature end of data segment": a USB camera's frame cut short, an end marker
    appended; "bad Huffman code") refuse the frame. Pillow only logs them and hands out the
    grey or garbled rows. JPEG has no checksum: damage that still decodes without a warning
    cannot be told from a real image by any decoder."""
    try:
        import simplejpeg
    except ImportError:  # the node's configure checks it (cameras.warm_compressed)
        raise BadRequest(f"{what}: JPEG frames need simplejpeg (pip install simplejpeg)") from None
    try:
        fh, fw, _, _ = simplejpeg.decode_jpeg_header(data)
    except (ValueError, TypeError) as e:
        raise BadRequest(f"{what}: not a JPEG or PNG image ({e})") from None
    if (fw, fh) != (w, h):
        raise BadRequest(f"{what}: {fw}x{fh} pixels, the policy takes {w}x{h}")
    try:
        img = simplejpeg.decode_jpeg(data, colorspace="RGB" if c == 3 else "GRAY", strict=True)
    except (ValueError, TypeError, RuntimeError) as e:
        raise BadRequest(f"{what}: the JPEG data does not decode ({e})") from None
    return img.tobytes()


def _decode_png(data, h: int, w: int, c: int, what: str) -> bytes:
    """Pillow: other 8-bit modes (grey, palette, RGBA) are converted; 16-bit grey and float
    frames (a depth camera on the wrong topic) are refused. A 16-bit colour PNG is read as
    8-bit RGB (the high byte of each sample). Damage is caught by PNG's own CRCs and zlib."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data), formats=("PNG",))
    except Image.DecompressionBombError:  # a header of over ~179 M pixels: not decoded
        raise BadRequest(f"{what}: a frame far larger than the policy's {w}x{h}") from None
    except (UnidentifiedImageError, OSError, ValueError, TypeError) as e:
        raise BadRequest(f"{what}: not a JPEG or PNG image ({type(e).__name__})") from None
    if im.size != (w, h):
        raise BadRequest(f"{what}: {im.size[0]}x{im.size[1]} pixels, the policy takes {w}x{h}")
    if im.mode not in EIGHT_BIT:  # 16-bit or float (a depth stream?) would saturate silently
        raise BadRequest(f"{what}: pixel mode {im.mode!r} is not 8-bit (served: {EIGHT_BIT})")
    mode = "RGB" if c == 3 else "L"
    try:
        if im.mode != mode:
            im = im.convert(mode)
        return im.tobytes()
    except (OSError, ValueError, SyntaxError) as e:  # truncated or corrupt after the header
        raise BadRequest(f"{what}: the PNG data does not decode ({e})") from None


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
