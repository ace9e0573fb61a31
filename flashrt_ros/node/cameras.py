"""Camera observations: one sensor_msgs/Image (or CompressedImage) topic per camera, checked and
staged without copies.

The `cameras` parameter lists the node's cameras, `name` or `name:encoding` (rgb8, bgr8, mono8;
without one the policy's channel count decides: rgb8 for 3 channels, mono8 for 1). Each camera is
the subscription `camera/<name>/image_raw` and the policy input `observation.images.<name>`; the
names must be the policy's image inputs exactly. The encoding is fixed at configure because the
captured step converts the camera's bytes (bgr8 reversed, mono8 repeated) inside the graph: a
message in another encoding would need another graph, so it is refused like a wrong size.

The subscriptions take the serialized message (`raw=True`) and decode it with the rosbags
typestore that replay uses: rclpy's own conversion builds the Python message field by field,
about 0.74 ms for a 640x480 rgb8 image on the 2-core CPU machine, on the thread that takes it and
under the GIL, while the decoded one is a numpy view over the received bytes (9 us;
decode_message says why it hands rosbags a memoryview). A valid image is kept as that view, no
copy; it is copied once into the pinned staging buffer that the captured graph uploads
(runtime/inputs.py InputBuffers.stage): by `Engine.prestage` as it arrives in observation mode
on CUDA, else by the step. Rows padded past width x channels (`step` larger than the row) are
taken as a strided view: still one copy, by numpy. A payload that does not decode is refused
like a wrong size. Where rosbags is not installed the subscriptions fall back to rclpy's
messages.

`name:compressed` subscribes `camera/<name>/image_raw/compressed` (sensor_msgs/CompressedImage)
instead. Its frames are taken and decoded (JPEG or PNG, obs/images.py decode_compressed) by a
thread of its own, `flashrt-decode-<name>` (DecodeLoop), which decodes only the newest of the
frames queued at each wake-up (the older ones count as received and superseded).

The checks (`image_array`, in obs/images.py) need no ROS, so the offline replay applies the very
same ones to the images of a bag.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from flashrt_ros.errors import BadRequest
from flashrt_ros.node.inputs import InputLoop
from flashrt_ros.node.polled import take
from flashrt_ros.node.qos_check import QOS_OVERRIDES, input_qos
from flashrt_ros.node.stats import Ring
from flashrt_ros.obs.images import COMPRESSED, camera_key, decode_compressed, image_array

try:  # rosbags (requirements.txt) decodes; without it, rclpy's own conversion is used
    from flashrt_ros.replay.bags import typestore
except ImportError:  # pragma: no cover - depends on the machine
    typestore = None

IMAGE_TYPE = "sensor_msgs/msg/Image"
COMPRESSED_TYPE = "sensor_msgs/msg/CompressedImage"


def decode_message(raw: bytes, type_name: str = IMAGE_TYPE, what: str = "image"):
    """A serialized sensor_msgs/Image or CompressedImage (CDR) as a message whose `data` is a
    numpy view over `raw`; BadRequest when it does not decode."""
    # a memoryview, not the bytes: rosbags slices off the 4-byte header, and a slice of bytes
    # is a copy of the whole image (28 of 37 us on the CPU machine; on the H200 the decode
    # went from 122 / 102 to 65 / 44 us for two cameras), where a slice of a memoryview is a
    # view (the image then stays a view over `raw`)
    view = memoryview(raw) if isinstance(raw, bytes) else raw
    try:
        return typestore().deserialize_cdr(view, type_name)
    except Exception as e:  # noqa: BLE001 - whatever the decoder raises on a bad payload
        short = type_name.rsplit("/", 1)[-1]
        raise BadRequest(f"{what}: not a sensor_msgs/{short} ({type(e).__name__}: {e})") from None


def decode_image(raw: bytes, what: str = "image"):
    """decode_message for a sensor_msgs/Image."""
    return decode_message(raw, IMAGE_TYPE, what)


@dataclass
class Camera:
    """One camera stream: its newest valid image (a view over its message) and counters."""

    name: str
    key: str
    shape: tuple[int, int, int]
    encoding: str
    sub: object = None
    latest: np.ndarray | None = None
    latest_t: float = 0.0  # monotonic reception time of `latest`
    received: int = 0
    accepted: int = 0
    refused: int = 0
    stale: int = 0  # steps withheld because this camera had no fresh image
    prestaged: int = 0  # images copied into the engine's staging buffer on arrival
    compressed: bool = False  # sensor_msgs/CompressedImage on .../image_raw/compressed
    superseded: int = 0  # compressed: frames not decoded, a newer one was queued behind them
    decode_ms: float = 0.0  # compressed: the last frames' decode time (moving average)
    last_refusal: str = ""
    refused_t: float = 0.0  # monotonic time of the last refusal
    # where an image's way in goes (us; /diagnostics p50s): per accepted raw image, reception
    # by the middleware -> taken (the wait for the thread, and the take's copy; only where the
    # middleware stamps receptions) and taken -> handled, split into the decode and checks
    # (compressed cameras too: their JPEG or PNG decode) and the prestage (per prestaged image,
    # raw or compressed: the engine lock and the copy into the staging buffer); the raw
    # cameras' acknowledgement after it is Cameras.ack_us
    wait_us: Ring = field(default_factory=lambda: Ring(256))
    handle_us: Ring = field(default_factory=lambda: Ring(256))
    decode_us: Ring = field(default_factory=lambda: Ring(256))
    prestage_us: Ring = field(default_factory=lambda: Ring(256))


def warm_decoder() -> None:
    """Build the typestore and its Image decoder now (configure), not on the first image: that
    costs ~90 ms once (80 ms the typestore, 8 ms the first decode), which in timer mode would
    be one control tick."""
    from rclpy.serialization import serialize_message
    from sensor_msgs.msg import Image

    decode_image(serialize_message(Image(height=1, width=1, encoding="mono8", step=1, data=b"\0")))


def warm_compressed() -> None:
    """Import both decoders and decode one tiny PNG and one tiny JPEG now (configure): not on
    the first frame, and a missing decoder fails the configure, saying which."""
    import io

    from PIL import Image

    b = io.BytesIO()
    Image.new("RGB", (2, 2)).save(b, "PNG")
    decode_compressed(b.getvalue(), (2, 2, 3))
    try:
        import simplejpeg
    except ImportError as e:
        raise RuntimeError(f"JPEG frames need simplejpeg (pip install simplejpeg): {e}") from None
    decode_compressed(simplejpeg.encode_jpeg(np.zeros((8, 8, 3), np.uint8)), (8, 8, 3))


class Cameras:
    """The node's camera subscriptions (see the module docstring).

    The subscriptions go to `callback_group`, a polled.PolledGroup the executor never runs.
    `polled`: the control thread calls `take()` at the top of each tick (timer mode, as
    joint_states: polled.py says why). Otherwise the inputs' loop (inputs.py) takes them and
    calls `on_image` (observation mode), which hands each valid image to `prestage` (the node
    copies it into the engine's staging buffer then, between steps); there every message
    handled is acknowledged on `~/camera_seen` (latched std_msgs/UInt64MultiArray: received and
    accepted per camera, in `cameras` order), so a lockstep replay knows the node holds an image
    before it sends the joint_states that steps on it. The raw cameras' images are acknowledged
    once per round of the inputs' loop (`acknowledge`, after it has taken every image queued),
    not once per image: each publish costs ~100 us of that thread on the H200 machine, and
    the second camera's image, queued behind the first, waited for the first one's (f32f784:
    ack 94-139 us p50). A compressed camera's accepted frame is acknowledged at once, then
    calls `on_new` (the node's step_on, when cameras step), on its decode thread: the
    acknowledgement goes out before the step it may start."""

    def __init__(
        self,
        node,
        cameras: Mapping[str, str | None],
        spec: Mapping[str, Mapping],
        refuse: Callable[[str], None],
        callback_group,
        polled: bool,
        qos,
        prestage: Callable[[str, np.ndarray], bool] | None = None,
        on_new: Callable[[], None] | None = None,
    ):
        from rclpy.qos import QoSDurabilityPolicy, QoSProfile
        from sensor_msgs.msg import CompressedImage, Image
        from std_msgs.msg import MultiArrayDimension, UInt64MultiArray

        self._refuse = refuse
        self._prestage = None if polled else prestage
        # after each accepted compressed frame (the node's step_on; the raw cameras' thread
        # calls it once it has taken all it found: inputs.InputLoop after_drain)
        self._on_new = None if polled else on_new
        self._seen_lock = threading.Lock()  # the decode thread acknowledges frames too
        self._ack_due = False  # a raw image was handled since the last acknowledgement
        self.ack_us = Ring(256)  # the publish of each acknowledgement by `acknowledge`
        # the wait for the engine lock inside each prestage (the node's prestage records it):
        # a step or a service holding it shows here, not in the copy
        self.prestage_lock_us = Ring(256)
        self.cams: list[Camera] = []
        self._decoders: list[DecodeLoop] = []  # a thread per compressed camera (start_decoding)
        self._node = node
        self.polled = polled
        self._seen_pub = None
        # what can fail (a decoder missing) before anything is created: nothing is left behind
        if cameras and typestore is not None:
            warm_decoder()
        if COMPRESSED in cameras.values():
            warm_compressed()
        try:
            for name, enc in cameras.items():
                s = spec[camera_key(name)]
                cam = Camera(name, camera_key(name), tuple(s["shape"]), s["encoding"])
                cam.compressed = enc == COMPRESSED
                cam.sub = node.create_subscription(
                    CompressedImage if cam.compressed else Image,
                    f"camera/{name}/image_raw" + ("/compressed" if cam.compressed else ""),
                    partial(self.on_compressed if cam.compressed else self.on_image, cam),
                    input_qos(qos),
                    callback_group=callback_group,
                    raw=typestore is not None,  # decoded by decode_image (the module docstring)
                    qos_overriding_options=QOS_OVERRIDES,
                )
                self.cams.append(cam)
        except Exception:
            self.close(node)  # the subscriptions made so far
            raise
        if not polled:
            latched = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
            self._seen_pub = node.create_publisher(UInt64MultiArray, "~/camera_seen", latched)
            self._seen = UInt64MultiArray()
            n = len(self.cams)
            self._seen.layout.dim = [
                MultiArrayDimension(
                    label=",".join(c.name for c in self.cams), size=n, stride=2 * n
                ),
                MultiArrayDimension(label="received,accepted", size=2, stride=2),
            ]
            self._publish_seen()
        self._warn_large_frames(node)

    def _warn_large_frames(self, node) -> None:
        """Say so at configure when raw frames exceed Fast DDS's default shared-memory segment
        and no profile is set (node/fastdds.py): otherwise they arrive ~10 ms late, silently."""
        from rclpy.utilities import get_rmw_implementation_identifier

        from flashrt_ros.node.fastdds import installed_profile, large_image_hint

        sizes = {c.name: int(np.prod(c.shape)) for c in self.cams if not c.compressed}
        rmw = get_rmw_implementation_identifier()
        hint = large_image_hint(sizes, os.environ, rmw, installed_profile())
        if hint:
            node.get_logger().warning(hint)

    def raw_subs(self) -> list:
        """The subscriptions of the uncompressed cameras (taken by the inputs' loop or the
        control thread; the compressed ones have the decode thread)."""
        return [c.sub for c in self.cams if not c.compressed]

    def start_decoding(self) -> None:
        """Start a thread per compressed camera that takes and decodes its frames: a JPEG
        decode takes a millisecond or more, which on the thread that steps would delay the step
        behind it, and Pillow decodes without the GIL, so two cameras' frames that arrive
        together are decoded side by side (one thread did them one after the other: 2.3 + 2.1
        ms for two 640x480 JPEGs on the H200 machine, 8078a72)."""
        if self._decoders:
            return
        for c in self.cams:
            if c.compressed:
                loop = DecodeLoop(self._node.context, self._node.get_logger(), [c.sub])
                loop.thread_name = f"flashrt-decode-{c.name}"
                self._decoders.append(loop)
                loop.start()

    def stop_decoding(self) -> None:
        """End the decode threads (they end before the subscriptions they wait on go)."""
        for loop in self._decoders:
            loop.close()
        self._decoders = []

    def close(self, node) -> None:
        self.stop_decoding()
        for c in self.cams:
            node.destroy_subscription(c.sub)
        with self._seen_lock:
            pub, self._seen_pub = self._seen_pub, None
        if pub is not None:
            node.destroy_publisher(pub)
        self.cams = []

    def clear(self, then: Callable[[], None] | None = None) -> None:
        """Forget every image (activation: never step on one from before), and drop the queued
        ones in polled mode. Between two frames of each decode thread, so a frame one was
        decoding meanwhile cannot land after this; `then` runs before they go on (the node
        notes its step_on counts there, so no frame lands between the two)."""
        with contextlib.ExitStack() as held:
            for loop in self._decoders:
                held.enter_context(loop.lock)
            for c in self.cams:
                c.latest = None
                if self.polled:
                    while take(c.sub) is not None:
                        pass
            if then is not None:
                then()

    def on_image(self, cam: Camera, msg, age: float = 0.0) -> bool:
        """Check one message; a valid one becomes the camera's newest image. False if refused."""
        t0 = time.perf_counter()
        cam.received += 1
        what = f"camera {cam.name!r}"
        try:
            if isinstance(msg, bytes | bytearray | memoryview):
                msg = decode_image(msg, what)
            img = image_array(msg, cam.shape, cam.encoding, what)
        except BadRequest as e:
            return self._refused(cam, e)
        cam.decode_us.add((time.perf_counter() - t0) * 1e6)
        ok = self._accepted(cam, img, age)
        if age > 0.0:  # 0.0: no reception stamp (polled.take)
            cam.wait_us.add(age * 1e6)
        cam.handle_us.add((time.perf_counter() - t0) * 1e6)
        return ok

    def on_compressed(self, cam: Camera, msg, age: float = 0.0, superseded: int = 0) -> bool:
        """A compressed camera's newest frame (on the decode thread), after `superseded` older
        ones that were not decoded: its JPEG or PNG decoded to the camera's rgb8 (mono8) and
        checked; then as on_image. False if refused. The frames are counted as received only
        once handled, so an acknowledgement published meanwhile by another camera's thread
        never tells a lockstep client that this one is held before it is."""
        cam.superseded += superseded
        what = f"camera {cam.name!r}"
        t0 = time.perf_counter()
        try:
            if isinstance(msg, bytes | bytearray | memoryview):
                msg = decode_message(msg, COMPRESSED_TYPE, what)
            img = decode_compressed(memoryview(msg.data), cam.shape, what)
        except BadRequest as e:
            return self._refused(cam, e, count=1 + superseded)
        took = time.perf_counter() - t0
        cam.decode_us.add(took * 1e6)
        ms = took * 1e3
        cam.decode_ms = ms if cam.decode_ms == 0.0 else 0.9 * cam.decode_ms + 0.1 * ms
        # its age from reception, the decode included
        return self._accepted(cam, img, age + took, count=1 + superseded)

    def _refused(self, cam: Camera, e: BadRequest, count: int = 0) -> bool:
        """`count`: frames to count as received now (compressed: after the decode)."""
        cam.received += count
        cam.refused += 1
        cam.last_refusal, cam.refused_t = str(e), time.monotonic()
        self._refuse(str(e))
        self._acknowledged(cam)
        return False

    def _accepted(self, cam: Camera, img: np.ndarray, age: float, count: int = 0) -> bool:
        """`count`: frames to count as received now, once the image is the camera's newest."""
        cam.latest, cam.latest_t = img, time.monotonic() - age
        cam.received += count
        cam.accepted += 1
        if self._prestage is not None:
            t0 = time.perf_counter()
            if self._prestage(cam.key, img):
                cam.prestaged += 1  # copied now, not in the step (Engine.prestage)
                cam.prestage_us.add((time.perf_counter() - t0) * 1e6)
        self._acknowledged(cam)
        if self._on_new is not None and cam.compressed:
            self._on_new()  # the node's step_on: this frame may complete a frame set
        return True

    def _acknowledged(self, cam: Camera) -> None:
        """A compressed frame is acknowledged now (on its decode thread); a raw image by the
        next `acknowledge`, at the end of the inputs' loop's round."""
        if cam.compressed:
            self._publish_seen()
        else:
            self._ack_due = True

    def acknowledge(self) -> None:
        """Publish one acknowledgement for the raw images handled since the last one (the
        inputs' loop calls it after each round of its drained inputs, before any step)."""
        if not self._ack_due:
            return
        t0 = time.perf_counter()
        published = self._publish_seen()  # if it raises, the next round tries again
        self._ack_due = False
        if published:
            self.ack_us.add((time.perf_counter() - t0) * 1e6)

    def _publish_seen(self) -> bool:
        """Acknowledge on ~/camera_seen (observation mode; nothing in polled mode, False)."""
        with self._seen_lock:  # the decode thread too; close() clears the publisher under it
            if self._seen_pub is None:
                return False
            self._seen.data = [v for c in self.cams for v in (c.received, c.accepted)]
            self._seen_pub.publish(self._seen)
            return True

    def take(self) -> None:
        """Polled mode: handle every queued message of every uncompressed camera (newest valid
        one wins); the compressed ones are the decode thread's."""
        for c in self.cams:
            if c.compressed:
                continue
            while (got := take(c.sub)) is not None:
                self.on_image(c, got[0], age=got[1])

    def accepted(self, name: str) -> int:
        """The valid images of camera `name` so far (the node's step_on counts them)."""
        return next(c.accepted for c in self.cams if c.name == name)

    def age(self, name: str, now: float) -> float | None:
        """Seconds since camera `name`'s newest valid image (None before the first)."""
        c = next(c for c in self.cams if c.name == name)
        return None if c.latest is None else now - c.latest_t

    def refused_since(self, name: str) -> str:
        """Camera `name`'s last refusal when it came after its newest valid image ("" else): why
        the camera is stale, when a stream of refused images is the cause."""
        c = next(c for c in self.cams if c.name == name)
        late = c.refused_t > (c.latest_t if c.latest is not None else 0.0)
        return c.last_refusal if c.last_refusal and late else ""

    def stale(self, now: float, timeout: float) -> str:
        """The first camera without an image newer than `timeout` ("" when all are fresh);
        the step is counted on every such camera (`stale_steps`), not only the first."""
        first = ""
        for c in self.cams:
            if c.latest is None or now - c.latest_t > timeout:
                c.stale += 1
                first = first or c.name
        return first

    def observation(self, state: np.ndarray, state_key: str) -> dict[str, np.ndarray]:
        """The dict observation of one step: the state vector and each camera's newest image."""
        obs = {state_key: state}
        for c in self.cams:
            obs[c.key] = c.latest
        return obs

    def diagnostics(self, now: float) -> dict[str, str]:
        kv = {}
        for name, ring in (("prestage_lock_wait", self.prestage_lock_us), ("ack", self.ack_us)):
            if ring.n:
                kv[f"camera.{name}_p50_us"] = f"{ring.pct(50):.1f}"
        for c in self.cams:
            p = f"camera.{c.name}."
            kv[p + "received"] = str(c.received)
            kv[p + "refused"] = str(c.refused)
            kv[p + "stale_steps"] = str(c.stale)
            kv[p + "prestaged"] = str(c.prestaged)
            kv[p + "transport"] = "compressed" if c.compressed else "raw"
            if c.compressed:
                kv[p + "decode_ms"] = f"{c.decode_ms:.2f}"
                kv[p + "superseded"] = str(c.superseded)
            kv[p + "age_s"] = "none" if c.latest is None else f"{now - c.latest_t:.3f}"
            for name, ring in (
                ("wait", c.wait_us), ("handle", c.handle_us), ("decode", c.decode_us),
                ("prestage", c.prestage_us),
            ):  # fmt: skip
                if ring.n:
                    kv[p + name + "_p50_us"] = f"{ring.pct(50):.1f}"
            kv[p + "encoding"] = c.encoding
            kv[p + "last_refusal"] = c.last_refusal
        return kv


class DecodeLoop(InputLoop):
    """A compressed camera's thread: at each wake-up it takes every queued frame and hands
    only the newest to the camera's callback, with the count of the older ones
    (`callback(message, age_s, superseded)`): a decode takes milliseconds (a PNG ~6 ms), so
    decoding a backlog would only delay the frame that matters."""

    thread_name = "flashrt-decode"

    def _on_ready(self, ws, stop=None) -> None:
        ready = ws.get_ready_entities("subscription")
        if not ready:  # the stop guard, or the once-a-second look at the context
            return
        with self.lock:
            for sub in self.drained:
                if sub.handle.pointer not in ready:
                    continue
                newest, older = None, 0
                while (got := self._take(sub)) is not None:
                    older += newest is not None
                    newest = got
                if newest is not None:  # callback(message, age_s, superseded)
                    self._call(sub, (*newest, older))
