"""Why the node does not use rclpy's EventsExecutor (rclpy.experimental), measured.

    python3 bench/events_executor_probe.py [--calls N] [--out FILE]

Each server is a process of its own (this script with --serve MODE) holding one node with a
subscription, a trivial ListCapsules service and a 10 Hz timer; every callback prints one line,
so the parent sees what was dispatched even when the server's Python threads are stuck. Modes:
`events-spin` (EventsExecutor.spin()), `events-once` (EventsExecutor.spin_once(0.1) in a loop)
and `single` (SingleThreadedExecutor.spin_once(0.1) in a loop, as the bare service floor of
ros_bench). The parent publishes 20 messages and times N service round trips from one client
(a call unanswered within 0.5 s counts as lost; three lost in a row end the mode). A fourth
check builds an EventsExecutor over a node with a guard condition, as the node's service host,
rollout and flight threads use them to wake its loops; the last two create a timer from the main
thread while spin() (or a spin_once loop) runs on another.

DDS stays on loopback (a fresh ROS_DOMAIN_ID, LOCALHOST discovery). Needs `make build` (the
flashrt_ros interfaces); no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

# events-spin last: its server ignores signals and is killed, which leaves Fast DDS shared-memory
# ports behind that a later process may fail to open (it then receives nothing)
MODES = ("single", "events-once", "events-spin")


def names(mode: str, run: str) -> tuple[str, str]:
    """The topic and service of one mode in one run: names of their own, so that no endpoint
    of a killed server (which DDS keeps until its lease ends) is taken for this one."""
    tag = f"{mode.replace('-', '_')}_{run}"
    return f"probe_in_{tag}", f"probe_list_{tag}"


def serve(mode: str, run: str) -> int:
    """One server node; prints `sub`, `srv` or `timer` per callback, then spins until killed."""
    import rclpy
    from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
    from rclpy.experimental import EventsExecutor
    from std_msgs.msg import Float64MultiArray

    from flashrt_ros.srv import ListCapsules

    rclpy.init()
    node = rclpy.create_node("events_probe_server")
    topic, service = names(mode, run)
    node.create_subscription(Float64MultiArray, topic, lambda _m: print("sub", flush=True), 10)

    def handler(_req, resp):
        print("srv", flush=True)
        return resp

    node.create_service(ListCapsules, service, handler)
    node.create_timer(0.1, lambda: print("timer", flush=True))
    ex = SingleThreadedExecutor() if mode == "single" else EventsExecutor()
    ex.add_node(node)
    print("up", flush=True)
    try:
        if mode == "events-spin":
            ex.spin()
        else:
            while rclpy.ok():
                ex.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


def guard_condition_check() -> str:
    """What an EventsExecutor does with a node that holds a guard condition ("ok" if it spins)."""
    code = (
        "import os, rclpy\n"
        "from rclpy.experimental import EventsExecutor\n"
        "rclpy.init(); n = rclpy.create_node('events_probe_guard')\n"
        "n.create_guard_condition(lambda: None)\n"
        "ex = EventsExecutor(); ex.add_node(n)\n"
        "try:\n    ex.spin_once(timeout_sec=0.2); print('ok', flush=True)\n"
        "except Exception as e:\n    print(f'{type(e).__name__}: {e}', flush=True)\n"
        "os._exit(0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    return lines[-1] if lines else f"no answer (exit {out.returncode})"


def add_while_spinning(spin: str) -> str:
    """Create a timer from the main thread while `spin` ("spin" or a spin_once loop) runs the
    EventsExecutor on another thread, as a node creating an entity after start-up does."""
    code = (
        "import os, threading, time, rclpy\n"
        "from rclpy.experimental import EventsExecutor\n"
        "rclpy.init(); n = rclpy.create_node('events_probe_add')\n"
        "ex = EventsExecutor(); ex.add_node(n)\n"
        "def loop():\n    while True: ex.spin_once(timeout_sec=0.1)\n"
        f"threading.Thread(target={'ex.spin' if spin == 'spin' else 'loop'}, daemon=True).start()\n"
        "time.sleep(0.5); print('creating', flush=True)\n"
        "n.create_timer(0.1, lambda: None)\n"
        "print('created', flush=True); os._exit(0)\n"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=15, check=False
        )
    except subprocess.TimeoutExpired as e:  # what it printed tells where the main thread stopped
        said = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        if "creating" in said:
            return "create_timer never returned (15 s; the main thread had run on to call it)"
        return "the main thread never woke from a 0.5 s sleep (15 s)"
    return out.stdout.split()[-1] if out.stdout.split() else f"no answer (exit {out.returncode})"


def probe_mode(ros, mode: str, calls: int) -> dict:
    """Start a server in `mode`, exercise it, kill it; what it dispatched and the round trips."""
    import numpy as np
    from std_msgs.msg import Float64MultiArray

    from flashrt_ros.srv import ListCapsules

    env = dict(os.environ, ROS_DOMAIN_ID=str(ros.domain_id), PYTHONUNBUFFERED="1")
    env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    out_f, err_f = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")  # never a full pipe
    p = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", mode, "--run", str(os.getpid())],
        stdout=out_f,
        stderr=err_f,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    killed, ready = False, False
    try:
        topic, service = names(mode, str(os.getpid()))
        pub = ros.node.create_publisher(Float64MultiArray, topic, 10)
        cli = ros.node.create_client(ListCapsules, service)
        ready = ros.spin_until(
            lambda: pub.get_subscription_count() > 0 and cli.service_is_ready(), 20
        )
        ros.spin_for(0.5)  # the server's side of the match too: early samples can be lost
        for i in range(20):
            pub.publish(Float64MultiArray(data=[float(i)]))
            ros.spin_for(0.005)
        rtts, lost, run = [], 0, 0
        for _ in range(calls):
            t0 = time.perf_counter()
            fut = cli.call_async(ListCapsules.Request())
            ros.spin_until(fut.done, 0.5)
            if fut.done():
                rtts.append((time.perf_counter() - t0) * 1e6)
                run = 0
            else:
                cli.remove_pending_request(fut)
                lost, run = lost + 1, run + 1
                if run == 3:
                    break
        ros.spin_for(0.3)
        ros.node.destroy_publisher(pub)
        ros.node.destroy_client(cli)
    finally:
        p.send_signal(signal.SIGINT)  # a clean exit frees its shared-memory ports
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)
            killed = True
    out_f.seek(0)
    err_f.seek(0)
    lines, err = out_f.read().split(), err_f.read()
    a = np.asarray(rtts) if rtts else None
    return {
        # the server came up and was found: zero dispatches are then the executor's
        "server_up": "up" in lines,
        "endpoints_matched": bool(ready),
        "server_exit": p.returncode,
        "killed_after_sigint": killed,
        "server_error": err.strip()[-300:] if "Traceback" in err else "",
        "messages_dispatched": lines.count("sub"),
        "requests_dispatched": lines.count("srv"),
        "timer_callbacks": lines.count("timer"),
        "replies": len(rtts),
        "lost_calls": lost,
        "rtt_p50_us": round(float(np.percentile(a, 50)), 1) if a is not None else None,
        "rtt_p99_us": round(float(np.percentile(a, 99)), 1) if a is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400, help="service calls per mode (400)")
    ap.add_argument("--out", type=Path, help="write the result as JSON here too")
    ap.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--run", default="0", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.serve, args.run)
    if args.calls < 1:
        ap.error("--calls must be at least 1")
    import importlib.metadata

    from test.ros_helpers import ros_harness

    result = {
        "rclpy": importlib.metadata.version("rclpy"),
        "rmw": os.environ.get("RMW_IMPLEMENTATION", ""),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "calls": args.calls,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": " ".join(["python3", "bench/events_executor_probe.py", *(argv or sys.argv[1:])]),
    }
    with ros_harness(Path("/tmp") / f"events_probe_{os.getpid()}") as ros:
        for mode in MODES:
            result[mode] = probe_mode(ros, mode, args.calls)
            print(f"{mode}: {result[mode]}", flush=True)
        # in the harness: its fresh ROS_DOMAIN_ID is in os.environ, which these inherit
        result["guard_condition"] = guard_condition_check()
        print(f"guard condition: {result['guard_condition']}", flush=True)
        for how in ("spin", "spin_once"):
            result[f"create_timer_while_{how}"] = add_while_spinning(how)
            print(f"create_timer while {how}(): {result[f'create_timer_while_{how}']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
