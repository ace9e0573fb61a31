"""flashrt-replay and flashrt-bagdiff against a real node over DDS, and offline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from flashrt_ros.replay import bags
from flashrt_ros.replay.bagdiff_cli import main as bagdiff
from flashrt_ros.replay.replay_cli import main as replay
from test.node_client import NodeClient

FIX = Path(__file__).parent / "fixtures"
GOLDEN = FIX / "golden"
META = json.loads((FIX / "fixtures.json").read_text())


@pytest.fixture(scope="module")
def node(ros_module):
    proc = ros_module.start_node({"trigger": "observation"})
    client = NodeClient(ros_module, proc)
    r = client.call("checkpoint", name="origin", pin=True)
    assert r.success, r.message
    return client


@pytest.fixture()
def fresh(node):
    """Replays start from the node's initial state (its step-0 capsule)."""
    assert node.call("restore", capsule="origin").success
    return node


def cmds(path) -> np.ndarray:
    return np.array([v for _, v in bags.read_commands(path)])


@pytest.mark.parametrize("name", ["arm_sqlite3", "arm_mcap"])
def test_replay_reproduces_golden_bag_and_twice_gives_identical_bags(fresh, tmp_path, name, capsys):
    out1, out2 = tmp_path / "one", tmp_path / "two"
    assert replay([str(FIX / name), str(out1)]) == 0
    assert bags.detect_storage(out1) == bags.detect_storage(FIX / name)
    assert bagdiff([str(out1), str(GOLDEN / f"{name}_commands")]) == 0
    assert "identical: 300 commands" in capsys.readouterr().out
    assert fresh.call("restore", capsule="origin").success
    assert replay([str(FIX / name), str(out2)]) == 0
    assert bagdiff([str(out1), str(out2)]) == 0
    assert [s for s, _ in bags.read_commands(out1)] == [s for s, _ in bags.read_commands(out2)]


def test_offline_replay_equals_node_replay(fresh, tmp_path):
    assert replay([str(FIX / "arm_sqlite3"), str(tmp_path / "node")]) == 0
    assert replay([str(FIX / "arm_sqlite3"), str(tmp_path / "offline"), "--offline"]) == 0
    assert bagdiff([str(tmp_path / "node"), str(tmp_path / "offline")]) == 0


def test_checkpoint_restore_continues_exactly_as_the_first_pass(fresh, tmp_path):
    out = tmp_path / "cr"
    assert (
        replay([str(FIX / "arm_mcap"), str(out), "--checkpoint-at", "100", "--restore-at", "180"])
        == 0
    )
    got = cmds(out)
    golden = cmds(GOLDEN / "arm_mcap_commands")
    assert len(got) == 180 + 200
    assert np.array_equal(got[:180], golden[:180])
    assert np.array_equal(got[180:260], got[100:180])  # after the restore: the first pass again
    assert np.array_equal(got[180:], golden[100:])
    stamps = [s for s, _ in bags.read_commands(out)]
    assert stamps == sorted(stamps)  # the rewound pass is stamped after the first


@pytest.mark.parametrize("name", ["messy_sqlite3", "messy_mcap"])
def test_messy_bags_skip_bad_samples_and_step_each_valid_one(fresh, tmp_path, name, capsys):
    out = tmp_path / "messy"
    before = int(fresh.latest_diag()["refused_inputs"])
    assert replay([str(FIX / name), str(out)]) == 0
    text = capsys.readouterr()
    n_bad = len(META["messy"]["bad_samples"])
    n_valid = META["messy"]["joint_states"] - n_bad
    assert f"{n_valid} commands" in text.out and f"{n_bad} samples skipped" in text.out
    assert len(cmds(out)) == n_valid
    assert bagdiff([str(out), str(GOLDEN / f"{name}_commands")]) == 0
    fresh.ros.spin_until(lambda: int(fresh.diagnostics[-1]["refused_inputs"]) >= before + n_bad, 5)
    assert int(fresh.diagnostics[-1]["refused_inputs"]) >= before + n_bad  # the node refused them


def test_replay_errors_are_clear(tmp_path, capsys):
    cases = [
        ([str(tmp_path / "missing"), str(tmp_path / "o1")], "missing"),
        ([str(FIX / "fixtures.json"), str(tmp_path / "o2")], "bag"),
        (
            [str(FIX / "arm_sqlite3"), str(tmp_path / "o3"), "--joint-states-topic", "/nope"],
            "/nope",
        ),
        ([str(FIX / "arm_sqlite3"), str(FIX / "arm_mcap")], "exists"),
        (
            [str(FIX / "arm_sqlite3"), str(tmp_path / "o4"), "--checkpoint-at", "5", "--offline"],
            "go together",
        ),
        (
            [
                str(FIX / "arm_sqlite3"),
                str(tmp_path / "o5"),
                "--checkpoint-at",
                "5",
                "--restore-at",
                "900",
                "--offline",
            ],
            "only 300",
        ),
    ]
    for argv, needle in cases:
        assert replay(argv) == 2, argv
        assert needle in capsys.readouterr().err, argv
        assert not Path(argv[1]).exists() or argv[1].endswith("arm_mcap")
