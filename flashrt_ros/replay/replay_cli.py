"""flashrt-replay: play a bag's joint_states, goals and camera images into a flashrt node, record
its commands."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from flashrt_ros.obs.joints import DEFAULT_FIELDS, FIELDS, JointMapper, check_fields, fields_hint
from flashrt_ros.replay import bags
from flashrt_ros.replay.player import (
    EngineDriver,
    checkpoint_problem,
    events_after,
    play,
    schedule_problem,
)

MIN_RATE = 1e-3  # slower: a replay that waits for ever, and past time_t for sleep()

EPILOG = """
The node must run with trigger:=observation (one step per joint_states message):
  ros2 run flashrt_ros flashrt_node --ros-args -p trigger:=observation
Replay is lockstep: each observation is sent only after the previous command came back, and each
goal only after the node echoed it on ~/goal_applied, so results never depend on timing. It
starts by putting the node's live session back to its initial state (~/reset_session), so a
replay gives the same commands however often it runs; --no-reset plays from the state the node
holds (e.g. a capsule restored with ~/restore).
Commands are recorded with the stamp of the observation they answer, in IN_BAG's storage format.
The replay publishes on the node's own topics, <namespace of --node>/joint_states, /goal and
/camera/<name>/image_raw, and reads <namespace>/commands, whatever the bag's topics are called;
run the node without remapping those. Each joint_states carries the bag's header stamp, which
the node's flight recorder keeps: a flight dump of a replayed run points back into the bag.

Cameras: the bag's sensor_msgs/Image topics <camera-prefix>/<name>/image_raw are played too, each
image before the joint_states that follow it; the replay waits for the node's ~/camera_seen
acknowledgement of every image, so each step uses exactly the images the bag had before it. The
bag's cameras must be the node's `cameras` (or, --offline, the policy's image inputs; give
--cameras NAME[:ENCODING],... when an encoding is not the default rgb8/mono8). A joint_states
before every camera had a valid image in the replay is skipped (not sent). The node's wall-clock
image staleness (obs_timeout_s) is not replayed: keep it above the node's time per step.

--offline runs the same schedule through the Engine in this process (no DDS), for regression
checks where no node runs; it gives the same commands as the node on the same device.
--from-capsule FILE (with --offline) starts the session from a capsule file, e.g. one tick of a
flight dump (~/dump_flight: capsule_dir/flight/<session>-<time>/<session>-<step>.fcap), and plays
the bag's messages after the joint_states that state consumed last (the capsule's header stamp:
that message's header stamp). On the machine that recorded the bag, the commands are the node's
own from that tick on, bit for bit.
Exit status: 0 done, 2 bad input (bag, topic, node missing or misconfigured).
"""


def parse(argv):
    ap = argparse.ArgumentParser(
        prog="flashrt-replay",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("in_bag", metavar="IN_BAG", help="rosbag2 folder or file (sqlite3 or MCAP)")
    ap.add_argument(
        "out_bag", metavar="OUT_BAG", help="where to write the commands (must not exist)"
    )
    ap.add_argument("--checkpoint-at", type=int, metavar="N", help="checkpoint after N commands")
    ap.add_argument(
        "--restore-at",
        type=int,
        metavar="M",
        help="after M commands restore that checkpoint and replay from N again",
    )
    ap.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="pace at X times bag time, X >= 0.001 (default 0: as fast as the node answers)",
    )
    ap.add_argument("--node", default="/flashrt", help="the node's full name (default /flashrt)")
    ap.add_argument(
        "--joint-states-topic",
        default="/joint_states",
        help="the bag's joint_states topic (default /joint_states); the replay sends them to "
        "the node's joint_states, <namespace of --node>/joint_states",
    )
    ap.add_argument(
        "--goal-topic",
        default="/goal",
        help="the bag's goal topic (default /goal); sent to <namespace of --node>/goal",
    )
    ap.add_argument(
        "--camera-prefix",
        default=None,
        help="the bag's camera topics are PREFIX/<name>/image_raw (default: the joint_states "
        "topic's namespace + /camera); sent to <namespace of --node>/camera/<name>/image_raw",
    )
    ap.add_argument(
        "--timeout", type=float, default=10.0, help="seconds to wait for each answer (default 10)"
    )
    ap.add_argument("--storage", choices=bags.STORAGES, help="output storage (default: IN_BAG's)")
    ap.add_argument(
        "--no-reset",
        action="store_true",
        help="play from the node's live session as it stands (default: put it back to its "
        "initial state first, with ~/reset_session, so two replays give the same commands)",
    )
    off = ap.add_argument_group("offline (no node, no DDS)")
    off.add_argument("--offline", action="store_true", help="step an in-process Engine instead")
    off.add_argument(
        "--from-capsule",
        metavar="FILE",
        help="start from this capsule file (a flight dump tick) and replay what followed it",
    )
    off.add_argument(
        "--policy", default="builtin:hybrid", help="the node's `policy` (default builtin:hybrid)"
    )
    off.add_argument("--weights", default="", help="the node's `weights` ('' = the shipped)")
    off.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    off.add_argument("--seed", type=int, default=0, help="the node's `seed` (default 0)")
    off.add_argument(
        "--obs-limit",
        type=float,
        default=1000.0,
        help="the node's `obs_limit` (default 1000): a joint_states with a value beyond it is "
        "left out, as the node refuses it (read from the node when replaying through one)",
    )
    off.add_argument(
        "--cameras",
        default="",
        help="the node's `cameras` as NAME[:ENCODING],... (default: the bag's cameras, "
        "default encodings)",
    )
    off.add_argument(
        "--joints",
        default=",".join(f"joint{i}" for i in range(1, 7)),
        help="joint names, comma separated (the node's are read from it)",
    )
    off.add_argument(
        "--state-fields",
        default=",".join(DEFAULT_FIELDS),
        help="the node's `state_fields`, comma separated: which joint_states arrays make the "
        f"observation ({', '.join(FIELDS)}; default {','.join(DEFAULT_FIELDS)}; the node's "
        "are read from it)",
    )
    a = ap.parse_args(argv)
    if not (math.isfinite(a.rate) and (a.rate == 0 or a.rate >= MIN_RATE)):
        ap.error(
            f"--rate must be 0 (as fast as the node answers) or a finite number >= {MIN_RATE:g} "
            f"(a thousandth of the bag's pace), not {a.rate}"
        )
    try:
        a.state_fields = check_fields([f for f in a.state_fields.split(",") if f])
    except ValueError as e:
        ap.error(f"--state-fields: {e}")
    if not (a.obs_limit > 0 and math.isfinite(a.obs_limit)):
        ap.error("--obs-limit must be a finite number > 0")
    if not (a.timeout > 0 and math.isfinite(a.timeout)):
        ap.error("--timeout must be a finite number of seconds > 0")
    if a.from_capsule and not a.offline:
        ap.error(
            "--from-capsule needs --offline: the node has no service that loads a capsule file "
            "(restore one it holds with ~/restore, or rewind it with ~/rewind)"
        )
    if a.no_reset and a.offline:
        ap.error("--no-reset is for a node: an --offline replay starts from a new Engine")
    if a.from_capsule and a.checkpoint_at is not None:
        ap.error("--from-capsule does not combine with --checkpoint-at/--restore-at")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    try:
        why = checkpoint_problem(a.checkpoint_at, a.restore_at)
        if why:  # before anything, the node's reset included
            raise ValueError(why)
        in_storage = bags.detect_storage(a.in_bag)
        storage = a.storage or in_storage  # the output's
        prefix = a.camera_prefix
        if prefix is None:
            prefix = "/" + a.joint_states_topic.strip("/").rpartition("/")[0] + "/camera"
        events = bags.read_inputs(a.in_bag, a.joint_states_topic, a.goal_topic, prefix)
        bag_cams = sorted({e.camera for e in events if e.kind == "image"})
        _writable_new(a.out_bag, a.in_bag)  # before the replay, not after it
        start = None
        if a.from_capsule:
            start = _capsule_header(a.from_capsule)
            events, skipped = events_after(events, start["stamp"])
            print(
                f"flashrt-replay: from capsule {a.from_capsule} (session {start['session']!r}, "
                f"step {start['step']}): {skipped} joint_states before it left out",
                file=sys.stderr,
            )
        n_js = sum(e.kind == "joint_states" for e in events)
        n_img = sum(e.kind == "image" for e in events)
        print(
            f"flashrt-replay: {a.in_bag} ({in_storage}): {n_js} joint_states, "
            f"{len(events) - n_js - n_img} goals, {n_img} images"
            + (f" of cameras {', '.join(bag_cams)}" if bag_cams else ""),
            file=sys.stderr,
        )
        if a.offline:
            result = _offline(a, events, start, bag_cams)
        else:
            result = _through_node(a, events, bag_cams)
        bags.write_commands(a.out_bag, result.commands, storage=storage)
    except (ValueError, RuntimeError) as e:
        print(f"flashrt-replay: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flashrt-replay: interrupted; nothing written", file=sys.stderr)
        return 130
    print(
        f"flashrt-replay: {len(result.commands)} commands -> {a.out_bag}; "
        f"{len(result.skipped)} samples skipped, {result.goals} goals"
        + (f"; restored after {result.restored_at}" if result.restored_at is not None else "")
    )
    for idx, why in result.skipped[:10]:
        print(f"  skipped event {idx}: {why}", file=sys.stderr)
    return 0


def _writable_new(out_bag: str, in_bag: str) -> None:
    """OUT_BAG must not exist, must not be inside IN_BAG (the input is never touched), and its
    folder must take it: found out before a replay runs."""
    if not out_bag.strip():
        raise ValueError("OUT_BAG is empty: name the bag to write")
    inside = Path(os.path.realpath(out_bag)).is_relative_to(os.path.realpath(in_bag))
    if inside and os.path.isdir(in_bag):
        raise ValueError(f"{out_bag} is inside IN_BAG {in_bag}: write the commands elsewhere")
    if os.path.lexists(out_bag):
        raise ValueError(f"{out_bag} exists; choose a new OUT_BAG")
    parent = os.path.dirname(os.path.abspath(out_bag))
    if not os.path.isdir(parent):
        raise ValueError(f"{out_bag}: its folder {parent} does not exist (or is not a folder)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{out_bag}: its folder {parent} is not writable")


def _capsule_header(path: str) -> dict:
    """The checked header of a capsule file; its stamp says where in the bag to start."""
    from flashrt_ros.capsules import diskfmt

    header = diskfmt.read_capsule_header(path)  # CorruptCapsule (a ValueError) names the problem
    if header["stamp"] <= 0 and header["step"] > 0:
        raise ValueError(
            f"{path}: capsule of step {header['step']} carries no observation stamp (a tick "
            "the node did not stamp, e.g. the first after a restore); cannot find where to start"
        )
    return header


def _same_cameras(bag: list[str], served: list[str], who: str) -> None:
    if sorted(bag) != sorted(served):
        raise ValueError(
            f"the bag's cameras {sorted(bag)} are not {who}'s {sorted(served)}; "
            "every camera must be in both"
        )


def _offline(a, events, start: dict | None = None, bag_cams: list[str] | None = None):
    from flashrt_ros import Engine, load_policy
    from flashrt_ros.obs.images import COMPRESSED, camera_key, parse_cameras

    cams = parse_cameras([c for c in a.cameras.split(",") if c]) if a.cameras else {}
    if COMPRESSED in cams.values():
        raise ValueError(
            "--cameras: compressed cameras are not replayed offline (a bag holds "
            "sensor_msgs/Image frames); give the raw encodings"
        )
    engine = Engine(
        load_policy(a.policy, weights=a.weights or None),
        device=a.device,
        seed=a.seed,
        obs_limit=a.obs_limit,
        # a flight ring of one: the node that recorded a flight dump steps with its ring write
        flight_ticks=1 if start is not None else 0,
        image_encodings={camera_key(n): e for n, e in cams.items() if e is not None},
    )
    driver = EngineDriver(engine)
    if cams and sorted(cams) != sorted(driver.cameras):  # as the node's configure refuses them
        raise ValueError(
            f"--cameras {sorted(cams)} are not the policy's cameras {sorted(driver.cameras)}; "
            "name each of them once"
        )
    _same_cameras(bag_cams or [], driver.cameras, "the policy")
    if start is not None:  # fingerprint, layout, checksum checked: a foreign file is refused
        info = engine.load_capsule(a.from_capsule)
        engine.restore(info.id, session="main", verify=True)
    mapper = JointMapper(
        [j for j in a.joints.split(",") if j], limit=engine.obs_limit, fields=a.state_fields
    )
    if (engine.obs_dim, engine.action_dim) != (mapper.dim, mapper.n):
        raise ValueError(
            f"policy {a.policy} takes {engine.obs_dim} observations and gives "
            f"{engine.action_dim} actions; --joints has {mapper.n} joints and --state-fields "
            f"{list(mapper.fields)} make {mapper.dim} observations"
            + fields_hint(engine.obs_dim, mapper.n, option=True)
        )
    return play(
        events,
        mapper,
        driver,
        a.checkpoint_at,
        a.restore_at,
        a.rate,
        progress=True,
        goal_dim=engine.goal_dim,
    )


def _through_node(a, events, bag_cams: list[str] | None = None):
    import rclpy

    from flashrt_ros.replay.node_driver import NodeDriver

    rclpy.init()
    driver = NodeDriver(a.node, a.timeout)
    try:
        mapper = JointMapper(*driver.connect())
        _same_cameras(bag_cams or [], driver.cameras, "the node")
        why = schedule_problem(events, mapper, a.checkpoint_at, a.restore_at)
        if why:  # before the reset: a refused replay changes nothing
            raise ValueError(why)
        # a goal of the wrong size is refused by the node (no echo): left out, as offline
        goal_dim = driver.goal_dim() if any(e.kind == "goal" for e in events) else None
        if not a.no_reset:  # the last thing before playing: a refused replay changes nothing
            print(f"{a.node}: {driver.reset()}")
        return play(
            events,
            mapper,
            driver,
            a.checkpoint_at,
            a.restore_at,
            a.rate,
            progress=True,
            goal_dim=goal_dim,
        )
    finally:
        driver.close()
        rclpy.try_shutdown()


if __name__ == "__main__":
    sys.exit(main())
