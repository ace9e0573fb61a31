"""How long two camera images take to get *into* a process, with nothing else going on.

The camera scenario (ros_bench.run_camera) splits camera -> action at the node's
`~/camera_seen` acknowledgement: images in, then the step and the command back. Its images-in
part holds the transport of two 921,600-byte images sent one after the other, the node's own
handling of each (decode, checks, staging) and whatever the node does meanwhile (a step per
joint_states at 500 Hz). This measures the first two alone, beside a bare floor:

- `node`: flashrt_node with the camera probe policy, observation trigger, and no joint_states
  at all, so it never steps: publish -> the node has acknowledged both images of a pair;
- `floor`: a bare rclpy process (ros_floors.py `cameras`) that takes the same two topics
  serialized, as the node does, and acknowledges each image on the same latched
  `~/camera_seen` (received, accepted per camera), with nothing else. The node acknowledges
  the images it took in one round of its inputs' loop once (from 3aac050), the floor each one.

Latency per pair: from just before its first image is published (system clock) to the DDS
reception stamp of the first acknowledgement that counts this pair on both cameras (the k-th
pair sent is each camera's k-th message: the publishers wait for the subscriptions first).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

PAIR_HZ = 30.0


def intake_latencies(ros, proc, n: int, warm: int = 20, timeout: float = 2.0) -> dict:
    """Publish `warm` + `n` image pairs at 30 Hz to `proc`'s cameras; summarize the last `n`."""
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import QoSDurabilityPolicy, QoSProfile
    from sensor_msgs.msg import Image
    from std_msgs.msg import UInt64MultiArray

    from bench.ros_bench import CAMERAS, camera_pair, pct

    node = ros.node
    pubs = [node.create_publisher(Image, proc.topic(f"camera/{c}/image_raw"), 10) for c in CAMERAS]
    seen: list[tuple[int, list[int]]] = []
    sub = node.create_subscription(
        UInt64MultiArray,
        proc.service("camera_seen"),
        lambda m, info: seen.append((int(info.get("received_timestamp", 0) or 0), list(m.data))),
        QoSProfile(depth=1000, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL),
    )
    ex = SingleThreadedExecutor(context=ros.context)
    ex.add_node(node)

    def spin_until(pred, secs: float) -> bool:
        end = time.monotonic() + secs
        while not pred() and time.monotonic() < end:
            ex.spin_once(timeout_sec=0.01)
        return bool(pred())

    sent_at: list[int] = []  # system clock ns just before each pair's first publish
    published: list[int] = []  # ns the two publish calls took
    try:
        matched = lambda: all(p.get_subscription_count() > 0 for p in pubs)  # noqa: E731
        if not spin_until(lambda: matched() and sub.get_publisher_count() > 0, 30.0):
            raise RuntimeError(f"{proc} did not subscribe the cameras\n{proc.log_tail()}")
        spin_until(lambda: bool(seen), 5.0)  # the latched acknowledgement of nothing yet
        msgs = camera_pair(1)
        nxt = time.monotonic()
        for k in range(1, warm + n + 1):
            while (left := nxt - time.monotonic()) > 0:
                ex.spin_once(timeout_sec=left)
            sent_at.append(time.time_ns())
            for p, m in zip(pubs, msgs, strict=True):
                p.publish(m)
            published.append(time.time_ns() - sent_at[-1])
            msgs = camera_pair(1 + k % 250)  # the next pair, built off the clock
            nxt = max(nxt + 1.0 / PAIR_HZ, time.monotonic())
        total = len(sent_at)
        spin_until(lambda: any(d[0] >= total and d[2] >= total for _, d in seen), timeout)
    finally:
        with contextlib.suppress(Exception):
            ex.remove_node(node)
            ex.shutdown(timeout_sec=0)
        for p in pubs:
            with contextlib.suppress(Exception):
                node.destroy_publisher(p)
        with contextlib.suppress(Exception):
            node.destroy_subscription(sub)
    lat, first, missed = [], [], 0
    for k in range(warm + 1, len(sent_at) + 1):
        rx = next((rx for rx, d in seen if rx and d[0] >= k and d[2] >= k), None)
        top = next((rx for rx, d in seen if rx and d[0] >= k), None)
        if rx is None:
            missed += 1
        else:
            lat.append((rx - sent_at[k - 1]) * 1e-3)
        if top is not None:
            first.append((top - sent_at[k - 1]) * 1e-3)
    return {
        "samples": len(lat),
        "missed": missed,
        "basis": "dds",
        "p50_us": pct(lat, 50),
        "p99_us": pct(lat, 99),
        "first_image_p50_us": pct(first, 50),  # publish -> the first camera's image held
        "publish_p50_us": pct([t * 1e-3 for t in published[warm:]], 50),  # both publish calls
        "pairs": f"2 x 640x480 rgb8 at {PAIR_HZ:g} Hz, nothing else",
    }


def run_camera_intake(ros, args, n: int, log_dir: Path) -> dict:
    """`node` above: flashrt_node with the probe policy, never stepping."""
    from bench.ros_bench import (
        CAMERA_PROBE,
        CAMERAS,
        log,
        node_params,
        repo_importable,
        start_node,
    )

    with repo_importable():
        params = node_params(args, trigger="observation", cameras=list(CAMERAS))
        params["policy"] = CAMERA_PROBE
        proc, _ = start_node(ros, params, args.startup_timeout)
    try:
        out = intake_latencies(ros, proc, n)
    finally:
        proc.stop()
    log(f"camera intake, node not stepping ({n}): p50/p99 {out['p50_us']}/{out['p99_us']} us")
    return out


def run_floor_camera_intake(ros, args, n: int, log_dir: Path) -> dict:
    """`floor` above: ros_floors.py `cameras`."""
    from bench.ros_bench import log
    from bench.ros_floors import launch_floor

    proc = launch_floor(ros, "cameras", log_dir=log_dir)
    try:
        out = intake_latencies(ros, proc, n)
    finally:
        out_rc = proc.stop()
    out["exit_status"] = out_rc
    log(f"floor camera intake ({n}): p50/p99 {out['p50_us']}/{out['p99_us']} us")
    return out
