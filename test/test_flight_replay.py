"""A tick of a live run, reproduced offline from the node's flight dump, bit for bit.

The sim arm and the node (observation trigger, flight recorder on) run closed loop over DDS;
this process records joint_states, the goal and the node's commands into a rosbag2 bag with the
replay tools' writer. After ~/dump_flight, `flashrt-replay --offline --from-capsule` starts from
the dumped tick 1234 and replays the bag's messages after that tick's stamp: its commands must
equal the ones the node sent from that tick on, exactly (same machine).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray

from flashrt_ros import Engine, load_policy
from flashrt_ros.capsules import diskfmt
from flashrt_ros.replay import bags
from flashrt_ros.replay.bagdiff_cli import main as bagdiff
from flashrt_ros.replay.bags import InputEvent
from flashrt_ros.replay.player import events_after
from flashrt_ros.replay.replay_cli import main as replay
from flashrt_ros.srv import DumpFlight
from test.engine_util import rate_with_room
from test.ros_helpers import INSTALL_PREFIX, launch_node

SIM = INSTALL_PREFIX / "lib" / "flashrt_ros" / "flashrt_sim_arm"
TICK = 1234
RING = 320  # holds tick 1234 when the run stops within RING ticks after it
# commands seen here before the sim is stopped: the client can lag the sim's run on a loaded
# machine, and the ring must still hold tick 1234 when the sim stops
STOP_AT = 1240
GOAL = [0.3, -0.4, 0.5, 0.2, -0.1, 0.25]


@pytest.mark.exclusive
def test_tick_1234_of_a_sim_run_is_reproduced_offline_from_its_dump(ros, tmp_path, capsys):
    # the sim's rate (200 Hz at most): the node steps on every joint_states, and where it cannot
    # keep up (a CPU step of 4 ms at 200 Hz) the backlog ages past obs_timeout_s and commands
    # are held back, so commands no longer match the node's ticks one to one
    rate = rate_with_room(0.4, 200.0)
    capdir = tmp_path / "capsules"
    capdir.mkdir()
    node = ros.start_node(
        {
            "trigger": "observation",
            "device": "cpu",
            "flight_ticks": RING,
            "capsule_dir": str(capdir),
        },
        wait_services=("list_capsules", "dump_flight"),
    )
    events: list[InputEvent] = []
    commands: list[tuple[int, np.ndarray]] = []

    def on_js(m: JointState) -> None:
        events.append(
            InputEvent(
                kind="joint_states",
                stamp_ns=time.time_ns(),
                names=list(m.name),
                position=np.array(m.position),
                velocity=np.array(m.velocity),
                header_ns=m.header.stamp.sec * 1_000_000_000 + m.header.stamp.nanosec,
            )
        )

    n = ros.node
    js_sub = n.create_subscription(JointState, "/joint_states", on_js, 1000)

    def on_cmd(m: Float64MultiArray) -> None:
        commands.append((time.time_ns(), np.array(m.data)))

    cmd_sub = n.create_subscription(Float64MultiArray, "/commands", on_cmd, 1000)
    goal = n.create_publisher(Float64MultiArray, "/goal", 10)
    # matched to the node's command writer before the sim starts it stepping, so the recording
    # holds the run's commands from its first tick (a loaded machine's discovery lagged the
    # sim's start by ~0.6 s once, and the recording lacked the first 125)
    assert ros.spin_until(lambda: cmd_sub.get_publisher_count() >= 1, 30), node.log_tail()
    env = dict(os.environ, ROS_DOMAIN_ID=str(ros.domain_id))
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    sim = launch_node(
        {"rate_hz": rate},
        log_dir=ros.log_dir,
        name="flashrt_sim_arm",
        params_file=None,
        executable=SIM,
        env=env,
    )
    ros.processes.append(sim)  # stopped at teardown whatever happens
    assert ros.spin_until(lambda: len(commands) >= 200, 30), node.log_tail() + sim.log_tail()
    goal.publish(Float64MultiArray(data=GOAL))  # before tick 1234: the dumped state holds it
    events.append(InputEvent(kind="goal", stamp_ns=time.time_ns(), data=np.array(GOAL)))
    assert ros.spin_until(lambda: len(commands) >= STOP_AT, max(30.0, 2 * STOP_AT / rate)), (
        node.log_tail()
    )
    # frozen, not stopped: a stop by SIGINT took the loaded sim 2 s, 425 more ticks, and tick
    # 1234 had left the ring by the dump. Stopped once the dump and the recording are done
    os.kill(sim.proc.pid, signal.SIGSTOP)
    last = -1
    while last != len(commands):  # the node answers the last joint_states, then it is quiet
        last = len(commands)
        ros.spin_for(0.3)

    r = ros.call(ros.client(DumpFlight, node.service("dump_flight")), DumpFlight.Request(), 30)
    assert r.success, r.message
    n.destroy_subscription(js_sub)  # the recording ends here
    n.destroy_subscription(cmd_sub)
    os.kill(sim.proc.pid, signal.SIGCONT)
    sim.stop()
    files = [Path(f) for f in r.files]
    steps = [diskfmt.read_capsule_header(f)["step"] for f in files]
    assert steps == list(range(steps[0], steps[0] + len(files))) and len(files) == RING
    assert all(f.parent.parent == capdir / "flight" for f in files)
    newest = steps[-1]  # the node's step count: every tick it made is a command it sent
    assert steps[0] <= TICK < newest, (steps[0], newest)
    dumped = files[steps.index(TICK)]
    assert dumped.name == f"main-{TICK}.fcap"

    # the joint_states our recording holds after the one tick TICK consumed. The sim is frozen
    # (it was stopped, once) while it publishes: its last message can reach the node and not
    # this recording (a fresh-clone run held 11 of the node's 12), so the replay covers one
    # tick fewer then; or reach this recording and not the node, a message no tick consumed:
    # left out
    after = newest - TICK
    later = [e for e in events_after(events, dumped_stamp(dumped))[0] if e.kind == "joint_states"]
    held = len(later)
    assert after - 1 <= held <= after + 1, (held, after)
    if held > after:
        events = [e for e in events if e is not later[-1]]
        held = after
    lost = after - held
    run, out, expected = tmp_path / "run", tmp_path / "replayed", tmp_path / "expected"
    bags.write_recording(run, events, commands)
    assert bags.read_commands(run)[-1][1].tobytes() == commands[-1][1].tobytes()
    # the node's commands from tick 1234 on: the last (newest - 1234) it sent, less any the
    # recording has no joint_states for
    bags.write_commands(expected, commands[-after:][:held])
    capsys.readouterr()
    assert replay([str(run), str(out), "--offline", "--from-capsule", str(dumped)]) == 0
    assert f"{held} commands" in capsys.readouterr().out
    assert bagdiff([str(expected), str(out)]) == 0  # exact: no --atol
    assert "identical" in capsys.readouterr().out
    # the same without cutting the recording: its commands before tick TICK left out. Each
    # tick is one command, but one that went out late (older than obs_timeout_s at publish) is
    # held back, not sent: the recording's last (newest - TICK) are tick TICK's on, as the cut
    # replay above showed, and the ones before them are all it holds of the earlier ticks
    recorded = len(bags.read_commands(run))
    assert after < recorded <= newest, (recorded, newest)
    skip = recorded - after
    whole = run
    if lost:  # the command of the tick our recording has no input for goes too
        whole = tmp_path / "run_held"
        bags.write_commands(whole, commands[:-lost])
    assert bagdiff([str(whole), str(out), "--skip-a", str(skip)]) == 0
    assert "identical" in capsys.readouterr().out
    assert bagdiff([str(whole), str(out), "--skip-a", str(skip - 1)]) == 1  # one tick off
    assert bagdiff([str(whole), str(out), "--skip-a", str(newest)]) == 2  # nothing left of A

    # a dump lives in a subfolder: an engine on that capsule_dir reloads none of it
    assert Engine(load_policy("builtin:hybrid"), device="cpu", capsule_dir=capdir).capsules() == []


def dumped_stamp(path: Path) -> float:
    """The header stamp of the joint_states the dumped tick consumed (the replay's start)."""
    return float(diskfmt.read_capsule_header(path)["stamp"])
