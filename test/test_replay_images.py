"""flashrt-replay of a bag with camera images: lockstep through a real node over DDS, and offline.

The bag (MCAP) is written with the replay tools' own writer from the sim camera's renderer: two
cameras (`top` rgb8, `wrist` bgr8) at a third of the joint_states rate, one joint_states before
any image and one image of the wrong size among them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flashrt_ros.replay import bags
from flashrt_ros.replay.bagdiff_cli import main as bagdiff
from flashrt_ros.replay.replay_cli import main as replay
from flashrt_ros.sim.camera import ArmCamera
from flashrt_ros.srv import DumpFlight
from test.node_client import JOINTS, NodeClient
from test.ros_helpers import importable_tests
from test.test_node_cameras import CAMERAS, SPEC, H, W

N_JS = 24


def camera_node(ros_module, namespace: str = "", **params):
    """A node serving the two-camera test policy in observation mode, with `params` on top.
    A lockstep replay sends an image, then waits for a few steps before its next: with the
    default obs_timeout_s (0.5 s) a busy machine could let it go stale (the replay's docs: keep
    the timeout above the node's time per step), and these tests are about determinism."""
    base = {
        "policy": SPEC,
        "device": "cpu",
        "trigger": "observation",
        "cameras": CAMERAS,
        "obs_timeout_s": 60.0,
    }
    waits = ("list_capsules", "dump_flight") if "flight_ticks" in params else ("list_capsules",)
    with importable_tests():
        return ros_module.start_node(base | params, namespace=namespace, wait_services=waits)


@pytest.fixture(scope="module")
def node(ros_module):
    proc = camera_node(ros_module)
    client = NodeClient(ros_module, proc)
    assert client.call("checkpoint", name="origin", pin=True).success
    return client


def make_bag(path, blank: bool = False, width: int = W) -> None:
    """`width` other than W: every camera image is of the wrong size."""
    cam = ArmCamera(H, width, 6)
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
    argv = [str(blank), str(tmp_path / "offb"), *offline[2:], "--cameras", ",".join(CAMERAS)]
    assert replay(argv) == 0
    assert len(bags.read_commands(tmp_path / "offb")) == N_JS - 1
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


def test_a_replay_in_which_no_joint_states_gets_a_command_fails_and_writes_nothing(
    tmp_path, capsys
):
    """Every image refused (a driver update changed the size): no joint_states steps. The
    replay wrote an empty command bag with exit 0, and a diff of two such bags said
    "identical": a CI check that never stepped the policy passed."""
    bag = tmp_path / "narrow"
    make_bag(bag, width=W - 1)
    out = tmp_path / "out"
    argv = [str(bag), str(out), "--offline", "--policy", SPEC, "--cameras", "top,wrist:bgr8"]
    assert replay(argv) == 2
    err = capsys.readouterr().err
    assert "no joint_states of the bag got a command" in err and "image" in err, err
    assert not out.exists()


def test_offline_replay_refuses_cameras_that_are_not_the_policys(tmp_path, capsys):
    """--cameras names must be the policy's image inputs, as the node's configure checks: a
    list without the wrist, or with a camera the policy lacks, replayed with exit 0."""
    bag = tmp_path / "cams"
    make_bag(bag)
    args = [str(bag), str(tmp_path / "out"), "--offline", "--policy", SPEC]
    for cams in ("top", "top,wrist:bgr8,extra"):
        assert replay([*args, "--cameras", cams]) == 2, cams
        assert "are not the policy's cameras ['top', 'wrist']" in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


def test_a_node_stepping_on_frame_sets_is_refused_before_the_replay_changes_it(
    ros_module, tmp_path, capsys
):
    """With step_on naming a camera the node steps on each frame set, not on each
    joint_states: the lockstep pairing does not hold (the replay recorded wrong commands with
    exit 0, or timed out after resetting the node). Refused before anything is sent."""
    proc = camera_node(ros_module, "/frames", step_on=["top", "wrist"])
    c = NodeClient(ros_module, proc)
    before = c.call("checkpoint", name="before")
    assert before.success, before.message
    bag = tmp_path / "cams"
    make_bag(bag)
    assert replay([str(bag), str(tmp_path / "out"), "--node", "/frames/flashrt"]) == 2
    assert "replay needs step_on: [joint_states]" in capsys.readouterr().err
    after = c.call("list_capsules")
    assert [x.name for x in after.capsules] == ["before"]  # nothing reset, stepped or saved
    assert int(c.latest_diag()["steps"]) == 0


def _pass_again(cmds: list, at: int, back: int) -> tuple[list, list]:
    """The first pass over commands at..back and the pass after the restore, as byte strings."""
    first = [v.tobytes() for _, v in cmds[at:back]]
    again = [v.tobytes() for _, v in cmds[back : back + (back - at)]]
    return first, again


def test_restore_in_an_image_replay_steps_on_the_checkpoints_images(node, tmp_path, capsys):
    """Images are not state: after --restore-at the replay hands the node (and the offline
    engine) the images it held at the checkpoint again, so the pass after the restore gives
    the first pass's commands bit for bit, across new frames and the refused wrist frame."""
    bag = tmp_path / "cams"
    make_bag(bag)
    at, back = 4, 12  # commands 4..11 hold three image changes and the refused frame
    cp = ["--checkpoint-at", str(at), "--restore-at", str(back)]
    assert node.call("restore", capsule="origin").success
    assert replay([str(bag), str(tmp_path / "node"), *cp]) == 0
    cmds = bags.read_commands(tmp_path / "node")
    assert len(cmds) == N_JS - 1 + (back - at)
    first, again = _pass_again(cmds, at, back)
    assert first == again

    offline = ["--offline", "--policy", SPEC, "--cameras", ",".join(CAMERAS)]
    assert replay([str(bag), str(tmp_path / "off"), *offline, *cp]) == 0
    assert bagdiff([str(tmp_path / "node"), str(tmp_path / "off")]) == 0
    capsys.readouterr()

    # the first joint_states precedes every image: N_JS - 1 commands, so a restore after
    # N_JS - 1 is refused before anything is sent (it reset and stepped the node, then failed)
    steps = int(node.latest_diag()["steps"])
    beyond = ["--checkpoint-at", "1", "--restore-at", str(N_JS - 1)]
    for how in ([], offline):
        assert replay([str(bag), str(tmp_path / f"beyond{len(how)}"), *how, *beyond]) == 2
        assert f"has {N_JS - 1} valid observations" in capsys.readouterr().err
    assert int(node.latest_diag()["steps"]) == steps


def test_a_flight_dump_of_an_image_replay_replays_from_its_tick(ros_module, tmp_path, capsys):
    """A node with cameras replays the bag (the replay sends each joint_states with the bag's
    header stamp, which the flight recorder keeps), dumps its flight ring, and
    `--offline --from-capsule` from a tick between two frames gives the node's own commands
    from that tick on: the images before the tick are played first, as the node held them."""
    capdir = tmp_path / "capsules"
    capdir.mkdir()
    proc = camera_node(ros_module, "/fl", flight_ticks=64, capsule_dir=str(capdir))
    bag = tmp_path / "cams"
    make_bag(bag)
    assert replay([str(bag), str(tmp_path / "node"), "--node", "/fl/flashrt"]) == 0
    cmds = bags.read_commands(tmp_path / "node")
    assert len(cmds) == N_JS - 1

    r = ros_module.call(
        ros_module.client(DumpFlight, proc.service("dump_flight")), DumpFlight.Request(), 30
    )
    assert r.success, r.message
    tick = 8  # after the frames of joint_states 7, before those of 10
    dumped = next(Path(f) for f in r.files if Path(f).name == f"main-{tick}.fcap")
    capsys.readouterr()
    offline = ["--offline", "--policy", SPEC, "--cameras", ",".join(CAMERAS)]
    args = [str(bag), str(tmp_path / "from"), *offline, "--from-capsule", str(dumped)]
    assert replay(args) == 0
    got = bags.read_commands(tmp_path / "from")
    assert [v.tobytes() for _, v in got] == [v.tobytes() for _, v in cmds[tick:]]
