"""flashrt-replay when no usable node answers (a module of its own: its own DDS domains)."""

from __future__ import annotations

from pathlib import Path

from flashrt_ros.replay.replay_cli import main as replay

FIX = Path(__file__).parent / "fixtures"


def test_replay_without_a_node_says_so(ros, tmp_path, capsys):
    rc = replay([str(FIX / "arm_sqlite3"), str(tmp_path / "o"), "--timeout", "1"])
    assert rc == 2
    assert "no flashrt node answering" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_replay_refuses_a_timer_mode_node(ros, tmp_path, capsys):
    ros.start_node({"trigger": "timer"})
    assert replay([str(FIX / "arm_sqlite3"), str(tmp_path / "o"), "--timeout", "5"]) == 2
    assert "trigger:=observation" in capsys.readouterr().err


def test_replay_refuses_a_node_that_publishes_no_commands(ros, tmp_path, capsys):
    """output:=joint_trajectory: no commands publisher ever comes. The replay waited its whole
    --timeout and blamed the connection ("commands publisher: no answer")."""
    ros.start_node({"trigger": "observation", "output": "joint_trajectory"})
    assert replay([str(FIX / "arm_sqlite3"), str(tmp_path / "o"), "--timeout", "30"]) == 2
    err = capsys.readouterr().err
    assert "output:=joint_trajectory" in err and "output:=commands or output:=both" in err, err
    assert not (tmp_path / "o").exists()


def test_replay_refuses_a_rate_that_is_not_a_number(tmp_path, capsys):
    # 1e-300 slept past time_t (a traceback), 1e-9 would wait for decades
    for rate in ("nan", "inf", "-1", "1e-300", "1e-9"):
        try:
            rc = replay([str(FIX / "arm_sqlite3"), str(tmp_path / "o"), "--rate", rate])
        except SystemExit as e:  # argparse's error
            rc = e.code
        assert rc == 2, rate
        assert "--rate must be 0 (as fast as the node answers) or a finite number >= 0.001" in (
            capsys.readouterr().err
        )
