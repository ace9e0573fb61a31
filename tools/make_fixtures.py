#!/usr/bin/env python3
"""Generate the small rosbag2 fixture bags of the test suite; no ROS needed.

    python tools/make_fixtures.py OUT_DIR [--force]

Writes into OUT_DIR (deterministic content, fixed seeds):

  arm_sqlite3/, arm_mcap/   the same recording in both storages: 300 /joint_states samples at 100 Hz
                            of the simulated arm (ArmModel) driven by the expert toward goals, and
                            3 /goal messages (Float64MultiArray, 6 values) interleaved. The goal at
                            sample 150 has the same receive time as that sample and comes after it
                            in bag order (a tie).
  messy_sqlite3/, messy_mcap/  120 /joint_states samples with joints in shuffled order, two extra
                            joints, irregular timing (jitter, a gap, a duplicate stamp) and a
                            few bad samples (NaN, Inf, a short position array, a missing
                            joint), plus 2 goals.
  fixtures.json             what each bag holds: counts, goal times and the indices (in
                            read_inputs order, joint_states only) of the samples a node must refuse.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashrt_ros.node.params import DEFAULT_JOINTS  # noqa: E402
from flashrt_ros.replay.bags import InputEvent, write_inputs  # noqa: E402
from flashrt_ros.sim.dynamics import ArmModel  # noqa: E402

JOINTS = list(DEFAULT_JOINTS)
EXTRA = ["gripper_finger_left", "base_rotation_aux"]
T0_NS = 1_700_000_000_000_000_000  # fixed bag start (2023-11-14T22:13:20Z)
PERIOD_NS = 10_000_000  # 100 Hz


def arm_events(n_samples: int = 300, seed: int = 7) -> tuple[list[InputEvent], dict]:
    """Closed-loop expert recording: joint_states every 10 ms, goals at samples 0.5, 150, 230.3."""
    arm = ArmModel(seed=seed)
    rng = np.random.default_rng(seed)
    q0 = np.round(rng.uniform(-0.5, 0.5, 6), 3)
    arm.reset(q0)
    goals = [
        (T0_NS + PERIOD_NS // 2, arm.random_goal()),  # between samples 0 and 1
        (T0_NS + 150 * PERIOD_NS, arm.random_goal()),  # same stamp as sample 150, written after it
        (T0_NS + 230 * PERIOD_NS + 3_000_000, arm.random_goal()),
    ]
    events: list[InputEvent] = []
    goal = q0.copy()
    gi = 0
    for i in range(n_samples):
        t = T0_NS + i * PERIOD_NS
        while gi < len(goals) and goals[gi][0] < t:
            events.append(InputEvent("goal", goals[gi][0], data=goals[gi][1].copy()))
            goal = goals[gi][1]
            gi += 1
        events.append(
            InputEvent(
                "joint_states", t, names=list(JOINTS), position=arm.q, velocity=arm.dq, header_ns=t
            )
        )
        while gi < len(goals) and goals[gi][0] == t:
            events.append(InputEvent("goal", goals[gi][0], data=goals[gi][1].copy()))
            goal = goals[gi][1]
            gi += 1
        arm.step(arm.expert_action(goal))
    info = {
        "joint_states": n_samples,
        "goals": len(goals),
        "rate_hz": 100.0,
        "start_ns": T0_NS,
        "goal_stamps_ns": [g[0] for g in goals],
        "goal_values": [g[1].tolist() for g in goals],
        "initial_positions": q0.tolist(),
        "joint_names": JOINTS,
        "tie": "goal 1 has the receive stamp of joint_states sample 150 and follows it",
    }
    return events, info


def messy_events(n_samples: int = 120, seed: int = 11) -> tuple[list[InputEvent], dict]:
    """Shuffled names, extra joints, irregular timing and a few invalid samples."""
    arm = ArmModel(seed=seed)
    rng = np.random.default_rng(seed)
    goal = arm.random_goal()
    names_all = JOINTS + EXTRA
    bad = {17: "nan", 41: "short", 63: "inf", 88: "missing_joint", 95: "nan_velocity"}
    events: list[InputEvent] = []
    t = T0_NS
    goal_stamps = []
    for i in range(n_samples):
        if i == 0:
            pass
        elif i == 50:
            t += 80_000_000  # an 80 ms gap
        elif i == 70:
            pass  # duplicate receive stamp with sample 69
        else:
            t += PERIOD_NS + int(rng.integers(-3_000_000, 3_000_001))
        if i in (10, 60):
            goal = arm.random_goal()
            events.append(InputEvent("goal", t - 1_000_000, data=goal.copy()))
            goal_stamps.append(t - 1_000_000)
        pos = np.concatenate([arm.q, [0.01 * i, 0.0]])
        vel = np.concatenate([arm.dq, [0.0, 0.0]])
        order = rng.permutation(len(names_all))
        names = [names_all[k] for k in order]
        pos, vel = pos[order], vel[order]
        kind = bad.get(i)
        if kind == "nan":
            pos[int(rng.integers(len(pos)))] = np.nan
            pos[names.index("joint3")] = np.nan
        elif kind == "inf":
            vel[names.index("joint2")] = np.inf
        elif kind == "nan_velocity":
            vel[names.index("joint6")] = np.nan
        elif kind == "short":
            pos = pos[:5]
        elif kind == "missing_joint":
            k = names.index("joint4")
            names.pop(k)
            pos = np.delete(pos, k)
            vel = np.delete(vel, k)
        events.append(
            InputEvent("joint_states", t, names=names, position=pos, velocity=vel, header_ns=t)
        )
        arm.step(arm.expert_action(goal))
    info = {
        "joint_states": n_samples,
        "goals": len(goal_stamps),
        "goal_stamps_ns": goal_stamps,
        "joint_names": JOINTS,
        "extra_joints": EXTRA,
        "bad_samples": {str(k): v for k, v in sorted(bad.items())},
        "valid_joint_states": n_samples - len(bad),
        "duplicate_stamp_samples": [69, 70],
    }
    return events, info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Generate flashrt_ros fixture bags (sqlite3 and MCAP).")
    p.add_argument(
        "out_dir", metavar="OUT_DIR", help="directory to write the bags into (created if needed)"
    )
    p.add_argument("--force", action="store_true", help="replace bags that already exist")
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, or above it
        p.error(f"OUT_DIR {out}: {e.strerror or e}")
    names = [f"{base}_{storage}" for base in ("arm", "messy") for storage in ("sqlite3", "mcap")]
    taken = [out / n for n in names if (out / n).exists()]
    if taken and not args.force:  # before anything is written: all the bags, or none
        print(f"{', '.join(map(str, taken))} exist(s); use --force to replace", file=sys.stderr)
        return 2
    arm, arm_info = arm_events()
    messy, messy_info = messy_events()
    manifest = {}
    for base, events, info in (("arm", arm, arm_info), ("messy", messy, messy_info)):
        for storage in ("sqlite3", "mcap"):
            path = out / f"{base}_{storage}"
            if path.exists():
                shutil.rmtree(path)
            write_inputs(path, events, storage)
            size = sum(f.stat().st_size for f in path.iterdir())
            print(f"wrote {path} ({storage}, {len(events)} messages, {size} bytes)")
        manifest[base] = info
    (out / "fixtures.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
