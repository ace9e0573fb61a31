"""What a running control loop costs the services: ListCapsules round trips to the node while
it is idle, while it steps on a 500 Hz joint_states stream (observation trigger), and in timer
mode at 500 Hz, each timed by the same idle client (ros_bench.ServiceCaller).

    python3 bench/service_contention.py [--device cpu|cuda] [--policy SPEC] [--calls N] [--out F]

Run where flashrt_node is built (`make build`; on the GPU machine after bench/ros_gpu.sh has
built it). DDS stays on loopback (ros_helpers.ros_harness picks a domain). A test policy such
as test.tiny_policy:tiny needs the repository on PYTHONPATH, which this script sets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

from bench.ros_bench import (  # noqa: E402
    Client,
    list_rtts_us,
    pct,
    start_node,
    stop_streamer,
    streamer,
)
from test.ros_helpers import ros_harness  # noqa: E402

MODES = (  # label, node parameters, stream joint_states at 500 Hz, reliable stream
    ("idle", {"trigger": "observation"}, False, True),
    ("observation_500hz", {"trigger": "observation"}, True, True),
    ("timer_500hz", {"trigger": "timer", "rate_hz": 500.0}, True, False),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--policy", default="test.tiny_policy:tiny")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/flashrt_service_contention"))
    a = ap.parse_args()
    a.log_dir.mkdir(parents=True, exist_ok=True)
    out: dict = {"device": a.device, "policy": a.policy, "modes": {}}
    for label, params, stream, reliable in MODES:
        with ros_harness(a.log_dir) as ros:
            node = {"device": a.device, "policy": a.policy, **params}
            proc, _ = start_node(ros, node, 300.0)
            cl = Client(ros, proc)  # counts the commands: proof that the node steps
            sp = streamer(500.0, 600.0, proc.topic("joint_states"), reliable) if stream else None
            try:
                if stream and not cl.spin_until(lambda c=cl: len(c.cmd_cb) > 100, 30.0):
                    raise RuntimeError(f"{label}: the node does not step\n{proc.log_tail()}")
                t0 = time.time_ns()
                t = list_rtts_us(ros, proc, a.calls, warm=10)  # cl is not spun: commands queue
                t1 = time.time_ns()
                cl.spin_for(0.3)
                row = {"calls": a.calls, "p50_us": pct(t, 50), "p99_us": pct(t, 99)}
                got = sum(t0 <= rx <= t1 for rx in cl.cmd_rx)  # received while timing
                row["steps_hz_meanwhile"] = round(got / ((t1 - t0) * 1e-9), 1)
                out["modes"][label] = row
            finally:
                if sp is not None:
                    stop_streamer(sp)
                cl.close()
                proc.stop()
        print(f"{label:20s} list p50/p99 {out['modes'][label]}", flush=True)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
