"""``python -m flashrt_ros.demo``: the options, and main (start the nodes, run the story, stop
the nodes, write the outputs). See the package docstring for the story and the exit statuses."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

from flashrt_ros.demo import DemoError
from flashrt_ros.demo.children import Child, start_nodes, stop_children
from flashrt_ros.demo.planner import Planner
from flashrt_ros.demo.plot import FRAMES_FILE, plot_demo
from flashrt_ros.demo.policy_info import DEFAULT_POLICY, PolicyInfo, describe_policy
from flashrt_ros.demo.story import CAMERA_RATE_HZ, SIM_RATE_HZ, Story
from flashrt_ros.demo.summary import build_summary, print_summary
from flashrt_ros.node.params import DEFAULT_JOINTS

DEFAULT_DOMAIN_ID = 77
DEFAULT_DURATION = 36.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m flashrt_ros.demo",
        description=(
            "Closed-loop demo: the built-in policy drives the simulated arm while a planner "
            "calls checkpoint / branch / rollout / restore; prints a summary, writes a PNG plot "
            "and summary.json."
        ),
    )
    ap.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"policy spec the node serves (default {DEFAULT_POLICY}); builtin:act reads the "
        "sim's camera (its image inputs say which cameras and what size); a state of 6 values "
        "is served as the joint positions (state_fields [position]), of 12 as positions then "
        "velocities; it needs a goal input or a camera to see the story's goals",
    )
    ap.add_argument(
        "--out", type=Path, default=Path("out/demo"), help="output directory (default: ./out/demo)"
    )
    ap.add_argument(
        "--duration",
        type=float,
        default=DEFAULT_DURATION,
        help=f"seconds of the scripted story, after node start-up "
        f"(default {DEFAULT_DURATION:g}; at least 8)",
    )
    ap.add_argument("--rate", type=float, default=50.0, help="policy rate in Hz (default 50)")
    env_dom = os.environ.get("FLASHRT_DEMO_DOMAIN_ID", "")
    ap.add_argument(
        "--domain-id",
        type=int,
        default=None,  # None: the environment's, checked below, else DEFAULT_DOMAIN_ID
        help="ROS_DOMAIN_ID for the demo's nodes (default $FLASHRT_DEMO_DOMAIN_ID "
        f"or {DEFAULT_DOMAIN_ID}); discovery always stays on localhost",
    )
    ap.add_argument(
        "--startup-timeout",
        type=float,
        default=90.0,
        help="seconds to wait for the nodes to come up (default 90)",
    )
    args = ap.parse_args(argv)
    if args.domain_id is None:  # not given: the environment's, when it is one
        if env_dom and not env_dom.strip().isdigit():
            ap.error(f"FLASHRT_DEMO_DOMAIN_ID must be a domain id (0-232), got {env_dom!r}")
        args.domain_id = int(env_dom) if env_dom else DEFAULT_DOMAIN_ID
    if not (math.isfinite(args.duration) and args.duration >= 8.0):
        ap.error("--duration must be a number of seconds, at least 8")
    if not (math.isfinite(args.startup_timeout) and args.startup_timeout > 0):
        ap.error("--startup-timeout must be a number of seconds > 0")
    if not (math.isfinite(args.rate) and 1.0 <= args.rate <= 1000.0):
        ap.error("--rate must be within 1 .. 1000 Hz")
    if not 0 <= args.domain_id <= 232:
        ap.error("--domain-id must be within 0 .. 232")
    return args


def _describe(spec: str) -> PolicyInfo:
    """The policy as the node will load it: its cameras and their size come from its inputs."""
    print(f"reading {spec}'s inputs (load_policy; torch import takes a second or two) ...")
    info = describe_policy(spec, n_joints=len(DEFAULT_JOINTS))
    if info.cameras:
        h, w = info.image_hw
        print(
            f"{spec}: cameras {list(info.cameras)} ({h}x{w} rgb8): the sim publishes "
            f"camera/<name>/image_raw, the node subscribes them (cameras: {list(info.cameras)})"
        )
    return info


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wall0 = time.monotonic()
    out: Path = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file of that name, a file above it, no permission
        print(f"flashrt demo: error: --out {out}: {e.strerror or e}", file=sys.stderr)
        return 2

    # DDS stays on this machine, in the demo's own domain (this process and its children)
    os.environ["ROS_DOMAIN_ID"] = str(args.domain_id)
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ.pop("ROS_LOCALHOST_ONLY", None)
    os.environ.pop("ROS_STATIC_PEERS", None)  # static peers are contacted even with LOCALHOST
    env = dict(os.environ, PYTHONUNBUFFERED="1", RCUTILS_LOGGING_BUFFERED_STREAM="0")
    node_env = dict(env)
    node_env.setdefault("OMP_NUM_THREADS", "1")  # a tiny model: one thread steps it fastest

    with contextlib.suppress(ValueError):  # only the main thread may set handlers
        signal.signal(signal.SIGTERM, _raise_interrupt)

    children: list[Child] = []
    planner: Planner | None = None
    print(
        f"flashrt demo: domain {args.domain_id} (localhost only), policy at {args.rate:g} Hz, "
        f"story {args.duration:g} s, output in {out}"
    )
    try:
        info = _describe(args.policy)
    except DemoError as e:
        print(f"flashrt demo: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    died: list[str] = []  # children that ended on their own during the story
    try:
        try:
            start_nodes(
                children,
                out,
                args.rate,
                SIM_RATE_HZ,
                env,
                node_env,
                policy=info.spec,
                cameras=info.cameras,
                image_hw=info.image_hw,
                camera_rate_hz=CAMERA_RATE_HZ,
                state_fields=info.state_fields,
            )
        except DemoError as e:  # the nodes did not come up (not built, say): exit 2
            print(f"flashrt demo: error: {e}", file=sys.stderr)
            return 2
        planner = Planner(args.domain_id, cameras=info.cameras)
        print("starting flashrt_sim_arm and flashrt_node (torch import takes a few seconds) ...")
        try:
            startup = planner.wait_ready(children, args.startup_timeout)
        except DemoError as e:
            print(f"flashrt demo: error: {e}", file=sys.stderr)
            return 2
        print(f"nodes up after {startup:.1f} s: services answer, commands flowing")
        _, diag_pre = planner.wait_fresh_diag(2.5)
        device = (diag_pre or {}).get("device", "?")
        print(f"flashrt node on device {device}; story starts now")

        story = Story(planner, args.duration, args.rate, policy=info)
        diag0 = planner.last_diag() or (time.monotonic(), diag_pre)
        story.run()
        diag1 = planner.wait_fresh_diag(2.5)
        listing = story.list_capsules()
        trajectory = planner.trajectory(story.t0, story.t0 + story.duration + 0.5)
        summary = build_summary(
            args, story, trajectory, startup, time.monotonic() - wall0, diag0, diag1, listing, info
        )
        died = [f"{c.name} ({c.proc.returncode})" for c in children if c.proc.poll() is not None]
    except KeyboardInterrupt:
        print("\nflashrt demo: interrupted; stopping the nodes", file=sys.stderr)
        return 130
    except DemoError as e:
        print(f"flashrt demo: error: {e}", file=sys.stderr)
        for c in children:
            print(f"--- {c.name} log tail ({c.log_path}):\n{c.log_tail()}", file=sys.stderr)
        return 1
    finally:
        if planner is not None:
            planner.close()
        stop_children(children)
        for c in children:  # a node that had to be killed or crashed is worth a word
            if c.proc.returncode not in (0, None, -signal.SIGINT, 130):
                print(
                    f"note: {c.name} exited with code {c.proc.returncode} (log {c.log_path})",
                    file=sys.stderr,
                )

    # the outputs (nodes already stopped)
    csv = trajectory.write_csv(out / "joint_states.csv")
    frames = None
    if story.frames:
        frames = np.stack(story.frames)
        np.savez_compressed(out / FRAMES_FILE, frames=frames)
    png = plot_demo(summary, trajectory, out / "demo.png", frames=frames)
    summary["files"] = {
        "plot": str(png),
        "summary": str(out / "summary.json"),
        "joint_states": str(csv),
        "logs": [str(c.log_path) for c in children],
    }
    if frames is not None:
        summary["files"]["camera_frames"] = str(out / FRAMES_FILE)
    summary["wall_s"] = round(time.monotonic() - wall0, 3)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary, out)
    if not summary["all_ops_ok"]:
        print("flashrt demo: some capsule operations failed (see above)", file=sys.stderr)
        return 1
    if died:  # the story ran without them: what it shows is not the arm's
        print(
            f"flashrt demo: {', '.join(died)} ended during the story (exit code in brackets; "
            "see the logs)",
            file=sys.stderr,
        )
        return 1
    return 0
