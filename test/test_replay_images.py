"""flashrt-replay of a bag with camera images: lockstep through a real node over DDS, and offline.

The bag (MCAP) is written with the replay tools' own writer from the sim camera's renderer: two
cameras (`top` rgb8, `wrist` bgr8) at a third of the joint_states rate, one joint_states before
any image and one image of the wrong size among them.
"""

from __future__ import annotations

import numpy as np
import pytest

from flashrt_ros.replay import bags
from flashrt_ros.replay.bagdiff_cli import main as bagdiff
from flashrt_ros.replay.replay_cli import main as replay
from flashrt_ros.sim.camera import ArmCamera
from test.node_client import JOINTS, NodeClient
from test.ros_helpers import importable_tests
from test.test_node_cameras import CAMERAS, SPEC, H, W

N_JS = 24


@pytest.fixture(scope="module")
def node(ros_module):
    with importable_tests():
        proc = ros_module.start_node(
            {"policy": SPEC, "device": "cpu", "trigger": "observation", "cameras": CAMERAS}
        )
    client = NodeClient(ros_module, proc)
    assert client.call("checkpoint", name="origin", pin=True).success
    return client


def make_bag(path, blank: bool = False) -> None:
    cam = ArmCamera(H, W, 6)
    t = np.arange(N_JS) * 0.05
    q = 0.4 * np.sin(t[:, None] + np.arange(6)[None] * 0.5)
    dq = 0.4 * np.cos(t[:, None] + np.arange(6)[None] * 0.5)
    goal = np.full(6, 0.3)
    ev: list[bags.InputEvent] = []
    ns = 1_000_000_000

    def image(stamp: int, name: str, img: np.ndarray, enc: str) -> bags.InputEvent:
        h, w, c = img.shape
        frame = bags.ImageFrame(h, w, enc, w * c, img.reshape(-1).copy())
        return bags.InputEvent("image", stamp, camera=name, image=frame)

    for k in range(N_JS):
        stamp = ns + k * 10_000_000
        if k % 3 == 1:  # images first, then the joint_states that steps on them
            top = cam.render(q[k], goal) * (not blank)
            ev.append(image(stamp - 2000, "top", top, "rgb8"))
            ev.append(
                image(stamp - 1000, "wrist", np.ascontiguousarray(top[::-1, :, ::-1]), "bgr8")
            )
        if k == 10:  # refused by the node and offline alike; the wrist keeps its last image
            ev.append(image(stamp - 500, "wrist", np.zeros((H, W - 1, 3), np.uint8), "bgr8"))
        ev.append(
            bags.InputEvent("joint_states", stamp, names=JOINTS, position=q[k], velocity=dq[k])
        )
    bags.write_inputs(path, ev, storage="mcap")


def test_image_bag_replays_deterministically_through_the_node_and_offline(node, tmp_path, capsys):
    bag = tmp_path / "cams"
    make_bag(bag)
    back = bags.read_inputs(bag, camera_prefix="/camera")
    assert sum(e.kind == "image" for e in back) == 2 * 8 + 1
    assert bags.read_inputs(bag) == [e for e in back if e.kind != "image"]  # opt-in

    assert replay([str(bag), str(tmp_path / "one")]) == 0
    out = capsys.readouterr()
    assert f": {N_JS - 1} commands" in out.out, out  # the first joint_states precedes the images
    assert "2 samples skipped" in out.out and "17 images of cameras top, wrist" in out.err, out
    one = bags.read_commands(tmp_path / "one")
    assert len(one) == N_JS - 1 and all(np.isfinite(v).all() for _, v in one)

    assert node.call("restore", capsule="origin").success
    assert replay([str(bag), str(tmp_path / "two")]) == 0
    assert bagdiff([str(tmp_path / "one"), str(tmp_path / "two")]) == 0  # twice: identical
    assert "identical" in capsys.readouterr().out

    offline = [str(bag), str(tmp_path / "off"), "--offline", "--policy", SPEC]
    assert replay([*offline, "--cameras", ",".join(CAMERAS)]) == 0
    assert bagdiff([str(tmp_path / "one"), str(tmp_path / "off")]) == 0  # equals --offline
    capsys.readouterr()

    d = node.wait_diag(lambda d: d["steps"] == str(2 * (N_JS - 1)), 5.0)  # both replays
    assert d["camera.wrist.refused"] == "2" and "31x24" in d["camera.wrist.last_refusal"], d

    # the images matter: the same joint_states with blank pictures give other commands
    blank = tmp_path / "blank"
    make_bag(blank, blank=True)
    assert replay([str(blank), str(tmp_path / "offb"), *offline[2:]]) == 0
    assert bagdiff([str(tmp_path / "off"), str(tmp_path / "offb")]) == 1


def test_offline_replay_refuses_compressed_cameras(tmp_path, capsys):
    """A bag holds raw sensor_msgs/Image frames: --cameras NAME:compressed is refused with the
    reason, and nothing is written."""
    bag = tmp_path / "cams"
    make_bag(bag)
    args = [str(bag), str(tmp_path / "out"), "--offline", "--policy", SPEC]
    assert replay([*args, "--cameras", "top:compressed,wrist:bgr8"]) != 0
    assert "compressed cameras are not replayed offline" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
