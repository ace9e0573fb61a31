"""Camera observations in the node, over real DDS on loopback (CPU): two sensor_msgs/Image
cameras plus joint_states into a real visuomotor policy (builtin:act's module at 24x32, the
`top` camera rgb8, the `wrist` camera bgr8)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from rclpy.qos import QoSDurabilityPolicy, QoSProfile
from sensor_msgs.msg import Image
from std_msgs.msg import UInt64MultiArray

from test.node_client import NodeClient, settled_count
from test.ros_helpers import REPO_ROOT, launch_node

SPEC = "test.test_node_cameras:act_two_cameras"
H, W = 24, 32
CAMERAS = ["top", "wrist:bgr8"]
ENCODINGS = {"top": "rgb8", "wrist": "bgr8"}


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch) -> None:
    """The node process imports the test policy from this repository."""
    old = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", f"{REPO_ROOT}{os.pathsep}{old}" if old else str(REPO_ROOT))


def act_two_cameras():
    """builtin:act's module with two small cameras (seeded init, pure): its action depends on
    the state and on both images."""
    from flashrt_ros.policies.act import make_act

    return make_act(cameras=("top", "wrist"), image_hw=(H, W))


def image_msg(img: np.ndarray, encoding: str, step: int | None = None, data=None) -> Image:
    h, w = img.shape[:2]
    c = 1 if img.ndim == 2 else img.shape[2]
    m = Image(height=h, width=w, encoding=encoding, is_bigendian=0)
    m.step = w * c if step is None else step
    m.data = img.tobytes() if data is None else data
    return m


def frames(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (H, W, 3), dtype=np.uint8) for _ in range(n)]


class Cams:
    """Publishers of the node's two cameras and its ~/camera_seen acknowledgements."""

    def __init__(self, ros, proc):
        n = ros.node
        self.ros = ros
        self.pub = {
            c: n.create_publisher(Image, proc.topic(f"camera/{c}/image_raw"), 10)
            for c in ("top", "wrist")
        }
        self.seen: list[int] = []
        latched = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
        n.create_subscription(
            UInt64MultiArray,
            proc.service("camera_seen"),
            lambda m: setattr(self, "seen", list(m.data)),
            latched,
        )
        assert ros.spin_until(
            lambda: all(p.get_subscription_count() > 0 for p in self.pub.values()), 20
        ), "node does not subscribe its cameras"

    def send(self, cam: str, msg: Image, acked: bool = True) -> None:
        """Publish; with `acked`, wait until the node has handled it (observation mode)."""
        i = 0 if cam == "top" else 2
        before = self.seen[i] if self.seen else 0
        self.pub[cam].publish(msg)
        if acked:
            assert self.ros.spin_until(lambda: self.seen and self.seen[i] > before, 10), (
                f"node did not acknowledge the {cam} image"
            )


def stream_until(ros, c, seconds: float, publish, until=None) -> dict:
    """Call `publish()` at ~20 Hz for `seconds`, or until a diagnostics message satisfies
    `until` (returned; {} without `until`, a failure when none did)."""
    end, n = time.monotonic() + seconds, len(c.diagnostics)
    while time.monotonic() < end:
        publish()
        ros.spin_for(0.05)
        hit = [d for d in c.diagnostics[n:] if until is not None and until(d)]
        if hit:
            return hit[0]
    assert until is None, f"no such diagnostics; last: {c.diagnostics[-1:]}"
    return {}


def reference_engine():
    from flashrt_ros import Engine, load_policy

    return Engine(
        load_policy(SPEC),
        device="cpu",
        image_encodings={"observation.images.wrist": "bgr8"},
    )


@pytest.mark.exclusive
def test_observation_trigger_steps_on_valid_images_only_and_equals_the_engine(ros):
    proc = ros.start_node(
        {"policy": SPEC, "device": "cpu", "trigger": "observation", "cameras": CAMERAS}
    )
    c, cams = NodeClient(ros, proc), Cams(ros, proc)
    eng = reference_engine()
    spec = eng.observation_spec()
    assert spec["observation.images.top"]["shape"] == (H, W, 3)
    obs = np.random.default_rng(0).uniform(-0.5, 0.5, (12, 12))
    tops, wrists = frames(6, 1), frames(6, 2)

    # no image yet: the joint_states is refused as stale, nothing is commanded
    c.publish(obs[0])
    ros.spin_for(0.5)
    assert c.commands == []
    d = c.latest_diag()
    assert "stale: camera 'top'" in d["last_refusal"] and int(d["refused_inputs"]) == 1, d
    # nothing steps, inputs come and are refused: a WARN that says why (it said OK "stepping")
    assert d["_level"] == 1 and d["_message"].startswith("no step: inputs refused (stale: "), d

    def expect(state, top, wrist) -> np.ndarray:
        return eng.step(
            {
                "observation.state": state.astype(np.float32),
                "observation.images.top": top,
                "observation.images.wrist": wrist,
            }
        )

    got, want = [], []
    for k in range(4):  # fresh images each step: the command is the Engine's action
        cams.send("top", image_msg(tops[k], "rgb8"))
        cams.send("wrist", image_msg(wrists[k], "bgr8"))
        got.append(c.step(obs[k]))
        want.append(expect(obs[k], tops[k], wrists[k]))
    np.testing.assert_array_equal(np.array(got), np.array(want))

    # refused, counted, never stepped on: the next step uses the last valid images
    bad_top = [
        image_msg(tops[4][:-1], "rgb8"),  # one row short
        image_msg(tops[4], "rgb8", step=W * 3 - 1),  # step shorter than a row
        image_msg(tops[4], "rgb8", step=W * 3 + 4),  # step x height != data bytes
        image_msg(tops[4], "bgr8"),  # a served encoding, but not this camera's
        image_msg(tops[4], "yuv422"),  # an encoding not served
    ]
    for m in bad_top:
        cams.send("top", m)
    cams.send("wrist", image_msg(tops[4][:, :, 0], "mono8"))
    np.testing.assert_array_equal(c.step(obs[4]), expect(obs[4], tops[3], wrists[3]))

    # rows padded past width x 3 are valid ROS images: taken as they are
    padded = np.zeros((H, W * 3 + 8), np.uint8)
    padded[:, : W * 3] = tops[5].reshape(H, W * 3)
    cams.send("top", image_msg(tops[5], "rgb8", step=W * 3 + 8, data=padded.tobytes()))
    cams.send("wrist", image_msg(wrists[5], "bgr8"))
    np.testing.assert_array_equal(c.step(obs[5]), expect(obs[5], tops[5], wrists[5]))

    d = c.latest_diag(10.0)
    assert d["camera.top.received"] == "10" and d["camera.top.refused"] == "5", d
    assert d["camera.wrist.received"] == "6" and d["camera.wrist.refused"] == "1", d
    assert d["camera.top.encoding"] == "rgb8" and d["camera.wrist.encoding"] == "bgr8"
    assert d["camera.top.prestaged"] == "0", d  # on the CPU the step reads what it stages
    assert 0.0 <= float(d["camera.top.age_s"]) < 5.0, d
    # where the accepted images' way in went: waiting to be taken, and taken to handled
    assert 0.0 <= float(d["camera.top.wait_p50_us"]) < 5e6, d
    assert 0.0 < float(d["camera.wrist.handle_p50_us"]) < 5e6, d
    # handle's part that is not the prestage, within it (the same images): decode and checks
    for cam in ("top", "wrist"):
        assert (
            0.0 < float(d[f"camera.{cam}.decode_p50_us"]) <= float(d[f"camera.{cam}.handle_p50_us"])
        )
    assert 0.0 <= float(d["camera.prestage_lock_wait_p50_us"]) < 5e6, d  # tried, on the CPU too
    assert 0.0 < float(d["camera.ack_p50_us"]) < 5e6, d  # the acknowledgements' publish
    assert "camera.top.prestage_p50_us" not in d, d  # nothing prestaged on the CPU
    assert int(d["refused_inputs"]) == 1 + 6, d  # the stale trigger and the six bad images
    assert cams.seen == [10, 5, 6, 5]  # received, accepted per camera
    log = proc.log_tail(200)
    assert "refused input:" in log and log.count("refused input:") < 7  # warned, throttled
    assert "malloc: blocks up to 32 MiB from the heap" in proc.log_tail(10**6)  # node/memory.py

    # ~/rollout carries rows of floats, no images: refused, saying why and what to do instead
    r = c.call("rollout", n_steps=1, observations=[float(v) for v in obs[0]])
    assert not r.success and "vector observations only" in r.message, r.message
    assert "observation.images.top" in r.message and "Engine.rollout" in r.message, r.message
    assert len(r.actions) == 0

    # a camera whose every image is refused goes stale: the joint_states refused for it names
    # the images' own refusal, the cause (the log's throttled line named only the staleness)
    ros.spin_for(0.7)  # past obs_timeout_s (0.5) since the last valid top image
    n = len(c.commands)
    cams.send("top", image_msg(tops[5][:-1], "rgb8"))
    cams.send("wrist", image_msg(wrists[5], "bgr8"))
    c.publish(obs[6])
    d = c.wait_diag(lambda d: "stale: camera 'top'" in d["last_refusal"])
    assert "(its images are refused: camera 'top': " in d["last_refusal"], d
    assert f"{W}x{H - 1} pixels" in d["last_refusal"], d
    assert len(c.commands) == n


@pytest.mark.exclusive
def test_timer_trigger_holds_while_one_camera_is_stale(ros):
    proc = ros.start_node(
        {
            "policy": SPEC,
            "device": "cpu",
            "trigger": "timer",
            "rate_hz": 20.0,
            "obs_timeout_s": 0.3,
            "cameras": CAMERAS,
        }
    )
    c, cams = NodeClient(ros, proc), Cams(ros, proc)
    top, wrist = frames(1, 3)[0], frames(1, 4)[0]
    state = np.zeros(12)

    def stream(
        seconds: float, wrist_on: bool, bad_top: bool = False, until=None, top_on: bool = True
    ) -> dict:
        def publish() -> None:
            c.publish(state)
            if top_on:
                cams.send("top", image_msg(top, "rgb8"), acked=False)
            if bad_top:
                cams.send("top", image_msg(top, "mono8"), acked=False)
            if wrist_on:
                cams.send("wrist", image_msg(wrist, "bgr8"), acked=False)

        return stream_until(ros, c, seconds, publish, until)

    # never a wrist image: no command at all, and diagnostics says which stream is stale (the
    # first messages may still name joint_states or top: discovery can take that long on a
    # loaded machine, where top's first images came later than obs_timeout_s once)
    d = stream(
        5.0,
        wrist_on=False,
        until=lambda d: d["_message"].startswith("stale") and d["stale_stream"] == "camera wrist",
    )
    assert c.commands == []
    assert d["_message"] == "stale: no fresh camera wrist, holding", d
    assert d["stale_stream"] == "camera wrist" and int(d["camera.wrist.stale_steps"]) > 0, d
    assert d["camera.wrist.age_s"] == "none" and float(d["camera.top.age_s"]) < 1.0, d
    stream(1.0, wrist_on=True, bad_top=True)  # all fresh: commands; bad images refused
    assert len(c.commands) >= 5, len(c.commands)
    assert np.isfinite(c.commands[-1]).all()
    stream(0.6, wrist_on=False)  # the wrist camera stops: after obs_timeout_s, no commands
    held = settled_count(c, lambda s: stream(s, wrist_on=False))
    d = stream(5.0, wrist_on=False, until=lambda d: d["_message"].startswith("stale"))
    assert len(c.commands) == held
    assert d["stale_stream"] == "camera wrist" and float(d["camera.wrist.age_s"]) > 0.3, d
    assert int(d["camera.top.refused"]) >= 5 and "mono8" in d["camera.top.last_refusal"], d
    stream(0.6, wrist_on=True)  # it resumes: so do the commands
    assert len(c.commands) > held

    # both cameras stop: each counts the steps missed for it, not only the first one named
    keys = ("camera.top.stale_steps", "camera.wrist.stale_steps")
    d0 = stream(5.0, wrist_on=False, top_on=False, until=lambda d: d["_message"].startswith("st"))
    stream(
        5.0,
        wrist_on=False,
        top_on=False,
        until=lambda d: all(int(d[k]) >= int(d0[k]) + 5 for k in keys),
    )


def test_configure_fails_when_cameras_and_policy_images_differ(ros, tmp_path):
    """A camera policy without `cameras`, cameras the policy does not take, and cameras for a
    policy without images: each exits with status 2, naming both sets."""
    cases = [
        ({"policy": SPEC}, "cameras [] do not match the policy's image inputs ['top', 'wrist']"),
        (
            {"policy": SPEC, "cameras": ["top", "side"]},
            "cameras ['side', 'top'] do not match the policy's image inputs ['top', 'wrist']",
        ),
        ({"cameras": ["top"]}, "cameras ['top'] do not match the policy's image inputs []"),
    ]
    procs = [
        launch_node(
            {"device": "cpu", **p},
            log_dir=tmp_path,
            name=f"flashrt_{i}",
            env={**os.environ, "ROS_DOMAIN_ID": str(ros.domain_id)},
        )
        for i, (p, _) in enumerate(cases)
    ]
    try:
        for proc, (_, text) in zip(procs, cases, strict=True):
            assert proc.proc.wait(timeout=90) == 2, proc.log_tail()
            assert text in proc.log_tail(), proc.log_tail()
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.parametrize(
    "encoding,shape,step,frame",
    [
        ("rgb8", (H, W, 3), None, ""),
        ("mono8", (H, W), None, "wrist_link"),
        ("bgr8", (H, W, 3), W * 3 + 5, "x"),
    ],
)
def test_the_node_decodes_serialized_images_like_rclpy(encoding, shape, step, frame):
    """The camera subscriptions take serialized messages (cameras.py says why): decoding the
    CDR bytes rclpy serializes must give the same pixels and fields as rclpy's message."""
    from rclpy.serialization import serialize_message

    from flashrt_ros.node.cameras import decode_image
    from flashrt_ros.obs.images import image_array
    from flashrt_ros.runtime.inputs import immutable

    rng = np.random.default_rng(7)
    img = rng.integers(0, 256, shape, dtype=np.uint8)
    c = 1 if img.ndim == 2 else 3
    row = W * c
    data = None
    if step is not None:  # padded rows: row bytes then junk up to step
        padded = np.zeros((H, step), dtype=np.uint8)
        padded[:, :row] = img.reshape(H, row)
        data = padded.tobytes()
    msg = image_msg(img, encoding, step=step, data=data)
    msg.header.frame_id = frame
    msg.header.stamp.sec, msg.header.stamp.nanosec = 17, 123
    raw = serialize_message(msg)
    got = decode_image(raw)
    assert (got.height, got.width, got.encoding, got.step) == (H, W, encoding, msg.step)
    assert (got.header.frame_id, got.header.stamp.sec, got.header.stamp.nanosec) == (frame, 17, 123)
    a = image_array(got, (H, W, c), encoding)
    b = image_array(msg, (H, W, c), encoding)
    assert np.array_equal(a, b) and np.array_equal(a.reshape(img.shape), img)
    # a view over the received bytes, which never change: no copy of the image on the way in,
    # and the staging buffer may keep it (runtime/inputs.py immutable)
    assert np.shares_memory(a, np.frombuffer(raw, np.uint8)) and immutable(a)


def test_a_payload_that_is_not_an_image_is_refused():
    from rclpy.serialization import serialize_message

    from flashrt_ros.errors import BadRequest
    from flashrt_ros.node.cameras import decode_image

    good = serialize_message(image_msg(np.zeros((H, W, 3), np.uint8), "rgb8"))
    for bad in (good[: len(good) // 2], b"", b"\x00\x01\x00\x00" + b"\xff" * 64):
        with pytest.raises(BadRequest, match="not a sensor_msgs/Image"):
            decode_image(bad, "camera 'top'")


@pytest.mark.exclusive
def test_step_on_cameras_steps_once_per_frame_set_on_the_newest_joint_states(ros):
    """step_on: [top, wrist] paces the policy by its cameras: a step as soon as both cameras have
    a new valid image since the last step (no wait for a joint_states), on the newest joint
    state; joint_states alone never steps, and a stale one holds the robot."""
    proc = ros.start_node(
        {
            "policy": SPEC,
            "device": "cpu",
            "trigger": "observation",
            "cameras": CAMERAS,
            "step_on": ["top", "wrist"],
            "obs_timeout_s": 2.0,
        }
    )
    c, cams = NodeClient(ros, proc), Cams(ros, proc)
    eng = reference_engine()
    obs = np.random.default_rng(5).uniform(-0.5, 0.5, (4, 12))
    tops, wrists = frames(5, 6), frames(5, 7)

    def state(o) -> None:  # sampled, never a step: sent twice, as a stream would
        for _ in range(2):
            c.publish(o)
            ros.spin_for(0.1)

    def frame_set(k: int, first: str = "top") -> None:
        order = [("top", tops[k], "rgb8"), ("wrist", wrists[k], "bgr8")]
        for cam, img, enc in order if first == "top" else order[::-1]:
            cams.send(cam, image_msg(img, enc))

    def expect(o, k: int) -> np.ndarray:
        return eng.step(
            {
                "observation.state": o.astype(np.float32),
                "observation.images.top": tops[k],
                "observation.images.wrist": wrists[k],
            }
        )

    def command(n: int, timeout: float = 10.0) -> np.ndarray:
        """The one command that follows the `n` there were before the frame set's last image.
        Counted before it, not after: the node acknowledges the image, then steps, and a test
        process that falls behind (a loaded machine) may run the command's callback in the same
        spin as the acknowledgement's, before it (a fresh-clone run had steps=2 and the second
        command already in while this waited for one more)."""
        # a timeout says which: a step that never ran, or ran stale (the node's steps and
        # stale_ticks), or a command that never came
        assert ros.spin_until(lambda: len(c.commands) > n, timeout), (
            f"no command after {n} (commands: {len(c.commands)}); acknowledged {cams.seen}, "
            "the node's last diagnostics "
            f"{c.diagnostics[-1:]}\n{proc.log_tail()}"
        )
        ros.spin_for(0.2)
        assert len(c.commands) == n + 1, "one frame set, one step"
        return c.commands[-1]

    frame_set(0)  # no joint_states yet: held, not stepped
    ros.spin_for(0.3)
    assert c.commands == []
    state(obs[0])
    ros.spin_for(0.3)
    assert c.commands == []  # joint_states is not in step_on
    cams.send("top", image_msg(tops[1], "rgb8"))
    ros.spin_for(0.3)
    assert c.commands == []  # the wrist has nothing new yet
    n = len(c.commands)
    cams.send("wrist", image_msg(wrists[1], "bgr8"))
    np.testing.assert_array_equal(command(n), expect(obs[0], 1))

    state(obs[1])  # a newer joint state, then a frame set in the other order
    n = len(c.commands)
    frame_set(2, first="wrist")
    np.testing.assert_array_equal(command(n), expect(obs[1], 2))

    cams.send("wrist", image_msg(tops[3][:, :, 0], "mono8"))  # refused: not a new wrist frame
    cams.send("top", image_msg(tops[3], "rgb8"))
    ros.spin_for(0.3)
    assert len(c.commands) == 2
    state(obs[2])
    n = len(c.commands)
    cams.send("wrist", image_msg(wrists[3], "bgr8"))
    np.testing.assert_array_equal(command(n), expect(obs[2], 3))

    ros.spin_for(2.3)  # the joint_states goes stale: a frame set holds the robot
    d = c.latest_diag(10.0)
    assert not d["_message"].startswith("stale"), d  # the start-up's stale tick is long past
    stale_before, stale_s = int(d["stale_ticks"]), float(d["stale_s"])
    frame_set(4)
    d = stream_until(ros, c, 5.0, lambda: None, until=lambda d: d["_message"].startswith("stale"))
    assert len(c.commands) == 3
    assert d["_message"] == "stale: no fresh joint_states, holding", d
    assert int(d["stale_ticks"]) == stale_before + 1, d
    assert float(d["stale_s"]) >= stale_s + 2.0, d  # the time since the frame set before
    state(obs[3])  # fresh again: the next frame set steps
    n = len(c.commands)
    frame_set(4)
    np.testing.assert_array_equal(command(n), expect(obs[3], 4))
    assert "trigger observation on top + wrist" in proc.log_tail(200)

    # the wrist stops while joint_states and the top camera go on: no frame set completes, so
    # no tick and no stale tick; /diagnostics names the input it waits for (it said OK
    # "stepping" while the robot held)
    def top_and_state() -> None:
        cams.pub["top"].publish(image_msg(tops[1], "rgb8"))
        c.publish(obs[3])

    d = stream_until(
        ros, c, 8.0, top_and_state, until=lambda d: d["_message"].startswith("no step: waiting")
    )
    assert d["_level"] == 1 and "camera wrist (none valid for " in d["_message"], d
    assert d["stale_stream"] == "camera wrist", d
    assert len(c.commands) == 4


def test_a_best_effort_camera_in_observation_mode_is_named_not_silently_unheard(ros):
    """Observation mode subscribes reliably, so a camera driver that publishes BEST_EFFORT
    (sensor-data QoS) is never matched: /diagnostics names the publisher (WARN) and the log says
    what to change, once."""
    from rclpy.qos import qos_profile_sensor_data

    proc = ros.start_node(
        {"policy": SPEC, "device": "cpu", "trigger": "observation", "cameras": CAMERAS},
        namespace="qos",
    )
    c = NodeClient(ros, proc)
    d = c.wait_diag(lambda d: "qos_mismatch" in d, 5.0)
    assert d["qos_mismatch"] == "", d  # the test's own publishers are reliable: all heard
    pub = ros.node.create_publisher(
        Image, proc.topic("camera/top/image_raw"), qos_profile_sensor_data
    )
    d = c.wait_diag(lambda d: d["qos_mismatch"] != "", 10.0)
    assert "/qos/camera/top/image_raw" in d["qos_mismatch"], d
    assert "best_effort" in d["qos_mismatch"] and d["_message"].startswith("a publisher"), d
    # nothing steps (no joint_states came either): the unheard publisher first, then the wait
    assert "no step: waiting for joint_states (none valid yet)" in d["_message"], d
    c.wait_diag(lambda d: True, 10.0)  # one more status: the log line is still written once
    assert proc.log_tail(200).count("its messages never arrive") == 1
    ros.node.destroy_publisher(pub)
