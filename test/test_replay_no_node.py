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
