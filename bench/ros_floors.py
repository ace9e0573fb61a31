"""Bare-rclpy floors for bench/ros_bench.py: what plain rclpy nodes cost on the same machine.

Each floor is a separate process running a plain rclpy node (one SingleThreadedExecutor in the
main thread), started by ros_bench.py in the harness's domain with LOCALHOST discovery:

    python bench/ros_floors.py echo          # joint_states (JointState, depth 100 as the node's
                                             #   observation trigger) -> commands (Float64MultiArray
                                             #   of the positions, depth 10)
    python bench/ros_floors.py service [busy]  # ~/list_capsules (flashrt_ros/ListCapsules),
                                             #   answers with an empty response at once; busy:
                                             #   the executor polls (spin_once with no wait)
                                             #   instead of sleeping, as the node's busy_wait
                                             #   serving thread never sleeps
    python bench/ros_floors.py timer RATE [PRIO] [busy]  # a thread with absolute deadlines
                                             #   and the node's sleep-then-spin wait (flashrt_ros/
                                             #   node/loop.py TimerLoop) publishing commands, no
                                             #   work; PRIO: SCHED_FIFO priority, as the node's
                                             #   realtime_priority; busy: yield the CPU in a loop
                                             #   instead of sleeping, as the node's busy_wait
    python bench/ros_floors.py image         # image_raw (sensor_msgs/Image) -> image_echo, the
                                             #   same message object published back as-is
    python bench/ros_floors.py cameras       # camera/{top,wrist}/image_raw taken serialized, as
                                             #   the node takes them, each image acknowledged on
                                             #   a latched ~/camera_seen (the node acknowledges
                                             #   the images it took together once; camera_intake.py)
    python bench/ros_floors.py start [DEVICE]  # start-up: rclpy, then import torch and one
                                             #   tensor on DEVICE (cuda), then joint_states ->
                                             #   commands through that device: what any node
                                             #   that steps a torch policy pays before its first
                                             #   command (vs the node's warm start)

SIGINT or SIGTERM ends a floor cleanly (exit 0); the timer floor then prints one JSON line with
its own loop statistics (wake-up lateness, overruns).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOOR_NAME = "flashrt_floor"

try:  # the same spin margin as the node's loop; its module may be mid-edit: fall back
    from flashrt_ros.node.loop import SPIN_S
except Exception:  # pragma: no cover
    SPIN_S = 0.0002


def launch_floor(ros, kind: str, *args: str, log_dir: Path, env: dict | None = None, tag: str = ""):
    """Start a floor process in `ros`'s domain (LOCALHOST discovery), in `env` (default: this
    process's); returns a NodeProcess (test/ros_helpers.py) that the harness stops (SIGINT)
    when it closes. `tag` names its log apart from another floor of the same kind."""
    from test.ros_helpers import NodeProcess

    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    name = "_".join((f"floor_{kind}", *args, *([tag] if tag else []), str(os.getpid())))
    log_path = log_dir / f"{name}.log"
    env = dict(os.environ if env is None else env)
    env["ROS_DOMAIN_ID"] = str(ros.domain_id)
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    env.pop("ROS_LOCALHOST_ONLY", None)
    env.pop("ROS_STATIC_PEERS", None)
    env["PYTHONUNBUFFERED"] = "1"
    with open(log_path, "wb") as log:
        cmd = [sys.executable, str(Path(__file__).resolve()), kind, *args]
        log.write(f"$ {' '.join(cmd)}\n".encode())
        log.flush()
        p = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    proc = NodeProcess(p, log_path, FLOOR_NAME, "")
    ros.processes.append(proc)
    return proc


def floor_summary(proc) -> dict:
    """The last JSON line a floor printed to its log (the timer floor's loop statistics)."""
    try:
        lines = proc.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict):
            return d
    return {}


# ------------------------------------------------------------------------------------------------
def _timer_thread(
    node, pub, rate: float, stop: threading.Event, stats: dict, busy: bool = False
) -> None:
    """TimerLoop._run without the tick: absolute deadlines, sleep (busy: yield the CPU in a
    loop, never sleeping), spin the last SPIN_S."""
    if busy:
        from flashrt_ros.node.loop import precise_sleeps

        precise_sleeps()  # as the node's control thread
    from std_msgs.msg import Float64MultiArray

    from flashrt_ros.node.loop import after_tick

    period = 1.0 / rate
    msg = Float64MultiArray()
    late: list[float] = []
    overruns = delayed = k = 0
    was_late = False
    deadline = time.monotonic() + period
    while not stop.is_set():
        remaining = deadline - time.monotonic()
        if busy:
            while deadline - time.monotonic() > SPIN_S and not stop.is_set():
                os.sched_yield()
            if stop.is_set():
                break
        elif remaining > SPIN_S and stop.wait(remaining - SPIN_S):
            break
        while time.monotonic() < deadline:
            pass
        late.append(time.monotonic() - deadline)
        msg.data = [float(k)] * 6
        try:
            pub.publish(msg)
        except Exception:  # the context went away under us: stop quietly
            break
        k += 1
        # past the next deadline: that tick runs late, or is skipped (as TimerLoop)
        deadline, missed, was_late = after_tick(
            deadline + period, time.monotonic(), period, may_delay=not was_late
        )
        overruns += missed
        delayed += was_late
    late_us = sorted(x * 1e6 for x in late[100:] or late)  # past the first ~0.1-0.2 s
    q = lambda p: round(late_us[min(len(late_us) - 1, int(p / 100 * len(late_us)))], 1)  # noqa: E731
    stats.update(
        published=k,
        overruns=overruns,
        delayed_ticks=delayed,
        wake_late_p50_us=q(50) if late_us else None,
        wake_late_p99_us=q(99) if late_us else None,
        wake_late_max_us=round(late_us[-1], 1) if late_us else None,
    )


def floor_main(
    kind: str, rate: float | None, priority: int = 0, busy: bool = False, device: str = "cuda"
) -> int:
    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.signals import SignalHandlerOptions

    stop = threading.Event()
    # no rclpy signal handlers: a signal only sets `stop`, the context stays valid until the end
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    node = rclpy.create_node(FLOOR_NAME)
    stats: dict = {"floor": kind}
    thread = None
    if kind == "echo":
        from sensor_msgs.msg import JointState
        from std_msgs.msg import Float64MultiArray

        pub = node.create_publisher(Float64MultiArray, "commands", 10)

        def on_js(msg) -> None:
            out = Float64MultiArray()
            out.data = list(msg.position)
            pub.publish(out)

        node.create_subscription(JointState, "joint_states", on_js, 100)
    elif kind == "start":
        from flashrt_ros.node import bytecode
        from flashrt_ros.node.main import process_age_s

        bytecode.enable()  # as the node's main(): where torch has no .pyc, a cache of ours
        t = time.monotonic()
        stats["process_rclpy_s"] = round(process_age_s(), 3)  # interpreter, rclpy, the node
        import torch  # after rclpy, as the node imports it
        from sensor_msgs.msg import JointState
        from std_msgs.msg import Float64MultiArray

        stats["import_torch_s"] = round(-t + (t := time.monotonic()), 3)
        x = torch.zeros(6, device=device)  # the device's context, as the Engine needs one
        stats["device_s"] = round(time.monotonic() - t, 3)
        pub = node.create_publisher(Float64MultiArray, "commands", 10)

        def on_js(msg) -> None:
            q = list(msg.position[:6]) + [0.0] * (6 - len(msg.position[:6]))
            y = x + torch.tensor(q).to(device)  # up, through the device, and back
            pub.publish(Float64MultiArray(data=y.cpu().tolist()))

        from rclpy.qos import qos_profile_sensor_data  # as the node's timer mode and streamer

        node.create_subscription(JointState, "joint_states", on_js, qos_profile_sensor_data)
    elif kind == "image":
        from sensor_msgs.msg import Image

        pub = node.create_publisher(Image, "image_echo", 10)
        node.create_subscription(Image, "image_raw", pub.publish, 10)
    elif kind == "cameras":  # camera_intake.py: two cameras taken serialized, each acknowledged
        from rclpy.qos import QoSDurabilityPolicy, QoSProfile
        from sensor_msgs.msg import Image
        from std_msgs.msg import UInt64MultiArray

        latched = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
        seen_pub = node.create_publisher(UInt64MultiArray, "~/camera_seen", latched)
        counts = [0, 0]  # per camera: the node's (received, accepted) pairs, both the same here

        def on_image(i: int, raw: bytes) -> None:
            counts[i] += 1
            seen_pub.publish(UInt64MultiArray(data=[v for c in counts for v in (c, c)]))

        for i, cam in enumerate(("top", "wrist")):
            node.create_subscription(
                Image, f"camera/{cam}/image_raw", partial(on_image, i), 10, raw=True
            )
        seen_pub.publish(UInt64MultiArray(data=[0, 0, 0, 0]))
    elif kind == "service":
        from flashrt_ros.srv import ListCapsules

        node.create_service(ListCapsules, "~/list_capsules", lambda req, resp: resp)
    elif kind == "timer":
        from std_msgs.msg import Float64MultiArray

        if not rate:
            print("ros_floors: timer needs a rate", file=sys.stderr)
            return 2
        # as the node's main(): the control thread gets the GIL back promptly
        sys.setswitchinterval(0.0005)
        pub = node.create_publisher(Float64MultiArray, "commands", 10)
        thread = threading.Thread(
            target=_timer_thread, args=(node, pub, rate, stop, stats, busy), daemon=True
        )
        stats["busy_wait"] = busy
    else:
        print(f"ros_floors: unknown floor {kind!r}", file=sys.stderr)
        return 2
    ex = SingleThreadedExecutor()
    ex.add_node(node)
    print(f"ros_floors: {kind} up (pid {os.getpid()})", flush=True)
    if thread is not None:
        thread.start()
        if priority > 0:  # as the node's realtime_priority does for its control thread
            from flashrt_ros.node.loop import set_realtime

            why = set_realtime(thread, priority)
            stats["realtime_priority"] = priority if not why else f"not applied: {why}"
    # busy service floor: poll, as the node's serving thread does with busy_wait (its thread's
    # CPU never idles between requests, so it pays no wake-up from an idle state)
    wait_s = 0.0 if busy and kind == "service" else 0.05
    try:
        while not stop.is_set():
            ex.spin_once(timeout_sec=wait_s)
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=5.0)
        ex.shutdown(timeout_sec=1.0)
        node.destroy_node()
        rclpy.shutdown()
    if kind in ("timer", "start"):
        print(json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    if sys.argv[1] == "start":
        sys.exit(floor_main("start", None, device=sys.argv[2] if len(sys.argv) > 2 else "cuda"))
    nums = [a for a in sys.argv[2:] if a != "busy"]  # timer RATE [PRIO]
    rate = float(nums[0]) if nums else None
    prio = int(nums[1]) if len(nums) > 1 else 0
    sys.exit(floor_main(sys.argv[1], rate, prio, busy="busy" in sys.argv[2:]))
