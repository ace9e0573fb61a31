"""rosbag2 read/write (sqlite3 and MCAP), fixtures and flashrt-bagdiff. No ROS needed."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from flashrt_ros.replay.bagdiff_cli import main as bagdiff
from flashrt_ros.replay.bags import (
    InputEvent,
    detect_storage,
    list_topics,
    read_commands,
    read_inputs,
    write_commands,
    write_inputs,
)

ROOT = Path(__file__).resolve().parents[1]
STORAGES = ["sqlite3", "mcap"]


def _load_make_fixtures():
    spec = importlib.util.spec_from_file_location(
        "make_fixtures", ROOT / "tools" / "make_fixtures.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def fixtures_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixtures")
    assert _load_make_fixtures().main([str(out)]) == 0
    return out


def _js(stamp, pos, names=None, vel=None):
    pos = np.asarray(pos, dtype=np.float64)
    names = names or [f"joint{i + 1}" for i in range(len(pos))]
    vel = np.zeros(len(pos)) if vel is None else np.asarray(vel, dtype=np.float64)
    return InputEvent(
        "joint_states", stamp, names=list(names), position=pos, velocity=vel, header_ns=stamp
    )


def _cmds(n=20, seed=0, width=6):
    rng = np.random.default_rng(seed)
    return [(1_000_000_000 + 10_000_000 * i, rng.normal(size=width)) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("storage", STORAGES)
def test_inputs_round_trip(tmp_path, storage):
    events = [
        _js(100, [0.1, 0.2, 0.3], vel=[1.0, 2.0, 3.0]),
        InputEvent("goal", 105, data=np.array([1.0, -1.0, 0.5])),
        _js(200, [np.nan, 0.0, np.inf], names=["b", "a", "c"]),
        _js(300, [0.5], names=["x", "y"], vel=[]),  # short arrays survive as written
        InputEvent("joint_states", 400, ["a"], np.ones(1), effort=np.full(1, 2.5), header_ns=400),
    ]
    path = tmp_path / "in"
    write_inputs(path, events, storage)
    assert detect_storage(path) == storage
    back = read_inputs(path)
    assert back == events
    assert back[2].names == ["b", "a", "c"] and np.isnan(back[2].position[0])
    assert back[3].velocity.shape == (0,)
    assert back[4].effort.tolist() == [2.5]  # state_fields may take efforts
    assert list_topics(path) == {
        "/joint_states": "sensor_msgs/msg/JointState",
        "/goal": "std_msgs/msg/Float64MultiArray",
    }


@pytest.mark.parametrize("storage", STORAGES)
def test_commands_round_trip(tmp_path, storage):
    cmds = _cmds()
    cmds.append((2**62, np.array([np.nan, -0.0, 1e-300])))
    path = tmp_path / "cmd"
    write_commands(path, cmds, storage=storage)
    assert detect_storage(path) == storage
    back = read_commands(path)
    assert len(back) == len(cmds)
    for (s1, v1), (s2, v2) in zip(cmds, back, strict=True):
        assert s1 == s2 and v2.dtype == np.float64 and v1.tobytes() == v2.tobytes()


def test_custom_topics_and_slashes(tmp_path):
    write_commands(tmp_path / "c", _cmds(3), topic="robot/commands")
    assert len(read_commands(tmp_path / "c", topic="/robot/commands")) == 3
    assert len(read_commands(tmp_path / "c", topic="robot/commands")) == 3
    write_inputs(tmp_path / "i", [_js(1, [0.0])], "mcap", joint_states_topic="/arm/joint_states")
    assert len(read_inputs(tmp_path / "i", joint_states_topic="arm/joint_states")) == 1


def test_bare_storage_files(tmp_path):
    write_commands(tmp_path / "s", _cmds(4), storage="sqlite3")
    write_commands(tmp_path / "m", _cmds(4), storage="mcap")
    db3 = next((tmp_path / "s").glob("*.db3"))
    mcap = next((tmp_path / "m").glob("*.mcap"))
    assert detect_storage(db3) == "sqlite3" and detect_storage(mcap) == "mcap"
    assert [s for s, _ in read_commands(db3)] == [s for s, _ in read_commands(mcap)]


# ---------------------------------------------------------------------------------------------
# ordering


@pytest.mark.parametrize("storage", STORAGES)
def test_read_inputs_orders_by_time_ties_in_bag_order(tmp_path, storage):
    # written out of time order; ties between topics and within one topic
    events = [
        _js(300, [3.0]),
        InputEvent("goal", 100, data=np.array([1.0])),
        _js(100, [1.0]),
        InputEvent("goal", 100, data=np.array([2.0])),
        _js(100, [1.5]),
        _js(50, [0.5]),
        InputEvent("goal", 300, data=np.array([3.0])),
    ]
    path = tmp_path / "ord"
    write_inputs(path, events, storage)
    back = read_inputs(path)
    expected = sorted(events, key=lambda e: e.stamp_ns)  # stable: ties keep write order
    assert back == expected
    assert [(e.kind, e.stamp_ns) for e in back] == [
        ("joint_states", 50),
        ("goal", 100),
        ("joint_states", 100),
        ("goal", 100),
        ("joint_states", 100),
        ("joint_states", 300),
        ("goal", 300),
    ]


@pytest.mark.parametrize("storage", STORAGES)
def test_many_ties_keep_bag_order(tmp_path, storage):
    rng = np.random.default_rng(5)
    events = []
    for i in range(600):
        stamp = 1000 + i // 9
        if rng.random() < 0.5:
            events.append(InputEvent("goal", stamp, data=np.array([float(i)])))
        else:
            events.append(_js(stamp, [float(i)]))
    write_inputs(tmp_path / "ties", events, storage)
    assert read_inputs(tmp_path / "ties") == events


def test_missing_joint_states_topic_lists_topics(tmp_path):
    write_commands(tmp_path / "c", _cmds(2))
    with pytest.raises(ValueError, match=r"joint_states.*/commands"):
        read_inputs(tmp_path / "c")
    with pytest.raises(ValueError, match="/commands"):
        read_commands(tmp_path / "c", topic="/other")


def test_wrong_topic_type(tmp_path):
    write_commands(tmp_path / "c", _cmds(2), topic="/joint_states")
    with pytest.raises(ValueError, match="Float64MultiArray"):
        read_inputs(tmp_path / "c")


# ---------------------------------------------------------------------------------------------
# errors


def test_detect_storage_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        detect_storage(tmp_path / "nope")
    junk = tmp_path / "junk.db3"
    junk.write_bytes(b"this is not sqlite" * 10)
    with pytest.raises(ValueError, match="not a rosbag2 bag"):
        detect_storage(junk)
    rnd = tmp_path / "random.bin"
    rnd.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="not a rosbag2 bag"):
        detect_storage(rnd)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "something.txt").write_text("hi")
    with pytest.raises(ValueError, match="metadata.yaml"):
        detect_storage(d)
    bad_meta = tmp_path / "badmeta"
    bad_meta.mkdir()
    (bad_meta / "metadata.yaml").write_text("foo: [1, 2\n")
    with pytest.raises(ValueError, match="not a rosbag2 bag"):
        detect_storage(bad_meta)
    for fn in (read_inputs, read_commands):
        with pytest.raises(ValueError):
            fn(tmp_path / "nope")
        with pytest.raises(ValueError):
            fn(d)


def test_write_refuses_overwrite(tmp_path):
    path = tmp_path / "bag"
    write_commands(path, _cmds(2))
    with pytest.raises(ValueError, match="exists"):
        write_commands(path, _cmds(2))
    with pytest.raises(ValueError, match="exists"):
        write_inputs(path, [_js(1, [0.0])], "mcap")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists"):
        write_commands(tmp_path / "file", _cmds(2))
    assert (tmp_path / "file").read_text() == "x"
    assert len(read_commands(path)) == 2


def test_write_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="storage"):
        write_commands(tmp_path / "a", _cmds(2), storage="rosbag1")
    with pytest.raises(ValueError, match="nanoseconds"):
        write_commands(tmp_path / "b", [(1.5, np.zeros(6))])
    with pytest.raises(ValueError):
        write_commands(tmp_path / "c", [(-1, np.zeros(6))])
    assert not any((tmp_path / n).exists() for n in "abc")


# ---------------------------------------------------------------------------------------------
# fixtures


def test_fixture_bags(fixtures_dir):
    info = json.loads((fixtures_dir / "fixtures.json").read_text())
    a = read_inputs(fixtures_dir / "arm_sqlite3")
    b = read_inputs(fixtures_dir / "arm_mcap")
    assert a == b
    js = [e for e in a if e.kind == "joint_states"]
    goals = [e for e in a if e.kind == "goal"]
    assert len(js) == info["arm"]["joint_states"] == 300 and len(goals) == info["arm"]["goals"] == 3
    assert np.all(np.diff([e.stamp_ns for e in js]) == 10_000_000)
    assert all(e.names == [f"joint{i}" for i in range(1, 7)] for e in js)
    assert all(np.all(np.isfinite(e.position)) and e.velocity.shape == (6,) for e in js)
    tie = [i for i, e in enumerate(a) if e.stamp_ns == info["arm"]["goal_stamps_ns"][1]]
    assert [a[i].kind for i in tie] == ["joint_states", "goal"]
    for p in fixtures_dir.iterdir():
        if p.is_dir():
            assert sum(f.stat().st_size for f in p.iterdir()) < 200_000

    m = read_inputs(fixtures_dir / "messy_sqlite3")
    assert m == read_inputs(fixtures_dir / "messy_mcap")
    mjs = [e for e in m if e.kind == "joint_states"]
    assert len(mjs) == info["messy"]["joint_states"]
    assert len({tuple(e.names) for e in mjs}) > 10  # shuffled
    bad = {int(k) for k in info["messy"]["bad_samples"]}

    def valid(e):
        if not all(n in e.names for n in info["messy"]["joint_names"]):
            return False
        if len(e.position) != len(e.names) or len(e.velocity) != len(e.names):
            return False
        return bool(np.all(np.isfinite(e.position)) and np.all(np.isfinite(e.velocity)))

    assert {i for i, e in enumerate(mjs) if not valid(e)} == bad
    stamps = [e.stamp_ns for e in mjs]
    assert len(set(np.diff(stamps))) > 5 and 0 in np.diff(stamps)


def test_fixtures_deterministic(fixtures_dir, tmp_path):
    assert _load_make_fixtures().main([str(tmp_path)]) == 0
    for name in ("arm_sqlite3", "arm_mcap", "messy_sqlite3", "messy_mcap"):
        assert read_inputs(tmp_path / name) == read_inputs(fixtures_dir / name)
    assert (tmp_path / "fixtures.json").read_text() == (fixtures_dir / "fixtures.json").read_text()
    assert _load_make_fixtures().main([str(tmp_path)]) == 2  # refuses to replace without --force


def test_committed_fixtures_match_generator(fixtures_dir):
    committed = ROOT / "test" / "fixtures"
    if not (committed / "fixtures.json").exists():
        pytest.skip("no committed fixtures")
    for name in ("arm_sqlite3", "arm_mcap", "messy_sqlite3", "messy_mcap"):
        assert read_inputs(committed / name) == read_inputs(fixtures_dir / name)


# ---------------------------------------------------------------------------------------------
# flashrt-bagdiff


@pytest.mark.parametrize("sa,sb", [("sqlite3", "sqlite3"), ("sqlite3", "mcap"), ("mcap", "mcap")])
def test_bagdiff_identical(tmp_path, capsys, sa, sb):
    cmds = _cmds(30)
    write_commands(tmp_path / "a", cmds, storage=sa)
    # receive stamps differ between two runs: they are not compared
    write_commands(tmp_path / "b", [(s + 12345, v) for s, v in cmds], storage=sb)
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert out.strip() == "identical: 30 commands"


def test_bagdiff_within_atol(tmp_path, capsys):
    cmds = _cmds(10)
    other = [(s, v.copy()) for s, v in cmds]
    other[4][1][2] += 1e-9
    write_commands(tmp_path / "a", cmds)
    write_commands(tmp_path / "b", other, storage="mcap")
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "b"), "--atol", "1e-6"]) == 0
    assert "equal within atol" in capsys.readouterr().out
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "command 4" in out and "joint 2" in out


def test_bagdiff_first_divergence(tmp_path, capsys):
    cmds = _cmds(10)
    other = [(s + 7, v.copy()) for s, v in cmds]
    other[6][1][1] = 0.25
    other[8][1][0] = 9.0  # a later divergence is not the one reported
    write_commands(tmp_path / "a", cmds)
    write_commands(tmp_path / "b", other)
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    a_val = cmds[6][1][1]
    assert "divergence at command 6" in out
    assert str(cmds[6][0]) in out and str(other[6][0]) in out
    assert "joint 1" in out and repr(float(a_val)) in out and "0.25" in out
    assert repr(0.25 - float(a_val)) in out
    assert "command 8" not in out


def test_bagdiff_nan_handling(tmp_path, capsys):
    cmds = [(1, np.array([np.nan, 1.0])), (2, np.array([0.0, 1.0]))]
    write_commands(tmp_path / "a", cmds)
    write_commands(tmp_path / "b", cmds)
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    write_commands(tmp_path / "c", [(1, np.array([0.0, 1.0])), (2, np.array([0.0, 1.0]))])
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "c"), "--atol", "10"]) == 1
    assert "joint 0" in capsys.readouterr().out


def test_bagdiff_length_mismatch(tmp_path, capsys):
    cmds = _cmds(10)
    write_commands(tmp_path / "a", cmds)
    write_commands(tmp_path / "b", cmds[:7])
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "A has 10 commands, B has 7" in out and "command 7" in out
    write_commands(tmp_path / "c", [(s, v[:5]) for s, v in cmds])
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    assert "A has 6 values, B has 5" in capsys.readouterr().out


def test_bagdiff_errors(tmp_path, capsys):
    write_commands(tmp_path / "a", _cmds(3))
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "foreign").mkdir()
    assert bagdiff([str(tmp_path / "foreign"), str(tmp_path / "a")]) == 2
    assert "not a rosbag2 bag" in capsys.readouterr().err
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "a"), "--topic", "/nope"]) == 2
    err = capsys.readouterr().err
    assert "/nope" in err and "/commands" in err
    write_inputs(tmp_path / "in", [_js(1, [0.0])])
    assert bagdiff([str(tmp_path / "in"), str(tmp_path / "a")]) == 2
    capsys.readouterr()
    # two recordings without a command are not "identical": a replay that caught nothing fails
    write_commands(tmp_path / "empty1", [], storage="mcap")
    write_commands(tmp_path / "empty2", [])
    assert bagdiff([str(tmp_path / "empty1"), str(tmp_path / "empty2")]) == 2
    out, err = capsys.readouterr()
    assert "identical" not in out and "neither bag has a command on /commands" in err
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "empty2")]) == 1  # one empty: diverges
    assert "A has 3 commands, B has 0" in capsys.readouterr().out
    assert bagdiff([str(tmp_path / "a"), str(tmp_path / "a"), "--atol", "-1"]) == 2
    with pytest.raises(SystemExit) as exc:
        bagdiff(["--help"])
    assert exc.value.code == 0
    assert "exit status" in capsys.readouterr().out


def _damaged_copies(src: Path, out: Path, trials: int) -> list[Path]:
    """Copies of a bag file with bytes flipped past its header and before its footer: what a
    bad disk or a cut copy leaves (the chunks, pages and indexes the reader walks)."""
    import random

    data = src.read_bytes()
    copies = []
    for trial in range(trials):
        rnd = random.Random(trial)
        d = bytearray(data)
        for _ in range(rnd.choice([1, 4, 32])):
            d[rnd.randrange(64, len(d) - 200)] = rnd.randrange(256)
        p = out / f"{trial}{src.suffix}"
        p.write_bytes(d)
        copies.append(p)
    return copies


@pytest.mark.parametrize(
    "bag", ["arm_mcap/arm_mcap.mcap", "arm_sqlite3/arm_sqlite3.db3", "golden/arm_mcap_commands"]
)
def test_a_damaged_bag_is_a_clear_error_never_a_crash(tmp_path, capsys, bag):
    """rosbags raises struct.error, OverflowError, MemoryError or sqlite's CorruptError on
    damaged chunks and pages: each must come out as the ValueError the CLIs report (exit 2),
    not a traceback that flashrt-bagdiff's exit status would call a divergence (1)."""
    src = ROOT / "test" / "fixtures" / bag
    if src.is_dir():
        src = next(src.glob("*.mcap"))
    refused = 0
    for p in _damaged_copies(src, tmp_path, 150):
        for read in (read_inputs, read_commands):
            try:
                read(p)
            except ValueError as e:
                assert str(p) in str(e)
                refused += 1
    assert refused > 100  # most damage is found, not read as data
    if "commands" in bag:  # and through the CLI: a damaged bag is bad input (2), not a diff (1)
        good = str(src)
        codes = {bagdiff([str(p), good]) for p in _damaged_copies(src, tmp_path, 150)}
        capsys.readouterr()
        assert codes <= {0, 1, 2} and 2 in codes
