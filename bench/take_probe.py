"""rclpy's take of a 640x480 rgb8 image, with the node's malloc thresholds (node/memory.py) and
with the C library's defaults: how long each take takes and how many minor page faults it makes.

Two real processes in a fresh domain (LOCALHOST discovery): one publishes images at 100 Hz, the
other takes them raw, as the node does, with the camera Fast DDS profile. test/test_memory.py
runs the same peers and checks the faults.

    python3 bench/take_probe.py [--out FILE] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from flashrt_ros.node.memory import ENV  # noqa: E402

PEER = r"""
import resource, sys, time
sys.path.insert(0, sys.argv[3])
role, topic = sys.argv[1], sys.argv[2]
if role == "sub":
    from flashrt_ros.node.memory import tune_malloc
    print("NOTE", tune_malloc(), flush=True)
import rclpy
from sensor_msgs.msg import Image
rclpy.init()
node = rclpy.create_node("take_" + role)
deadline = time.monotonic() + 30
if role == "pub":
    pub = node.create_publisher(Image, topic, 100)
    msg = Image(height=480, width=640, encoding="rgb8", step=640 * 3)
    msg.data = bytes(range(256)) * (640 * 480 * 3 // 256)
    while pub.get_subscription_count() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the match completes on the subscriber's side too
    for _ in range(80):
        pub.publish(msg)
        time.sleep(0.01)
    time.sleep(1.0)
else:
    sub = node.create_subscription(Image, topic, lambda m: None, 100, raw=True)
    faults, took = [], []
    while len(faults) < 60 and time.monotonic() < deadline:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        with sub.handle:
            got = sub.handle.take_message(sub.msg_type, sub.raw)
        if got is None:
            time.sleep(0.0005)
            continue
        took.append((time.perf_counter() - t0) * 1e6)
        assert len(got[0]) > 640 * 480 * 3
        del got
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print("FAULTS", *faults, flush=True)
    print("TAKE_US", *(f"{t:.1f}" for t in took), flush=True)
node.destroy_node()
rclpy.shutdown()
"""


def takes(topic: str, malloc: str | None) -> tuple[list[int], list[float], str]:
    """(minor page faults and microseconds of each take after the first ten, the subscriber's
    malloc note), in the environment's domain; `malloc` "default" sets FLASHRT_MALLOC."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if malloc is not None:
        env[ENV] = malloc
    args = [str(ROOT)]
    sub = subprocess.Popen(
        [sys.executable, "-c", PEER, "sub", topic, *args], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        pub = subprocess.run(
            [sys.executable, "-c", PEER, "pub", topic, *args], env=env, text=True,
            capture_output=True, timeout=60,
        )  # fmt: skip
        out, err = sub.communicate(timeout=60)
    finally:
        sub.kill()
    lines = out.splitlines()

    def words(key: str) -> list[str] | None:
        return next((ln.split()[1:] for ln in lines if ln.startswith(key + " ")), None)

    faults, took = words("FAULTS"), words("TAKE_US")
    note = next((ln[5:] for ln in lines if ln.startswith("NOTE ")), "")
    assert faults and took and len(faults) >= 40, (out + err + pub.stderr)[-2000:]
    # the first takes warm the heap up
    return [int(w) for w in faults[10:]], [float(w) for w in took[10:]], note


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of both settings")
    args = ap.parse_args()
    from test.ros_helpers import ros_domain

    profile = ROOT / "config" / "fastdds_images.xml"
    rows = []
    with ros_domain():
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(profile)
        for r in range(args.rounds):
            for name, malloc in (("thresholds", None), ("defaults", "default")):
                faults, took, note = takes(f"take_{name}_{r}", malloc)
                row = {
                    "round": r + 1,
                    "malloc": name,
                    "note": note,
                    "takes": len(took),
                    "take_p50_us": round(statistics.median(took), 1),
                    "take_p90_us": round(sorted(took)[int(0.9 * len(took))], 1),
                    "faults_p50": statistics.median(faults),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {
        "image": "640x480 rgb8 (921,600 B), taken raw at 100 Hz",
        "rows": rows,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
