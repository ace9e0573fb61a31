"""End-to-end ROS 2 benchmark of the installed flashrt_node ("ros" object: bench/README.md).

    . ./env.sh && python bench/ros_bench.py --device cuda --out OUT/ros.json
    . ./env.sh && python bench/ros_bench.py --device cpu --out /tmp/ros.json --quick   # smoke

Starts install/flashrt_ros/lib/flashrt_ros/flashrt_node as a subprocess (one per scenario, each
in a fresh ROS_DOMAIN_ID with LOCALHOST discovery) and measures from a client in this process:

  (a) timer trigger at each --rates value, observations streamed at the same rate by a helper
      process (this script with --stream): achieved command rate, command inter-arrival jitter
      p99 (|dt - period|) at the client, and the node's own /diagnostics (jitter_p99_us, overruns,
      step p50/p99);
  (b) observation trigger, lockstep: time from publishing a joint_states message to receiving its
      command (p50/p99);
  (c) Checkpoint / Restore / ListCapsules round trips while the node runs the timer at 500 Hz;
  (d) start-up, first: seconds from spawning the node (timer trigger at 500 Hz, joint_states
      already streaming) to the first command received, cold (compile_cache_dir, and
      TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, a new empty folder) then warm (the same
      folder again);
  (f) the flight recorder: the 1 kHz timer for --seconds-flight with `flight_ticks: 1000` and
      without ("flight_1khz": rate, overruns, node and client jitter p99, node step p50);
  (e) the bare-rclpy floors (bench/ros_floors.py, separate processes with plain rclpy nodes),
      measured with the same client code: a JointState -> Float64MultiArray echo (as (b)), a
      ListCapsules service answering at once (as (c)), a timer thread at 500 Hz and 1 kHz with the
      node loop's wait and no work (as (a)), and a 640x480 rgb8 Image echo.

The 1 kHz rate runs --seconds-1khz (60 s; --quick 5 s) with publish_offset_s --offset-1khz
(0.0006: each command at a fixed phase after its deadline, as a user who cares about the
robot's command timing sets it): its overruns (periods skipped: since 3c9a838 a tick that
ran into the next period delays that tick, once, rather than skip it) are `overruns_1khz_60s`,
the delayed ticks `delayed_ticks_1khz_60s` (before 3c9a838 each of those was an overrun), and
its client-side jitter `client_jitter_p99_us_1khz`; with an offset the 1 kHz rate also runs
--seconds without one (`*_1khz_no_offset`). The 1 kHz timer floor runs as long, by the same
rule (`floor_overruns_1khz`: a thread doing no work misses deadlines too when the machine
stalls it). The node's CPU use (utime +
stime from /proc/<pid>/stat, percent of one core) is measured over each timer window. Every
figure that has a floor is reported beside it and as ours - floor (`vs_floor`).

Client-side times are given two ways: `dds` uses the DDS reception timestamp of the command
(rmw MessageInfo.received_timestamp, taken when the client's reader got the sample, before the
Python executor dispatches it); `cb` uses time.monotonic() in the Python callback (adds this
client's executor overhead). Headline numbers use `dds` when the rmw fills it in, else `cb`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from flashrt_ros.node.fastdds import PROFILE_VAR

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

JOINTS = [f"joint{i}" for i in range(1, 7)]


def log(*a) -> None:
    print("[ros_bench]", *a, flush=True)


def pct(a, q) -> float | None:
    a = np.asarray(a, dtype=float)
    return round(float(np.percentile(a, q)), 1) if a.size else None


def obs_row(k: int) -> tuple[list[float], list[float]]:
    t = k * 0.002
    w = 2 * np.pi * (0.3 + 0.1 * np.arange(6))
    return (0.5 * np.sin(w * t)).tolist(), (0.5 * w * np.cos(w * t)).tolist()


# ------------------------------------------------------------------------------------------------
# --stream: a helper process that publishes joint_states at a fixed rate (absolute deadlines)
def stream_main(rate: float, seconds: float, topic: str, reliable: bool = False) -> int:
    """Publish joint_states until `seconds` pass or SIGTERM/SIGINT; exit 0 without a traceback.
    QoS: sensor data (best effort, as the timer trigger's subscription), or `reliable` (depth
    100, as the observation trigger's: a best-effort writer never matches a reliable reader).

    rclpy installs no signal handlers here (they would shut the context down under the publish
    loop): a signal only sets a flag, the loop stops publishing, then the node and the context
    are torn down. A context shut down from elsewhere ends the loop the same way."""
    import rclpy
    from rclpy.signals import SignalHandlerOptions
    from sensor_msgs.msg import JointState

    stop = {"flag": False}
    rclpy.init(signal_handler_options=SignalHandlerOptions.NO)
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))
    from rclpy.qos import QoSProfile, qos_profile_sensor_data

    ctx = rclpy.get_default_context()
    node = rclpy.create_node(f"flashrt_bench_streamer_{os.getpid()}")
    qos = QoSProfile(depth=100) if reliable else qos_profile_sensor_data
    pub = node.create_publisher(JointState, topic, qos)
    period = 1.0 / rate
    msg = JointState(name=list(JOINTS))
    n = late = 0
    ended = "time"
    try:
        deadline = time.monotonic() + 20.0
        while not stop["flag"] and time.monotonic() < deadline:
            if pub.get_subscription_count() > 0:
                break
            time.sleep(0.01)
        t_end = time.monotonic() + seconds
        nxt = time.monotonic()
        while not stop["flag"] and time.monotonic() < t_end:
            rem = nxt - time.monotonic()
            if rem > 0.0003:
                time.sleep(rem - 0.0003)
            while time.monotonic() < nxt:
                pass
            if stop["flag"] or not ctx.ok():
                break
            msg.position, msg.velocity = obs_row(n)
            pub.publish(msg)
            n += 1
            nxt += period
            if time.monotonic() > nxt:  # we are behind: do not burst, skip the lost slots
                late += 1
                nxt = time.monotonic() + period
    except Exception as e:  # the context went away under the loop (RCLError): stop quietly
        if ctx.ok():
            raise
        ended = f"context shut down ({type(e).__name__})"
    if stop["flag"]:
        ended = "signal"
    print(json.dumps({"published": n, "late": late, "ended": ended}), flush=True)
    with contextlib.suppress(Exception):
        node.destroy_node()
    with contextlib.suppress(Exception):
        if ctx.ok():
            rclpy.shutdown()
    return 0


# ------------------------------------------------------------------------------------------------
class ServiceCaller:
    """Service clients on a node and an executor of their own. The harness node also takes the
    node's commands (500 Hz while the loop runs) and /diagnostics: spinning its executor for a
    reply ran those callbacks first, so the client's own Python was timed with our service and
    not with the floor's. Both are now timed by this one, which has nothing else to do."""

    def __init__(self, ros) -> None:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor

        self.node = rclpy.create_node(
            f"flashrt_bench_services_{os.getpid()}",
            context=ros.context,
            enable_rosout=False,
            start_parameter_services=False,
        )
        self.ex = SingleThreadedExecutor(context=ros.context)
        self.ex.add_node(self.node)

    def client(self, srv_type, name: str):
        return self.node.create_client(srv_type, name)

    def call(self, client, request, timeout: float = 30.0):
        """Round trip of one service call (s), with the reply."""
        t0 = time.perf_counter()
        fut = client.call_async(request)
        end = time.monotonic() + timeout
        while not fut.done():
            if time.monotonic() > end:
                fut.cancel()
                raise TimeoutError(f"no reply from {client.srv_name} in {timeout} s")
            self.ex.spin_once(timeout_sec=0.01)
        dt = time.perf_counter() - t0
        if fut.exception() is not None:
            raise fut.exception()
        return dt, fut.result()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ex.shutdown(timeout_sec=0)
            self.node.destroy_node()


class Client:
    """Subscriptions and a persistent executor on the harness node."""

    def __init__(self, ros, proc, reply: str = "commands", reply_type=None):
        """`reply`: the topic (relative to proc's namespace) whose messages are the commands
        timed here, of `reply_type` (Float64MultiArray); floors use the same client."""
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        from sensor_msgs.msg import JointState
        from std_msgs.msg import Float64MultiArray

        self.ros, self.proc, n = ros, proc, ros.node
        reply_type = reply_type or Float64MultiArray
        self.cmd_cb: list[int] = []  # monotonic ns in the callback
        self.cmd_rx: list[int] = []  # DDS received_timestamp (system clock ns), 0 if unset
        self.cmd_src: list[int] = []  # DDS source_timestamp (node's publish, system clock ns)
        self.cmd_vals: list = []  # the commands' values (the camera scenario reads them)
        self.diag: list[tuple[float, dict]] = []
        self._subs = [
            n.create_subscription(reply_type, proc.topic(reply), self._on_cmd, 1000),
            n.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 10),
        ]
        self._js = n.create_publisher(JointState, proc.topic("joint_states"), 100)
        self._msg = JointState(name=list(JOINTS))
        self.ex = SingleThreadedExecutor(context=ros.context)
        self.ex.add_node(n)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ex.remove_node(self.ros.node)
            self.ex.shutdown(timeout_sec=0)
        for s in self._subs:
            with contextlib.suppress(Exception):
                self.ros.node.destroy_subscription(s)
        with contextlib.suppress(Exception):
            self.ros.node.destroy_publisher(self._js)

    def _on_cmd(self, msg, info) -> None:  # two parameters: rclpy then passes MessageInfo
        self.cmd_cb.append(time.monotonic_ns())
        self.cmd_rx.append(int(info.get("received_timestamp", 0) or 0))
        self.cmd_src.append(int(info.get("source_timestamp", 0) or 0))
        if hasattr(msg, "data") and not hasattr(msg, "encoding"):
            self.cmd_vals.append(msg.data)

    def _on_diag(self, msg, info) -> None:
        src = int(info.get("source_timestamp", 0) or 0)  # when the node wrote it (wall, ns)
        for st in msg.status:
            if "flashrt" in st.name and self.proc.fqn in st.name:
                self.diag.append((src, {kv.key: kv.value for kv in st.values}))

    def spin_until(self, pred, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not pred():
            left = end - time.monotonic()
            if left <= 0:
                return bool(pred())
            self.ex.spin_once(timeout_sec=min(left, 0.05))
        return True

    def spin_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.ex.spin_once(timeout_sec=min(left, 0.05))

    def wait_subscribed(self, timeout: float = 20.0, pub=None) -> None:
        """Until the node subscribes joint_states (or what `pub` publishes)."""
        pub = pub or self._js
        if not self.spin_until(lambda: pub.get_subscription_count() > 0, timeout):
            raise RuntimeError(f"nobody subscribes {pub.topic_name}\n" + self.proc.log_tail())

    def wait_replier(self, timeout: float = 20.0) -> None:
        """Until this client's reply subscription sees the node's publisher."""
        sub = self._subs[0]
        if not self.spin_until(lambda: sub.get_publisher_count() > 0, timeout):
            raise RuntimeError(f"nobody publishes {sub.topic_name}\n" + self.proc.log_tail())

    def publish_obs(self, k: int) -> None:
        self._msg.position, self._msg.velocity = obs_row(k)
        self._js.publish(self._msg)

    def latest_diag(self, timeout: float = 3.0) -> dict:
        """The first /diagnostics the node wrote after this call. Messages written while this
        client was not spun wait in its subscription's history, oldest first: after a window
        of several seconds (the service calls) the next one taken was from before it."""
        t0, n = time.time_ns(), len(self.diag)
        # a middleware that stamps no source time (0): the message is taken as it comes
        after = lambda: [d for src, d in self.diag[n:] if src >= t0 or not src]  # noqa: E731
        self.spin_until(lambda: bool(after()), timeout)
        fresh = after()
        if not fresh:  # an older message would pass for this moment's: none
            log(f"no /diagnostics from {self.proc.fqn} written in the {timeout:g} s after asking")
            return {}
        return fresh[0]


def diag_numbers(d: dict) -> dict:
    out = {}
    for k in (
        "rate_hz",
        "steps",
        "step_p50_us",
        "step_p99_us",
        "jitter_p99_us",
        "overruns",
        "overruns_late_wake",
        "overruns_long_tick",
        "overruns_collector",
        "delayed_ticks",
        "last_overrun",
        "refused_inputs",
        "stale_ticks",
        "service_p50_us",
        "service_p99_us",
        "service_queue_p50_us",
        "service_queue_p99_us",
        "service_reply_p50_us",
        "service_lock_wait_p50_us",
        "device",
        "state",
    ):
        if k in d:
            try:
                out[k] = float(d[k]) if k not in ("device", "state", "last_overrun") else d[k]
            except ValueError:
                out[k] = d[k]
    return out


def start_node(ros, params: dict, timeout: float):
    """Start flashrt_node and wait until it answers ListCapsules (configured and spinning)."""
    from flashrt_ros import srv

    t0 = time.monotonic()
    proc = ros.start_node(
        params, wait_services=("list_capsules", "checkpoint", "restore"), timeout=timeout
    )
    cli = ros.client(srv.ListCapsules, proc.service("list_capsules"))
    left = max(5.0, timeout - (time.monotonic() - t0))
    end = time.monotonic() + left
    while True:  # in short tries: a node that exits (a failed configure) is seen at once
        try:
            ros.call(cli, srv.ListCapsules.Request(), timeout=2.0)
            break
        except Exception as e:
            if proc.alive() and time.monotonic() < end:
                continue
            why = "exited" if not proc.alive() else f"did not answer ListCapsules in {left:.0f} s"
            raise RuntimeError(
                f"{proc} offered services but {why} ({e!r}); log tail:\n{proc.log_tail()}"
            ) from e
    startup = time.monotonic() - t0
    log(f"node up in {startup:.1f} s ({params})")
    return proc, startup


def node_params(args, **extra) -> dict:
    p = {"device": args.device, "policy": args.policy, "obs_timeout_s": 0.5}
    if args.realtime_priority:
        p["realtime_priority"] = args.realtime_priority
    if args.busy_wait:
        p["busy_wait"] = True
    if args.cpu_affinity:
        p["cpu_affinity"] = args.cpu_affinity
    p.update(extra)
    import yaml

    for item in getattr(args, "node_param", None) or []:  # last: the user's word wins
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--node-param {item!r}: expected NAME=VALUE")
        p[name] = yaml.safe_load(value)
    return p


def streamer(rate: float, seconds: float, topic: str, reliable: bool = False) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--stream",
        str(rate),
        "--seconds",
        str(seconds),
        "--topic",
        topic,
        *(["--reliable"] if reliable else []),
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def stop_streamer(sp: subprocess.Popen) -> dict:
    """SIGTERM the streamer; its summary line, exit status, and any traceback it printed."""
    if sp.poll() is None:
        sp.send_signal(signal.SIGTERM)
    try:
        out, _ = sp.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        sp.kill()
        out, _ = sp.communicate()
    out = out or ""
    info: dict = {"output": out[-500:]}
    for line in reversed(out.splitlines()):
        with contextlib.suppress(ValueError):
            info = json.loads(line)
            break
    info["rc"] = sp.returncode
    if "Traceback" in out:
        info["traceback"] = out[out.index("Traceback") :][-1500:]
    return info


def jitter_stats(stamps_ns: list[int], period_s: float) -> dict:
    t = np.asarray(stamps_ns, dtype=np.int64)
    if t.size < 3 or not np.all(t > 0):
        return {}
    dt = np.diff(t) * 1e-3  # us
    dev = np.abs(dt - period_s * 1e6)
    return {
        "jitter_p50_us": pct(dev, 50),
        "jitter_p99_us": pct(dev, 99),
        "jitter_max_us": round(float(dev.max()), 1),
        "interval_p50_us": pct(dt, 50),
        "rate_hz": round((t.size - 1) / ((t[-1] - t[0]) * 1e-9), 1),
    }


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (s), from /proc/<pid>/stat; None where unreadable."""
    try:
        txt = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = txt.rsplit(")", 1)[1].split()  # f[0] is field 3 (state): utime is field 14, stime 15
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def measure_window(cl: Client, rate: float, seconds: float, pid: int | None = None) -> dict:
    """Commands received over `seconds`: rate, period jitter three ways, and the CPU use of
    process `pid` (percent of one core) over the same window."""
    c0 = cpu_seconds(pid) if pid else None
    i0, t0 = len(cl.cmd_cb), time.monotonic_ns()
    cl.spin_for(seconds)
    i1, t1 = len(cl.cmd_cb), time.monotonic_ns()
    c1 = cpu_seconds(pid) if pid else None
    wall = (t1 - t0) * 1e-9
    row = {
        "target_hz": rate,
        "seconds": round(wall, 2),
        "commands": i1 - i0,
        "achieved_hz": round((i1 - i0) / wall, 1),
    }
    cb = jitter_stats(cl.cmd_cb[i0:i1], 1.0 / rate)
    rx = jitter_stats(cl.cmd_rx[i0:i1], 1.0 / rate)
    src = jitter_stats(cl.cmd_src[i0:i1], 1.0 / rate)
    row["client_cb"] = cb
    row["client_dds"] = rx
    row["node_publish"] = src
    row["basis"] = "dds" if rx else "cb"
    row["period_jitter_p99_us"] = (rx or cb).get("jitter_p99_us")
    row["cpu_pct"] = (
        round(100.0 * (c1 - c0) / wall, 1) if c0 is not None and c1 is not None else None
    )
    return row


def lockstep(cl: Client, n: int, publish, warm: int = 50, period: float = 0.0) -> tuple[list, list]:
    """Publish one message, wait for its reply, n times (after `warm` untimed ones): the
    latencies in us, in the client callback (cb) and from the DDS reception stamp (dds).
    A warm-up message without a reply in 1 s (discovery not finished) is skipped. With
    `period`, each message goes out `period` s after the one before (as a camera's frames
    do), not as soon as the reply is in."""
    lat_cb, lat_rx = [], []
    nxt = time.monotonic()
    for k in range(n + warm):
        if period:
            cl.spin_for(nxt - time.monotonic())
            nxt = max(nxt + period, time.monotonic())
        m = len(cl.cmd_cb)
        t_wall = time.time_ns()
        t_mono = time.monotonic_ns()
        publish(k)
        if not cl.spin_until(lambda m=m: len(cl.cmd_cb) > m, 1.0 if k < warm else 10.0):
            if k < warm:
                continue
            raise RuntimeError(f"no reply to message {k}\n{cl.proc.log_tail()}")
        if k >= warm:
            lat_cb.append((cl.cmd_cb[-1] - t_mono) * 1e-3)
            if cl.cmd_rx[-1] > 0:
                lat_rx.append((cl.cmd_rx[-1] - t_wall) * 1e-3)
    return lat_cb, lat_rx


def block_p50s(lat: list, block: int = 50) -> list:
    """p50 of each `block` samples in order (us): where a scenario's latency changed, if it
    did (the camera "slow mode" set in partway through a run)."""
    return [pct(lat[i : i + block], 50) for i in range(0, len(lat), block)]


def latency_summary(lat_cb: list, lat_rx: list) -> dict:
    basis = "dds" if lat_rx and len(lat_rx) == len(lat_cb) else "cb"
    head = lat_rx if basis == "dds" else lat_cb
    return {
        "samples": len(lat_cb),
        "basis": basis,
        "p50_us": pct(head, 50),
        "p99_us": pct(head, 99),
        "cb_p50_us": pct(lat_cb, 50),
        "cb_p99_us": pct(lat_cb, 99),
        "dds_p50_us": pct(lat_rx, 50),
        "dds_p99_us": pct(lat_rx, 99),
        "p50_us_by_50": block_p50s(head),
    }


# ------------------------------------------------------------------------------------------------
def run_key(row: dict) -> str:
    """A timer run's name in the summary: its rate, and "_offset" with a publish offset."""
    return f"{int(row['target_hz'])}" + ("_offset" if row.get("publish_offset_s") else "")


def run_timer(
    ros,
    args,
    rate: float,
    seconds: float,
    services: bool,
    offset: float = 0.0,
    extra: dict | None = None,
) -> tuple[dict, dict | None]:
    """One timer-trigger node at `rate`: command rate and jitter; optionally service round trips.
    `offset` is the node's publish_offset_s; `extra` more node parameters."""
    proc, startup = start_node(
        ros,
        node_params(args, trigger="timer", rate_hz=rate, publish_offset_s=offset, **(extra or {})),
        args.startup_timeout,
    )
    cl = Client(ros, proc)
    svc = sp = None
    try:
        cl.wait_subscribed()
        warm = 1.5
        sp = streamer(rate, 900.0, proc.topic("joint_states"))  # stopped below
        if not cl.spin_until(lambda: len(cl.cmd_cb) > 0, 30.0):
            info = stop_streamer(sp)
            raise RuntimeError(f"no commands at {rate} Hz (streamer {info})\n{proc.log_tail()}")
        cl.spin_for(warm)
        d0 = cl.latest_diag(3.0)
        n_diag = len(cl.diag)
        row = measure_window(cl, rate, seconds, proc.pid)
        d1 = cl.latest_diag(3.0)
        # each overrun's account as /diagnostics (1 Hz) showed it: the last of each second
        tails = (d.get("last_overrun", "") for _, d in cl.diag[n_diag:])
        row["overrun_tails"] = [t for t in dict.fromkeys(tails) if t]
        if d0.get("last_overrun") in row["overrun_tails"]:  # from before the window
            row["overrun_tails"].remove(d0["last_overrun"])
        row["publish_offset_s"] = offset
        row["startup_s"] = round(startup, 1)
        nd = diag_numbers(d1)
        for k in (
            "overruns",
            "overruns_late_wake",
            "overruns_long_tick",
            "overruns_collector",
            "delayed_ticks",
        ):
            if k in nd and k in diag_numbers(d0):
                nd[f"{k}_in_window"] = nd[k] - diag_numbers(d0)[k]
        if "steps" in nd and "steps" in diag_numbers(d0):
            nd["steps_in_window"] = nd["steps"] - diag_numbers(d0)["steps"]
        row["node"] = nd
        log(
            f"timer {rate:.0f} Hz ({row['seconds']} s): achieved {row['achieved_hz']} Hz, client "
            f"jitter p99 {row['period_jitter_p99_us']} us ({row['basis']}), node jitter p99 "
            f"{nd.get('jitter_p99_us')} us, overruns {nd.get('overruns_in_window')}, "
            f"step p50/p99 {nd.get('step_p50_us')}/{nd.get('step_p99_us')} us, "
            f"node CPU {row['cpu_pct']} %"
        )
        if services:
            from bench.host_facts import ThreadSampler, thread_use, threads

            floor = None
            if not args.no_floors:  # answered beside the node's calls, in the same window
                from bench.ros_floors import launch_floor

                busy = ("busy",) if args.busy_wait else ()  # polls as the node's thread
                floor = launch_floor(ros, "service", *busy, log_dir=args.log_dir, tag="beside")
            t0, before = time.monotonic(), threads(proc.pid)
            try:
                with ThreadSampler(proc.pid) as sampler:
                    svc = run_services(cl, proc, args.service_calls, floor, args.floor_call)
            finally:
                if floor is not None:
                    floor.stop()
            svc["during_timer_hz"] = rate
            # which of the node's threads ran the calls, how busy, on which CPUs: a slow
            # handler on a thread sharing a core (or the GIL) with a busy one shows here
            svc["node_threads"] = thread_use(before, threads(proc.pid), time.monotonic() - t0)
            svc["core_shared_with_busiest_pct"] = sampler.core_sharing()
        row["streamer"] = stop_streamer(sp)
    finally:
        if sp is not None and sp.poll() is None:
            stop_streamer(sp)
        cl.close()
        if proc.stop() == -signal.SIGKILL:  # its shared-memory ports may stay behind
            log(f"the node of timer {rate:g} Hz did not end on SIGINT within 10 s: killed")
    return row, svc


SERVICES_TIMED = ("checkpoint", "restore", "list_capsules", "drop_capsule")


def run_services(cl: Client, proc, n: int, floor=None, floor_call: str = "first") -> dict:
    """`n` rounds of checkpoint, restore, list and drop on the node; with `floor` (a service
    floor process) also one ListCapsules to it per round, so both see the same machine:
    `floor_call` first in the round (before the checkpoint) or before the drop (the one call
    of the round that is not timed)."""
    sc = ServiceCaller(cl.ros)  # as the floor's: a client with nothing else to do
    try:
        return _services(cl, sc, proc, n, floor, floor_call)
    finally:
        sc.close()


def _services(
    cl: Client, sc: ServiceCaller, proc, n: int, floor=None, floor_call: str = "first"
) -> dict:
    from flashrt_ros import srv

    ck = sc.client(srv.Checkpoint, proc.service("checkpoint"))
    rs = sc.client(srv.Restore, proc.service("restore"))
    ls = sc.client(srv.ListCapsules, proc.service("list_capsules"))
    dr = sc.client(srv.DropCapsule, proc.service("drop_capsule"))
    fl = sc.client(srv.ListCapsules, floor.service("list_capsules")) if floor else None
    for c in (ck, rs, ls, dr, fl):
        if c is not None and not c.wait_for_service(timeout_sec=20.0):
            raise RuntimeError(f"service {c.srv_name} not available")
    t_ck, t_rs, t_ls, t_fl, fails = [], [], [], [], []
    for _ in range(5):  # warm-up, not timed
        _, r = sc.call(ck, srv.Checkpoint.Request())
        if r.success:
            sc.call(rs, srv.Restore.Request(capsule=r.capsule.id))
            sc.call(dr, srv.DropCapsule.Request(capsule=r.capsule.id))
        sc.call(ls, srv.ListCapsules.Request())
        if fl is not None:
            sc.call(fl, srv.ListCapsules.Request())
    for _ in range(n):
        if fl is not None and floor_call == "first":  # this moment of the machine, the floor's too
            t_fl.append(sc.call(fl, srv.ListCapsules.Request())[0])
        dt, r = sc.call(ck, srv.Checkpoint.Request())
        t_ck.append(dt)
        if not r.success:
            fails.append(f"checkpoint: {r.message}")
            continue
        dt, rr = sc.call(rs, srv.Restore.Request(capsule=r.capsule.id, verify=False))
        t_rs.append(dt)
        if not rr.success:
            fails.append(f"restore: {rr.message}")
        dt, _ = sc.call(ls, srv.ListCapsules.Request())
        t_ls.append(dt)
        if fl is not None and floor_call == "before-drop":  # then no timed call follows it
            t_fl.append(sc.call(fl, srv.ListCapsules.Request())[0])
        sc.call(dr, srv.DropCapsule.Request(capsule=r.capsule.id))  # keep the pool from filling
    us = lambda a: np.asarray(a) * 1e6  # noqa: E731
    diag = cl.latest_diag(3.0)
    nd = diag_numbers(diag)
    per = {  # service_<name>[_queue|_reply]_p50_us -> <name>[_queue|_reply]
        k[len("service_") : -len("_p50_us")]: float(v)
        for k, v in diag.items()
        if k.startswith("service_") and k.endswith("_p50_us")
    }
    by = {k: v for k, v in per.items() if k in SERVICES_TIMED}
    queue_by = {k: per.get(f"{k}_queue") for k in SERVICES_TIMED if f"{k}_queue" in per}
    reply_by = {k: per.get(f"{k}_reply") for k in SERVICES_TIMED if f"{k}_reply" in per}
    out = {
        "node_handler_p50_us": nd.get("service_p50_us"),
        "node_handler_p99_us": nd.get("service_p99_us"),
        # reception to take (waiting for the serving thread), and sending the reply
        "node_queue_p50_us": nd.get("service_queue_p50_us"),
        "node_queue_p99_us": nd.get("service_queue_p99_us"),
        "node_reply_p50_us": nd.get("service_reply_p50_us"),
        "node_lock_wait_p50_us": nd.get("service_lock_wait_p50_us"),
        "node_handler_by_service_p50_us": by,  # handler alone, per service
        "node_queue_by_service_p50_us": queue_by,  # reception to take, per service
        "node_reply_by_service_p50_us": reply_by,  # sending the reply, per service
        "calls": n,
        "floor_call": floor_call if fl is not None else None,  # its place in each round
        "failures": len(fails),
        "first_failures": fails[:3],
        "checkpoint_p50_us": pct(us(t_ck), 50),
        "checkpoint_p99_us": pct(us(t_ck), 99),
        "restore_p50_us": pct(us(t_rs), 50),
        "restore_p99_us": pct(us(t_rs), 99),
        "list_p50_us": pct(us(t_ls), 50),
        "list_p99_us": pct(us(t_ls), 99),
        # the bare service floor answered in the same rounds (ListCapsules, empty reply)
        "floor_beside_p50_us": pct(us(t_fl), 50) if t_fl else None,
        "floor_beside_p99_us": pct(us(t_fl), 99) if t_fl else None,
    }
    log(
        f"services ({n} calls each): checkpoint p50/p99 {out['checkpoint_p50_us']}/"
        f"{out['checkpoint_p99_us']} us, restore {out['restore_p50_us']}/{out['restore_p99_us']}"
        f" us, list {out['list_p50_us']}/{out['list_p99_us']} us, failures {len(fails)}"
    )
    return out


def run_observation(ros, args, n: int) -> dict:
    proc, startup = start_node(ros, node_params(args, trigger="observation"), args.startup_timeout)
    cl = Client(ros, proc)
    try:
        cl.wait_subscribed()
        lat_cb, lat_rx = lockstep(cl, n, cl.publish_obs)
        d = diag_numbers(cl.latest_diag(3.0))
    finally:
        cl.close()
        proc.stop()
    s = latency_summary(lat_cb, lat_rx)
    out = {
        "samples": s["samples"],
        "basis": s["basis"],
        "startup_s": round(startup, 1),
        "obs_to_action_p50_us": s["p50_us"],
        "obs_to_action_p99_us": s["p99_us"],
        **{k: s[k] for k in ("cb_p50_us", "cb_p99_us", "dds_p50_us", "dds_p99_us")},
        "node": d,
    }
    log(
        f"observation trigger ({s['samples']} lockstep samples): obs->action p50/p99 "
        f"{out['obs_to_action_p50_us']}/{out['obs_to_action_p99_us']} us ({s['basis']}); "
        f"in the client callback {out['cb_p50_us']}/{out['cb_p99_us']} us; node step p50 "
        f"{d.get('step_p50_us')} us"
    )
    return out


# ------------------------------------------------------------------------------------------------
# cameras: 2 x 640x480 rgb8 images at 30 Hz, joint_states streamed at 500 Hz -> the first command
# that stepped on both images
CAMERA_PROBE = "bench.ros_bench:camera_probe_policy"
CAMERAS = ("top", "wrist")
CAMERA_HZ = 30.0
CAMERA_JS_HZ = 500.0


@contextlib.contextmanager
def repo_importable():
    """This repository first on PYTHONPATH while nodes start (they import bench's policies)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{old}" if old else str(ROOT)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = old


def camera_probe_policy(height: int = 480, width: int = 640):
    """A LeRobot-shaped policy over two rgb8 cameras (top, wrist) whose action tells which
    images it stepped on: joints 1 and 2 of the action are top[0, 0, R] and wrist[0, 0, R] in
    [0, 1] (pixel / 255, whatever the joint positions), joints 3 to 6 the joint positions. It
    reads every pixel (the mean, times 0), so the node converts and uploads both whole images
    as a real policy would; the network itself costs nothing, so the figure is the node's
    camera path."""
    from types import SimpleNamespace as NS

    import torch

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            feats = {
                "observation.state": NS(type="STATE", shape=(12,)),
                "observation.images.top": NS(type="VISUAL", shape=(3, height, width)),
                "observation.images.wrist": NS(type="VISUAL", shape=(3, height, width)),
            }
            self.config = NS(
                input_features=feats,
                output_features={"action": NS(type="ACTION", shape=(6,))},
                chunk_size=1,
                n_action_steps=1,
                n_obs_steps=1,
                temporal_ensemble_coeff=None,
            )

        def predict_action_chunk(self, batch: dict) -> torch.Tensor:
            top, wrist = batch["observation.images.top"], batch["observation.images.wrist"]
            probe = torch.stack([top[:, 0, 0, 0], wrist[:, 0, 0, 0]], -1)
            seen = 0.0 * (top.mean((1, 2, 3)) + wrist.mean((1, 2, 3)))[:, None]
            a = torch.cat(
                [probe.to(batch["observation.state"].dtype), batch["observation.state"][:, 2:6]], -1
            )
            return (a + seen)[:, None]

    return Probe()


def camera_pair(v: int) -> list:
    """The two rgb8 640x480 images of one probe value: top all v, wrist all v + 1."""
    from sensor_msgs.msg import Image

    msgs = []
    for i in range(len(CAMERAS)):
        m = Image(height=480, width=640, encoding="rgb8", step=640 * 3)
        m.data = bytes([v + i]) * (480 * 640 * 3)
        msgs.append(m)
    return msgs


def compressed_pair_maker(quality: int = 90):
    """camera_pair for compressed cameras: (v) -> two sensor_msgs/CompressedImage JPEG frames of
    a camera-like 640x480 view (the sim arm rendered, with sensor noise), whose top-left 32x32
    pixels are flat v (top) and v + 1 (wrist): a flat block survives JPEG exactly, so the
    probe policy still tells which frames a command used, while the rest costs a real decode.
    Each v's pair is encoded once and kept (the scenario encodes all 250 before it starts)."""
    from sensor_msgs.msg import CompressedImage

    from bench.compressed_probe import encode, frame

    base = frame()  # 640x480, as compressed_probe decodes it

    made: dict[int, list] = {}

    def pair(v: int) -> list:
        if v in made:
            return made[v]
        msgs = made[v] = []
        for i in range(len(CAMERAS)):
            img = base.copy()
            img[:32, :32] = v + i
            data = encode(img, "JPEG", quality=quality)
            msgs.append(CompressedImage(format="rgb8; jpeg compressed rgb8", data=data))
        return msgs

    return pair


def camera_probe_values(a) -> tuple[int, int]:
    """(top, wrist) pixel values that a probe policy's command stepped on."""
    return round(a[0] * 255), round(a[1] * 255)


def camera_match(
    cl: Client, pair: tuple, probe: bool, timeout_ns: int, or_newer: bool = False
) -> int | None:
    """Index in cl's commands of the first one received after `pair` (v, t_mono, t_wall, m0:
    the command count at its publish) that stepped on its images: probe values (v, v + 1), or
    with `or_newer` these or newer ones on each camera (v counts modulo 250); another policy:
    any command. None when none came within `timeout_ns` of the publish."""
    v, t_mono, _, m0 = pair[:4]
    for i in range(m0, len(cl.cmd_cb)):
        if cl.cmd_cb[i] - t_mono > timeout_ns:
            return None
        if not probe:
            return i
        top, wrist = camera_probe_values(cl.cmd_vals[i])
        if (top, wrist) == (v, v + 1) or (
            or_newer and (top - v) % 250 < 125 and (wrist - v - 1) % 250 < 125
        ):
            return i
    return None


def images_in_split(cl: Client, matched: list[tuple[tuple, int]], seen: list) -> dict:
    """run_camera's `images_in` split: for each (pair, index of its command), the first
    ~/camera_seen message by which the node had received this pair's images on both cameras
    (the k-th pair sent is each camera's k-th message: the publishers waited for the node's
    subscriptions), from DDS reception stamps (system clock) like the `dds` basis. The
    acknowledgements are latched with depth 1, so on a loaded machine one can be overwritten
    before it is sent; a pair then takes a later one (its images_in too long, its after_images
    too short, even negative: seen on the 2-core CPU machine, not in the H200 runs, whose
    after_images p99 stayed 0.5-1.5 ms)."""
    ins, after = [], []
    for pair, i in matched:
        if not cl.cmd_rx[i]:
            continue
        k = pair[4]
        got = next((rx for rx, d in seen if rx and d[0] >= k and d[2] >= k), None)
        if got is None:
            continue
        ins.append((got - pair[2]) * 1e-3)
        after.append((cl.cmd_rx[i] - got) * 1e-3)
    return {
        "images_in_samples": len(ins),
        "images_in_p50_us": pct(ins, 50),
        "images_in_p99_us": pct(ins, 99),
        "after_images_p50_us": pct(after, 50),
        "after_images_p99_us": pct(after, 99),
    }


def run_camera(
    ros,
    args,
    n: int,
    warm: int = 20,
    timeout: float = 1.0,
    js_rate: float = CAMERA_JS_HZ,
    step_on: str = "joint_states",
    rate: float = CAMERA_HZ,
) -> dict:
    """Observation trigger with two 640x480 rgb8 cameras (top, wrist) as a robot streams them.

    `rate` 0 paces the pairs in lockstep instead of at 30 Hz: the next pair as soon as the
    command that stepped on this one is in (or its `timeout` passed), as the lockstep image
    echo floor paces its images, so the two compare like for like (a process that idles between
    frames wakes up slower than one kept busy: the echo at 30 Hz takes ~2.5x its lockstep time).

    `step_on` "joint_states" (the node's default): each joint_states steps, as below. "cameras":
    the node's step_on is [top, wrist], so a step comes as soon as both cameras have a new
    image, on the newest joint_states (a policy paced by its cameras): the latency then holds
    no wait for the next joint_states.

    A helper process (streamer(), as the timer runs, but reliable QoS as the observation
    trigger's subscription) publishes joint_states at `js_rate` (500 Hz) for the whole
    scenario, each one triggering one policy step on the newest valid image of each camera;
    this process publishes image pairs at 30 Hz, each pair with a new probe value v (top all
    v, wrist all v + 1, v in 1..250, consecutive pairs distinct). A pair's latency is from
    just before its first image is published to the first command that stepped on both of its
    images (with the probe policy the command carries v / 255 and (v + 1) / 255 on joints 1
    and 2), in the client callback (cb) and from the command's DDS reception stamp (dds), as
    latency_summary. It holds the image transport, the wait for the next joint_states (up to
    one period, 2 ms), the node's step and the command's transport: what a streaming robot
    sees. With another policy (--camera-policy) nothing tells which images a command used: the
    latency is then to the first command received after the pair was published, mostly the
    joint_states phase and the step, not the camera path.

    Pairs sent before the first command (the streamer and discovery starting) and the next
    `warm` ones are not counted. A counted pair without its command within `timeout` s is
    `missed` (kept out of the percentiles, never silently dropped); `missed_superseded` of
    them had a command step on this pair's or newer images instead (one camera's image came
    so late that the other camera's next one overtook it: no step saw both of this pair).
    `fresh` (probe only) is the same latency to the first command whose images are this
    pair's or newer on both cameras, which drops no superseded pair.

    `images_in`: the same pairs split at the node's acknowledgement of both images on
    ~/camera_seen (sent once per round of the node's inputs' loop, after the round's images are
    checked and staged, before any step; its DDS reception
    stamp here, so it carries one small message's transport): publish -> both images held by
    the node (`images_in_p50_us`), then held -> command (`after_images_p50_us`)."""
    probe = args.camera_policy == CAMERA_PROBE
    compressed = args.camera_compressed
    pace = f"{rate:g} Hz" if rate else "lockstep"
    make_pair = compressed_pair_maker() if compressed else camera_pair
    if compressed:  # encoded once, here: not on the thread that timestamps the commands
        for v in range(1, 251):
            make_pair(v)
    cams = [f"{c}:compressed" for c in CAMERAS] if compressed else list(CAMERAS)
    with repo_importable():  # the node imports the probe policy from this repository
        params = node_params(
            args,
            trigger="observation",
            cameras=cams,
            policy=args.camera_policy,
            step_on=list(CAMERAS) if step_on == "cameras" else ["joint_states"],
        )
        proc, startup = start_node(ros, params, args.startup_timeout)
    from sensor_msgs.msg import CompressedImage, Image

    cl = Client(ros, proc)
    kind, suffix = (CompressedImage, "/compressed") if compressed else (Image, "")
    pubs = [
        ros.node.create_publisher(kind, proc.topic(f"camera/{c}/image_raw{suffix}"), 10)
        for c in CAMERAS
    ]
    period, timeout_ns = (1.0 / rate if rate else 0.0), int(timeout * 1e9)
    # counted: (v, t_mono ns, t_wall ns, command count at publish, pairs sent with it)
    pairs: list[tuple] = []
    from rclpy.qos import QoSDurabilityPolicy, QoSProfile
    from std_msgs.msg import UInt64MultiArray

    seen: list[tuple[int, list]] = []  # ~/camera_seen: (DDS reception ns, per camera counts)
    seen_sub = ros.node.create_subscription(
        UInt64MultiArray,
        proc.service("camera_seen"),
        lambda m, info: seen.append((int(info.get("received_timestamp", 0) or 0), list(m.data))),
        QoSProfile(depth=1000, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL),
    )
    sp = None
    sent = behind = 0
    try:
        for p in pubs:
            cl.wait_subscribed(pub=p)
        cl.wait_subscribed()
        sp = streamer(js_rate, 900.0, proc.topic("joint_states"), reliable=True)  # stopped below
        msgs = make_pair(1)
        nxt = time.monotonic()
        first_by = nxt + 30.0  # the streamer and discovery: the first command within 30 s
        warm_left = None  # pairs still to send uncounted once commands flow
        while len(pairs) < n:
            cl.spin_for(nxt - time.monotonic())  # the commands meanwhile
            if warm_left is None:
                if cl.cmd_cb:
                    warm_left = warm
                elif time.monotonic() > first_by:
                    raise RuntimeError(
                        f"no command within 30 s of streaming joint_states at {js_rate:g} Hz "
                        f"with images at {pace} (streamer {stop_streamer(sp)})\n"
                        f"{proc.log_tail()}"
                    )
            v = 1 + sent % 250
            m0 = len(cl.cmd_cb)
            t_wall, t_mono = time.time_ns(), time.monotonic_ns()
            for p, m in zip(pubs, msgs, strict=True):
                p.publish(m)
            sent += 1
            if warm_left == 0:
                pairs.append((v, t_mono, t_wall, m0, sent))
            elif warm_left is not None:
                warm_left -= 1
            msgs = make_pair(1 + sent % 250)  # the next pair, built off the clock
            if not rate:  # lockstep: the next pair once this one's command is in
                this = (v, t_mono, t_wall, m0)
                cl.spin_until(
                    lambda p=this: camera_match(cl, p, probe, timeout_ns) is not None, timeout
                )
                nxt = time.monotonic()
                continue
            nxt += period
            if time.monotonic() > nxt:  # behind: do not burst, skip the lost slots
                behind += 1
                nxt = time.monotonic() + period
        end = time.monotonic() + timeout  # the last pair's command, then the streamer stops
        last = pairs[-1]
        cl.spin_until(
            lambda: time.monotonic() > end or camera_match(cl, last, probe, timeout_ns) is not None,
            timeout,
        )
        info = stop_streamer(sp)
        d = cl.latest_diag(3.0)
    finally:
        if sp is not None and sp.poll() is None:
            stop_streamer(sp)
        cl.close()
        for p in pubs:
            with contextlib.suppress(Exception):
                ros.node.destroy_publisher(p)
        with contextlib.suppress(Exception):
            ros.node.destroy_subscription(seen_sub)
        proc.stop()
    if "traceback" in info or info.get("rc"):
        log(f"camera: the joint_states streamer did not end cleanly: {info}")
    lat = {"exact": ([], []), "fresh": ([], [])}  # (cb, dds) latencies in us
    missed = {"exact": 0, "fresh": 0}
    matched = []  # (pair, its exact command's index): the images_in split
    for pair in pairs:
        for key in lat:
            i = camera_match(cl, pair, probe, timeout_ns, or_newer=key == "fresh")
            if i is None:
                missed[key] += 1
                continue
            if key == "exact":
                matched.append((pair, i))
            lat[key][0].append((cl.cmd_cb[i] - pair[1]) * 1e-3)
            if cl.cmd_rx[i] > 0:
                lat[key][1].append((cl.cmd_rx[i] - pair[2]) * 1e-3)
    s, f = latency_summary(*lat["exact"]), latency_summary(*lat["fresh"])
    split = images_in_split(cl, matched, seen)
    span = (pairs[-1][1] - pairs[0][1]) * 1e-9
    out = {
        "samples": s["samples"],
        "missed": missed["exact"],
        "missed_superseded": missed["exact"] - missed["fresh"],
        "basis": s["basis"],
        "policy": args.camera_policy,
        "match": "probe values (v, v + 1)" if probe else "first command after the pair",
        "cameras": f"2 x 640x480 {'JPEG (quality 90)' if compressed else 'rgb8'} at "
        f"{pace}, joint_states at {js_rate:g} Hz, observation trigger",
        "pairs_rate_hz": rate or None,  # None: lockstep
        "step_on": list(CAMERAS) if step_on == "cameras" else ["joint_states"],
        "compressed": compressed,
        "image_rate_hz": round((len(pairs) - 1) / span, 1) if span > 0 else None,
        "pairs_behind": behind,
        "timeout_s": timeout,
        "startup_s": round(startup, 1),
        "camera_to_action_p50_us": s["p50_us"],
        "camera_to_action_p99_us": s["p99_us"],
        **{k: s[k] for k in ("cb_p50_us", "cb_p99_us", "dds_p50_us", "dds_p99_us")},
        "p50_us_by_50": s["p50_us_by_50"],
        "fresh": {**f, "missed": missed["fresh"]} if probe else None,
        **split,
        "streamer": info,
        "node": {
            **diag_numbers(d),
            **{k: v for k, v in d.items() if k.startswith("camera.") and "last" not in k},
        },
    }
    log(
        f"cameras ({pace}), step_on {step_on} ({s['samples']} pairs, {out['missed']} missed "
        f"({out['missed_superseded']} superseded), images at "
        f"{out['image_rate_hz']} Hz, joint_states at {js_rate:g} Hz): camera->action p50/p99 "
        f"{out['camera_to_action_p50_us']}/{out['camera_to_action_p99_us']} us ({s['basis']}) = "
        f"images in {out['images_in_p50_us']} + after {out['after_images_p50_us']} (p50s); "
        f"in the client callback {out['cb_p50_us']}/{out['cb_p99_us']} us; node step p50 "
        f"{out['node'].get('step_p50_us')} us; streamer {info.get('published')} published, "
        f"{info.get('late')} late"
        + (f"; these or newer images p50/p99 {f['p50_us']}/{f['p99_us']} us" if probe else "")
    )
    return out


# ------------------------------------------------------------------------------------------------
# the flight recorder at 1 kHz: the same timer run with and without flight_ticks
FLIGHT_TICKS = 1000


def flight_row(row: dict) -> dict:
    """The figures of a 1 kHz timer row that the flight recorder could move."""
    n = row.get("node") or {}
    return {
        "achieved_hz": row["achieved_hz"],
        "seconds": row["seconds"],
        "overruns": n.get("overruns_in_window"),
        "node_jitter_p99_us": n.get("jitter_p99_us"),
        "client_jitter_p99_us": row["period_jitter_p99_us"],
        "node_step_p50_us": n.get("step_p50_us"),
        "cpu_pct": row.get("cpu_pct"),
    }


def flight_summary(with_rec: dict | None, without: dict | None) -> dict:
    """flight_1khz: the recorder's run beside the plain one, and the step's difference."""
    out = {"flight_ticks": FLIGHT_TICKS, "rate_hz": 1000.0, "with": with_rec, "without": without}
    a, b = dig(with_rec, "node_step_p50_us"), dig(without, "node_step_p50_us")
    out["step_p50_cost_us"] = _diff(a, b)
    return out


# ------------------------------------------------------------------------------------------------
# start-up: spawn -> first command, timer trigger, observations already streaming
def run_startup(ros, args, cache_dir: Path, label: str, log_dir: Path, rate: float = 500.0):
    """Seconds from spawning flashrt_node (trigger=timer at `rate`, a streamer already
    publishing joint_states) to the first command received here. The node's torch inductor and
    triton caches and its bytecode cache are `cache_dir` (empty: cold; filled by an earlier
    run: warm). Label "unfused": the node with fuse=false (nothing compiled). Label "late": the
    node with late_fuse=true (eager until the fused step, built in the background, is swapped
    in; then also how the commands came while it was built: late_fuse_window). Label "floor":
    the start floor (ros_floors.py start) instead of the node."""
    from diagnostic_msgs.msg import DiagnosticArray
    from rclpy.executors import SingleThreadedExecutor
    from std_msgs.msg import Float64MultiArray

    from test.ros_helpers import launch_node

    stamps: list[float] = []
    sub = ros.node.create_subscription(
        Float64MultiArray, "/commands", lambda _m: stamps.append(time.monotonic()), 1000
    )
    kernels: list[tuple[float, dict]] = []  # (when, the node's /diagnostics key-values)

    def on_diag(msg) -> None:
        for st in msg.status:
            if "flashrt" in st.name:  # "/flashrt: ..." (the node's fully qualified name)
                kernels.append((time.monotonic(), {kv.key: kv.value for kv in st.values}))

    dsub = ros.node.create_subscription(DiagnosticArray, "/diagnostics", on_diag, 10)
    ex = SingleThreadedExecutor(context=ros.context)
    ex.add_node(ros.node)
    files_before = sum(1 for p in cache_dir.rglob("*") if p.is_file())
    sp = streamer(rate, 900.0, "/joint_states")
    proc = None
    try:
        end = time.monotonic() + 30.0  # the streamer's publisher is in the graph: it is up
        while ros.node.count_publishers("/joint_states") == 0 and time.monotonic() < end:
            ex.spin_once(timeout_sec=0.05)
        env = dict(os.environ)
        env.update(
            ROS_DOMAIN_ID=str(ros.domain_id),
            ROS_AUTOMATIC_DISCOVERY_RANGE="LOCALHOST",
            TORCHINDUCTOR_CACHE_DIR=str(cache_dir / "inductor"),
            TRITON_CACHE_DIR=str(cache_dir / "triton"),
            # the node's bytecode cache (node/bytecode.py; used where torch has no .pyc of its
            # own): in the same folder, so a cold start compiles Python from source too
            FLASHRT_PYCACHE=str(cache_dir / "pycache"),
        )
        t0 = time.monotonic()
        if label == "floor":
            from bench.ros_floors import floor_summary, launch_floor

            # the bytecode cache the warm node filled: the floor imports torch as warm as it did
            proc = launch_floor(ros, "start", args.device, log_dir=log_dir, env=env)
        else:
            proc = launch_node(
                # the node points both caches at <compile_cache_dir>/<fingerprint> itself
                node_params(
                    args,
                    trigger="timer",
                    rate_hz=rate,
                    compile_cache_dir=str(cache_dir),
                    **({"fuse": False} if label == "unfused" else {}),
                    **({"late_fuse": True} if label == "late" else {}),
                ),
                log_dir=log_dir,
                env=env,
            )
            ros.processes.append(proc)
        end = t0 + args.startup_timeout
        while not stamps and proc.alive() and time.monotonic() < end:
            ex.spin_once(timeout_sec=0.05)
        if not stamps:
            why = "exited" if not proc.alive() else f"no command in {args.startup_timeout} s"
            raise RuntimeError(f"{label} start: node {why}\n{proc.log_tail()}")
        first = stamps[0] - t0
        late = None
        if label == "late":  # until /diagnostics says what the step runs now, then 2 s more
            built = lambda: any(  # noqa: E731
                not d.get("kernels", "").startswith("eager (") for _, d in kernels
            )
            while not built() and proc.alive() and time.monotonic() < end:
                ex.spin_once(timeout_sec=0.05)
            t_more = time.monotonic() + 2.0
            while time.monotonic() < t_more:
                ex.spin_once(timeout_sec=0.05)
            late = late_fuse_window(stamps, kernels, rate, t0)
    finally:
        info = stop_streamer(sp)
        with contextlib.suppress(Exception):
            ex.remove_node(ros.node)
            ex.shutdown(timeout_sec=0)
        with contextlib.suppress(Exception):
            ros.node.destroy_subscription(sub)
            ros.node.destroy_subscription(dsub)
        if proc is not None:
            proc.stop()
    out = {
        "first_command_s": round(first, 2),
        **({"late_fuse_window": late} if late is not None else {}),
        **({"floor": floor_summary(proc)} if label == "floor" else {}),
        "rate_hz": rate,
        "cache_dir_files_before": files_before,
        "cache_dir_files_after": sum(1 for p in cache_dir.rglob("*") if p.is_file()),
        "streamer": info,
    }
    log(f"{label} start: first command {out['first_command_s']} s after spawn ({out})")
    return out


def late_fuse_window(stamps: list[float], diags: list[tuple[float, dict]], rate: float, t0: float):
    """How the commands came while late_fuse built the fused step, and after the swap. The
    node's message says the step the fused step took over after ("from step N of main"); in
    timer mode command k (0-based) is step k + 1, so commands [0, N) came from the eager
    graph while the build ran and [N, ...) from the fused one."""
    ended = [d for _, d in diags if not d.get("kernels", "").startswith("eager (")]
    said = ended[0].get("late_fuse", "") if ended else ""
    out: dict = {"late_fuse": said, "kernels": diags[-1][1].get("kernels") if diags else None}
    m = re.search(r"from step (\d+) of main, built in the background in ([0-9.]+) s", said)
    if m is None:
        return out
    n, built_s = int(m.group(1)), float(m.group(2))
    ns = [int(t * 1e9) for t in stamps]
    period = 1.0 / rate
    out.update(
        swap_step=n,
        built_s=built_s,
        swap_s_after_spawn=round(stamps[n] - t0, 2) if n < len(stamps) else None,
    )
    # the intervals up to the first fused command, and as many after it
    for k, part in (("building", ns[: n + 1]), ("after", ns[n : 2 * n + 1])):
        out[k] = jitter_stats(part, period)
        dt = np.diff(np.asarray(part, dtype=np.int64)) * 1e-9
        out[k]["late_over_2_periods"] = int((dt > 2 * period).sum())  # a command came late
    ov = [int(d["overruns"]) for _, d in diags if d.get("overruns", "").isdigit()]
    out["node_overruns_last"] = ov[-1] if ov else None
    return out


# ------------------------------------------------------------------------------------------------
# bare-rclpy floors (bench/ros_floors.py), measured with the same client code as the node
def run_floor_echo(ros, args, n: int, log_dir: Path) -> dict:
    from bench.ros_floors import launch_floor

    proc = launch_floor(ros, "echo", log_dir=log_dir)
    cl = Client(ros, proc)
    try:
        cl.wait_subscribed()
        cl.wait_replier()
        lat_cb, lat_rx = lockstep(cl, n, cl.publish_obs)
    finally:
        cl.close()
        rc = proc.stop()
    out = {**latency_summary(lat_cb, lat_rx), "exit_status": rc}
    log(f"floor echo ({n}): p50/p99 {out['p50_us']}/{out['p99_us']} us ({out['basis']})")
    return out


def run_floor_image(ros, args, n: int, log_dir: Path, rate: float = 0.0) -> dict:
    """The image echo in lockstep, or with `rate`, one image every 1/rate s (a camera's pace)."""
    from sensor_msgs.msg import Image

    from bench.ros_floors import launch_floor

    proc = launch_floor(ros, "image", log_dir=log_dir)
    cl = Client(ros, proc, reply="image_echo", reply_type=Image)
    pub = ros.node.create_publisher(Image, proc.topic("image_raw"), 10)
    msg = Image(height=480, width=640, encoding="rgb8", step=640 * 3)
    msg.data = bytes(range(256)) * (640 * 480 * 3 // 256)
    try:
        cl.wait_subscribed(pub=pub)
        cl.wait_replier()
        lat_cb, lat_rx = lockstep(
            cl, n, lambda _k: pub.publish(msg), 20 if rate else 50, 1.0 / rate if rate else 0.0
        )
    finally:
        cl.close()
        with contextlib.suppress(Exception):
            ros.node.destroy_publisher(pub)
        rc = proc.stop()
    out = {**latency_summary(lat_cb, lat_rx), "bytes": len(msg.data), "encoding": "rgb8 640x480"}
    out["exit_status"] = rc
    out["rate_hz"] = rate or None  # None: lockstep, the next image as soon as the reply is in
    pace = f" at {rate:g} Hz" if rate else ""
    log(
        f"floor image echo{pace} ({n}): p50/p99 {out['p50_us']}/{out['p99_us']} us ({out['basis']})"
    )
    return out


def list_rtts_us(ros, proc, n: int, warm: int = 5) -> list[float]:
    """`n` ListCapsules round trips (us) to `proc` by a ServiceCaller, after `warm` untimed."""
    from flashrt_ros import srv

    sc = ServiceCaller(ros)  # the same client as run_services'
    try:
        ls = sc.client(srv.ListCapsules, proc.service("list_capsules"))
        if not ls.wait_for_service(timeout_sec=20.0):
            raise RuntimeError(f"service {ls.srv_name} not available\n{proc.log_tail()}")
        for _ in range(warm):  # warm-up, not timed (as run_services)
            sc.call(ls, srv.ListCapsules.Request())
        return [sc.call(ls, srv.ListCapsules.Request())[0] * 1e6 for _ in range(n)]
    finally:
        sc.close()


def run_floor_service(ros, args, n: int, log_dir: Path) -> dict:
    from bench.ros_floors import launch_floor

    proc = launch_floor(ros, "service", log_dir=log_dir)
    try:
        t = list_rtts_us(ros, proc, n)
    finally:
        rc = proc.stop()
    out = {"calls": n, "type": "flashrt_ros/srv/ListCapsules", "p50_us": pct(t, 50)}
    out.update(p99_us=pct(t, 99), exit_status=rc)
    log(f"floor service ({n} calls): p50/p99 {out['p50_us']}/{out['p99_us']} us")
    return out


def run_floor_timer(ros, args, rate: float, seconds: float, log_dir: Path) -> dict:
    from bench.ros_floors import floor_summary, launch_floor

    prio = [str(args.realtime_priority)] + (["busy"] if args.busy_wait else [])
    proc = launch_floor(ros, "timer", str(rate), *prio, log_dir=log_dir)
    cl = Client(ros, proc)
    try:
        if not cl.spin_until(lambda: len(cl.cmd_cb) > 0 or not proc.alive(), 30.0) or not (
            cl.cmd_cb
        ):
            raise RuntimeError(f"no commands from the timer floor\n{proc.log_tail()}")
        cl.spin_for(1.5)  # as run_timer's warm-up
        row = measure_window(cl, rate, seconds, proc.pid)
    finally:
        cl.close()
        rc = proc.stop()
    row["loop"] = floor_summary(proc)
    row["exit_status"] = rc
    log(
        f"floor timer {rate:.0f} Hz ({row['seconds']} s): achieved {row['achieved_hz']} Hz, "
        f"client jitter p99 {row['period_jitter_p99_us']} us ({row['basis']}), publish-stamp "
        f"jitter p99 {row['node_publish'].get('jitter_p99_us')} us, loop {row['loop']}, "
        f"CPU {row['cpu_pct']} %"
    )
    return row


# ------------------------------------------------------------------------------------------------
def dig(d, *keys):
    """d[k1][k2]... or None where any level is missing."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _diff(ours, floor):
    return round(ours - floor, 1) if ours is not None and floor is not None else None


def _rounds(starts: dict) -> dict[str, list]:
    """Each start's first-command times, round by round (`label`, `label#2`, ...)."""
    by: dict[str, list] = {}
    for k, r in starts.items():
        by.setdefault(k.split("#")[0], []).append(dig(r, "first_command_s"))
    return by


def start_s(starts: dict, label: str) -> float | None:
    """A start's first-command time: the median over its rounds, so one slow import (0.4 s
    apart between runs on one machine, 2026-12-06) does not decide it."""
    got = [v for v in _rounds(starts).get(label, []) if v is not None]
    return round(statistics.median(got), 3) if got else None


def start_rounds(starts: dict) -> dict | None:
    """Every round's first-command time per start, where a start ran more than once."""
    return {k: v for k, v in _rounds(starts).items() if len(v) > 1} or None


def versus(ours, floor) -> dict:
    return {"ours": ours, "floor": floor, "ours_minus_floor": _diff(ours, floor)}


def headline(
    rows: list,
    offset_rows: list,
    svc: dict | None,
    obs: dict | None,
    floors: dict | None = None,
    starts: dict | None = None,
) -> dict:
    """The "ros" object (its schema: bench/README.md) from the scenario rows, rules stated.
    `floors` / `starts` None (not given, e.g. by an older caller): the keys computed from them
    alone are left out, so that updating a stored result with this one keeps its values."""
    given_floors, given_starts = floors is not None, starts is not None
    floors, starts = floors or {}, starts or {}
    sustained = [r for r in rows if r["achieved_hz"] >= 0.98 * r["target_hz"]]
    best = max(sustained or rows, key=lambda r: r["target_hz"], default=None)
    # period jitter: at 500 Hz (the goal's rate), the publish-offset run when there is one
    at = [r for r in offset_rows + rows if r["target_hz"] == 500.0] or rows
    j = at[0] if at else None
    r500 = next((r for r in rows if r["target_hz"] == 500.0), None)  # offset 0
    k1 = [r for r in rows if r["target_hz"] == 1000.0]
    r1k = k1[-1] if k1 else None  # the --seconds-1khz run, at --offset-1khz
    r1k0 = k1[0] if len(k1) > 1 else None  # the one without offset beside it
    f500, f1k = floors.get("timer_500"), floors.get("timer_1000")
    fe, fs, fi = floors.get("echo"), floors.get("service"), floors.get("image_echo")
    svc_rtt = max(svc["checkpoint_p50_us"], svc["restore_p50_us"]) if svc else None
    o2a = obs["obs_to_action_p50_us"] if obs else None
    out = {
        "rate_hz": (best["target_hz"] if best in sustained else best["achieved_hz"]) if best else 0,
        "period_jitter_p99_us": (j["node_publish"] or {}).get("jitter_p99_us") if j else None,
        "obs_to_action_p50_us": o2a,
        "service_rtt_p50_us": svc_rtt,
        "floor_echo_p50_us": dig(fe, "p50_us"),
        "floor_service_p50_us": dig(fs, "p50_us"),
        "floor_service_beside_p50_us": dig(svc, "floor_beside_p50_us"),
        "floor_jitter_p99_us": dig(f500, "period_jitter_p99_us"),
        "node_step_p50_us": dig(r500, "node", "step_p50_us"),
        "overruns_1khz_60s": dig(r1k, "node", "overruns_in_window"),
        "delayed_ticks_1khz_60s": dig(r1k, "node", "delayed_ticks_in_window"),
        "node_jitter_p99_us_1khz": dig(r1k, "node", "jitter_p99_us"),
        "client_jitter_p99_us_1khz": dig(r1k, "period_jitter_p99_us"),
        "floor_jitter_p99_us_1khz": dig(f1k, "period_jitter_p99_us"),
        "floor_overruns_1khz": dig(f1k, "loop", "overruns"),
        "floor_delayed_ticks_1khz": dig(f1k, "loop", "delayed_ticks"),
        "floor_wake_late_max_us_1khz": dig(f1k, "loop", "wake_late_max_us"),
        "publish_offset_s_1khz": dig(r1k, "publish_offset_s"),
        "client_jitter_p99_us_1khz_no_offset": dig(r1k0, "period_jitter_p99_us"),
        "node_publish_jitter_p99_us_1khz": dig(r1k, "node_publish", "jitter_p99_us"),
        "node_publish_jitter_p99_us_1khz_no_offset": dig(r1k0, "node_publish", "jitter_p99_us"),
        "overruns_1khz_no_offset": dig(r1k0, "node", "overruns_in_window"),
        "delayed_ticks_1khz_no_offset": dig(r1k0, "node", "delayed_ticks_in_window"),
        "warm_start_s": start_s(starts, "warm"),
        "cold_start_s": start_s(starts, "cold"),
        "floor_start_s": start_s(starts, "floor"),
        "unfused_start_s": start_s(starts, "unfused"),
        "late_fuse_start_s": start_s(starts, "late"),
        "start_rounds_s": start_rounds(starts),
        "late_fuse_swap_s": dig(starts.get("late"), "late_fuse_window", "swap_s_after_spawn"),
        "late_fuse_build_jitter_p99_us": dig(
            starts.get("late"), "late_fuse_window", "building", "jitter_p99_us"
        ),
        "node_cpu_pct_500hz": dig(r500, "cpu_pct"),
        "floor_image_echo_p50_us": dig(fi, "p50_us"),
        "floor_image_echo_30hz_p50_us": dig(floors, "image_echo_30hz", "p50_us"),
        "obs_to_action_p99_us": obs["obs_to_action_p99_us"] if obs else None,
        "overruns_1khz_window_s": dig(r1k, "seconds"),
        "client_jitter_p99_us": dig(r500, "period_jitter_p99_us"),
        "period_jitter_at": {"rate_hz": j["target_hz"], "publish_offset_s": j["publish_offset_s"]}
        if j
        else None,
        "delivery_jitter_p99_us": j["client_dds"].get("jitter_p99_us") if j else None,
        "vs_floor": {
            "obs_to_action_p50_us": versus(o2a, dig(fe, "p50_us")),
            "service_rtt_p50_us": versus(svc_rtt, dig(fs, "p50_us")),
            # the floor called in the same rounds as the node's calls (floor_rule)
            "service_rtt_p50_us_beside": versus(svc_rtt, dig(svc, "floor_beside_p50_us")),
            "list_capsules_p50_us": versus(dig(svc, "list_p50_us"), dig(fs, "p50_us")),
            "client_jitter_p99_us_500hz": versus(
                dig(r500, "period_jitter_p99_us"), dig(f500, "period_jitter_p99_us")
            ),
            "client_jitter_p99_us_1khz": versus(
                dig(r1k, "period_jitter_p99_us"), dig(f1k, "period_jitter_p99_us")
            ),
            "client_jitter_p99_us_1khz_no_offset": versus(
                dig(r1k0, "period_jitter_p99_us"), dig(f1k, "period_jitter_p99_us")
            ),
            "publish_jitter_p99_us_500hz": versus(
                dig(r500, "node_publish", "jitter_p99_us"),
                dig(f500, "node_publish", "jitter_p99_us"),
            ),
            "cpu_pct_500hz": versus(dig(r500, "cpu_pct"), dig(f500, "cpu_pct")),
        },
        "rate_rule": "highest timer rate achieved within 2% (overruns in the rows)",
        "jitter_rule": "p99 of |interval - period| between the node's commands, from the DDS "
        "source timestamps (taken when the node writes each one) read by the client; "
        "delivery_jitter_p99_us: the same from the client's DDS reception stamps, so it adds "
        "the loopback transport and the receiving process",
        "service_rtt_rule": "max of the Checkpoint and Restore p50 (ListCapsules below)",
        "floor_rule": "bare-rclpy nodes (bench/ros_floors.py), each a separate process on the "
        "same machine in the same run, measured with the same client code: echo = JointState "
        "-> Float64MultiArray in lockstep (vs obs_to_action); service = ListCapsules answered "
        "at once (vs service_rtt_p50_us and list_capsules), in a window of its own "
        "(floor_service_p50_us) and called once in each round of the node's calls "
        "(floor_service_beside_p50_us: the same moments of the machine and the same client "
        "load, though not the same CPU as the node's serving thread; with --busy-wait this "
        "floor polls, as that thread does, instead of sleeping between calls); timer = a thread "
        "with absolute deadlines and the node loop's sleep-then-spin wait publishing with no "
        "work, jitter at the client's DDS reception (vs client_jitter_p99_us*, the node's "
        "500 Hz run without publish offset and 1 kHz runs with (publish_offset_s_1khz) and "
        "without; the 1 kHz floor runs --seconds-1khz, as the node's 1 kHz "
        "row, and floor_overruns_1khz counts its periods skipped (floor_delayed_ticks_1khz its "
        "ticks run late, as the node's) over its whole run, the "
        "window and ~2 s around it); image echo = 640x480 rgb8 Image echoed as-is",
        "node_rule": "node_step_p50_us, node_cpu_pct_500hz (utime+stime from /proc over the "
        "window, percent of one core): the 500 Hz run without publish offset; "
        "overruns_1khz_60s (periods skipped: no command in them), delayed_ticks_1khz_60s "
        "(ticks that started late, the tick before having run past their deadline, and still "
        "commanded within their period), node_jitter_p99_us_1khz (the node's /diagnostics) and "
        "client_jitter_p99_us_1khz: the 1 kHz run, overruns_1khz_window_s long, at "
        "publish_offset_s_1khz (each command at that phase after its deadline; *_no_offset: "
        "the 1 kHz run of --seconds without it)",
        "start_rule": "seconds from spawning flashrt_node (trigger=timer, 500 Hz, joint_states "
        "already streaming) to the first command received; cold: TORCHINDUCTOR_CACHE_DIR, "
        "TRITON_CACHE_DIR and FLASHRT_PYCACHE (the node's bytecode cache) a new empty folder, "
        "first node start of the run; warm: the next start with the same folders; "
        "late_fuse_start_s: the node with late_fuse=true after the warm start (eager graph "
        "first, the fused step loaded in the background and swapped in; late_fuse_swap_s: "
        "from spawn to the first command of the fused step; late_fuse_build_jitter_p99_us: "
        "the command intervals' deviation from the period until then); "
        "unfused_start_s: the node with fuse=false (its step captured without compiling), "
        "after the warm start; floor_start_s: the same for a bare rclpy node that imports "
        "torch, makes one tensor on the device and answers each joint_states through it "
        "(bench/ros_floors.py start); with --start-rounds N each is the median of its N "
        "rounds (start_rounds_s: every round's)",
    }
    if not given_floors:
        for k in [k for k in out if k.startswith("floor_") and k != "floor_start_s"]:
            del out[k]
        del out["vs_floor"]
    if not given_starts:
        for k in [k for k in out if k.endswith("start_s") or k.startswith("late_fuse_")] + [
            "start_rule",
            "start_rounds_s",
        ]:
            del out[k]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--policy", default="builtin:hybrid")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ros.json")
    ap.add_argument("--quick", action="store_true", help="short smoke run (CPU)")
    ap.add_argument("--rates", default="500,1000", help="timer rates to try, Hz")
    ap.add_argument("--seconds", type=float, default=None, help="window per rate (10; quick 3)")
    ap.add_argument(
        "--seconds-1khz",
        type=float,
        default=None,
        help="window of the 1 kHz rate, whose overruns are overruns_1khz_60s (60; quick 5)",
    )
    ap.add_argument("--obs-samples", type=int, default=None, help="lockstep (2000; quick 200)")
    ap.add_argument("--service-calls", type=int, default=None, help="per service (200; quick 30)")
    ap.add_argument(
        "--floor-call",
        choices=("first", "before-drop"),
        default="first",
        help="where the bare service floor's call goes in each round of the node's calls: "
        "first (before the checkpoint; the default) or before-drop (between the list and the "
        "untimed drop), to see whether the call that follows another server's pays for the "
        "switch",
    )
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument(
        "--realtime-priority",
        type=int,
        default=0,
        help="the node's realtime_priority parameter, and the same SCHED_FIFO priority for the "
        "timer floor's thread (0 = normal scheduling for both)",
    )
    ap.add_argument(
        "--cpu-affinity",
        default="",
        help="the node's cpu_affinity parameter: the CPUs of the thread that steps, as taskset -c "
        "takes them ('' = any CPU; the floors are not pinned)",
    )
    ap.add_argument(
        "--node-param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a parameter for every node this bench starts, over the scenario's own value "
        "(repeatable; the value as YAML: true, 3, 0.5, text), e.g. obs_timeout_s=0.2; "
        "NAME=VALUE, not ROS's :=, which rclpy would read as a remap of the bench's own node",
    )
    ap.add_argument(
        "--busy-wait",
        action="store_true",
        help="the node's busy_wait parameter (its stepping thread polls instead of sleeping), "
        "and the same for the timer floor's thread; the echo, image and service floors stay "
        "plain rclpy nodes",
    )
    ap.add_argument(
        "--publish-offset",
        type=float,
        default=0.0004,
        help="also run the service rate with this publish_offset_s (0 = skip)",
    )
    ap.add_argument(
        "--offset-1khz",
        type=float,
        default=0.0006,
        help="publish_offset_s of the 1 kHz run (its --seconds-1khz window); with > 0 the 1 kHz "
        "rate also runs --seconds without offset (0 = one 1 kHz run, without offset)",
    )
    ap.add_argument(
        "--seconds-flight",
        type=float,
        default=None,
        help="window of the 1 kHz runs with and without flight_ticks: 1000 (10; quick 3; 0 = skip)",
    )
    ap.add_argument("--no-floors", action="store_true", help="skip the bare-rclpy floors")
    ap.add_argument(
        "--no-camera-lockstep",
        dest="camera_lockstep",
        action="store_false",
        help="skip the camera frames scenario in lockstep (step_on: [top, wrist], the next pair "
        "as soon as the command for the last one is in: the lockstep image echo's pace; runs "
        "when --camera-step-on is cameras or both)",
    )
    ap.add_argument(
        "--no-camera-intake",
        dest="camera_intake",
        action="store_false",
        help="skip the camera intake (bench/camera_intake.py: two images into a node that "
        "never steps, and into a bare rclpy process, at most 200 pairs each)",
    )
    ap.add_argument(
        "--camera-policy",
        default=CAMERA_PROBE,
        help="policy of the camera scenario (2 x 640x480 rgb8 cameras top, wrist); the default "
        "probe tells which images each command used; the real model: builtin:act's lerobot size "
        "(a factory returning make_act(size='lerobot'))",
    )
    ap.add_argument(
        "--camera-samples", type=int, default=None, help="camera scenario (500; quick 30)"
    )
    ap.add_argument(
        "--camera-compressed",
        action="store_true",
        help="camera scenario with compressed cameras (name:compressed): JPEG frames of a "
        "rendered sim-arm view on camera/<name>/image_raw/compressed, decoded by the node",
    )
    ap.add_argument(
        "--camera-step-on",
        choices=("joint_states", "cameras", "both", "none"),
        default="both",
        help="the camera scenario's node steps on each joint_states (the node's default), on "
        "each pair of camera frames (step_on: [top, wrist]), or both, one after the other "
        "(default; the joint_states one is 'camera', the other 'camera_frames'); none: only "
        "the camera intake (with --no-camera-intake too, a full run has no image at all: "
        "no image echo floor either)",
    )
    ap.add_argument("--no-startup", action="store_true", help="skip the cold and warm starts")
    ap.add_argument(
        "--goals",
        action="store_true",
        help="a full run of only what the ROS-layer goals compare: the starts, the 500 Hz row "
        "with its services, the 1 kHz row of --seconds-1khz at --offset-1khz, the observation "
        "trigger, and the echo, service, 1 kHz timer and start floors. No camera, flight or "
        "offset row at 500 Hz, no 1 kHz row without offset, no 500 Hz timer floor: about "
        "50 s shorter than a full run without cameras, so more tries fit a device session",
    )
    ap.add_argument(
        "--start-rounds",
        type=int,
        default=None,
        help="rounds of the warm, late, unfused and floor starts after the cold one (later "
        "rounds are reported as warm#2 and so on; the headline takes each start's median, "
        "start_rounds_s lists them all). Default 3 with --goals, else 1",
    )
    ap.add_argument(
        "--only",
        choices=("camera", "timer", "services", "start", "observation"),
        default=None,
        help="run only this scenario, with its floors unless --no-floors (camera: the image "
        "echo; timer: the --rates rows, without services, and the timer floors; services: the "
        "500 Hz row with its service round trips, and the service floor; start: the cold, warm "
        "and floor starts; observation: the observation trigger in lockstep, and the echo floor)",
    )
    ap.add_argument(
        "--camera-fastdds-profile",
        default=str(ROOT / "config" / "fastdds_images.xml"),
        help="Fast DDS profile (FASTDDS_DEFAULT_PROFILES_FILE) of every process of the camera "
        "scenario and of the image echo floor: this process, which publishes the images as a "
        "camera driver would, the node and the streamer (default: config/fastdds_images.xml, "
        "which carries a 640x480 image whole through shared memory; 'none': the environment's)",
    )
    ap.add_argument("--log-dir", type=Path, default=None, help="node logs (default: beside --out)")
    ap.add_argument("--stream", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--topic", default="/joint_states", help=argparse.SUPPRESS)
    ap.add_argument("--reliable", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stream is not None:
        return stream_main(args.stream, args.seconds or 10.0, args.topic, args.reliable)

    if args.goals:
        if args.only:
            ap.error("--goals is a full run's subset: give it without --only")
        args.camera_step_on, args.camera_intake, args.camera_lockstep = "none", False, False
        args.seconds_flight, args.publish_offset = 0.0, 0.0
    q = args.quick
    if args.start_rounds is None:  # the start goal is judged on a median (start_s)
        args.start_rounds = 3 if args.goals and not q else 1
    if args.start_rounds < 1:
        ap.error("--start-rounds must be >= 1")
    args.seconds = args.seconds or (3.0 if q else 10.0)
    args.seconds_1khz = args.seconds_1khz or (5.0 if q else 60.0)
    if args.seconds_flight is None:
        args.seconds_flight = 3.0 if q else 10.0
    args.obs_samples = args.obs_samples or (200 if q else 2000)
    args.service_calls = args.service_calls or (30 if q else 200)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    log_dir = args.log_dir = args.log_dir or args.out.parent / "ros_logs"
    if args.policy.startswith("test."):  # a test policy (test/tiny_policy.py): importable there
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = f"{ROOT}{os.pathsep}{old}" if old else str(ROOT)

    from test.ros_helpers import (
        HAVE_RCLPY,
        NODE_EXECUTABLE,
        RCLPY_IMPORT_ERROR,
        clean_stale_fastdds_shm,
        ros_harness,
    )

    if not HAVE_RCLPY:
        log(f"FAILED: {RCLPY_IMPORT_ERROR}")
        return 2
    if not NODE_EXECUTABLE.exists():
        log(f"FAILED: {NODE_EXECUTABLE} is not built (make setup, or bench/ros_gpu.sh)")
        return 2
    import torch

    from bench.host_facts import cpu_model, fastdds_segment_bytes, net_shm_delta, net_shm_load
    from bench.host_gate import probe as gate_probe

    log(
        f"device {args.device}, rates {rates} ({args.seconds} s each, 1 kHz "
        f"{args.seconds_1khz} s), {args.obs_samples} lockstep samples, {args.service_calls} "
        f"service calls; torch {torch.__version__}, cuda {torch.cuda.is_available()}; "
        f"node logs in {log_dir}"
    )
    # the host's speed before anything runs (bench/host_gate.py): a slow host is told from a
    # slow node by this; a quick run skips its 4-8 s
    host_probe = None if q else gate_probe()
    if host_probe:
        log(f"host: {host_probe}")
    t_all = time.monotonic()
    rows, svc, obs, errors = [], None, None, []
    starts: dict = {}
    floors: dict = {}
    retried: list[str] = []  # floors that failed once and then ran (their first error)
    attempts: list[dict] = []  # per scenario: wall s, UDP counter deltas, /dev/shm files

    def attempt(what: str, fn, *a):
        """Run one scenario in a fresh domain; a failure is logged and kept, the rest go on.
        First the shared-memory files of processes killed before it go (a new process given
        one of their ports would receive nothing)."""
        stale = clean_stale_fastdds_shm()
        if stale:
            log(f"removed the Fast DDS shared-memory files of {len(stale)} ended processes")
        before, t0 = net_shm_load(), time.monotonic()
        try:
            with ros_harness(log_dir) as ros:
                try:
                    return fn(ros, *a)
                except Exception as e:
                    log(f"FAILED {what}: {e}")
                    errors.append(f"{what}: {e}"[:2000])
                    return None
        finally:  # the machine's UDP drops and shared-memory files around it (host_facts.py)
            d = net_shm_delta(before, net_shm_load())
            attempts.append({"what": what, "s": round(time.monotonic() - t0, 1), **d})

    cam_profile = None if args.camera_fastdds_profile == "none" else args.camera_fastdds_profile

    @contextlib.contextmanager
    def camera_dds():
        """The camera scenario's Fast DDS profile in os.environ, which the processes started
        under it inherit. Not this process: Fast DDS reads the variable once, at its first
        participant, and keeps what it read (the "load the camera Fast DDS profile" attempt
        below)."""
        old = os.environ.get(PROFILE_VAR)
        if cam_profile is not None:
            os.environ[PROFILE_VAR] = cam_profile
        try:
            yield
        finally:
            if old is None:
                os.environ.pop(PROFILE_VAR, None)
            else:
                os.environ[PROFILE_VAR] = old

    full = args.only is None
    # a full run told to leave every camera scenario out leaves their image floors out too
    cameras = args.only == "camera" or (
        full and (args.camera_step_on != "none" or args.camera_intake)
    )
    profile_segment = None  # the bench process's own Fast DDS segment once the profile is loaded
    if cam_profile is not None and cameras:
        # This process publishes the camera scenarios' images, so its participants need the
        # profile, and Fast DDS loads profiles once per process, at the first participant: one
        # made without the variable (a start or timer scenario) left every later one on the
        # 512 KiB default segment, and the images at 12-14 ms (the "slow mode" of the full runs
        # up to 781f908: the image echo at 13.2-13.4 ms against 2.7 ms in --only camera runs;
        # reproduced on the CPU machine, 13.6 against 4.7 ms). So the first participant loads
        # it, before any scenario; the profile keeps the built-in transports' kinds (shared
        # memory, UDPv4), only with a larger segment.
        with camera_dds():
            seg = attempt("load the camera Fast DDS profile", lambda _ros: fastdds_segment_bytes())
        note = "" if seg is None or seg >= 8 << 20 else " (WARNING: not the profile's 8 MiB)"
        log(f"camera Fast DDS profile {cam_profile}: this process's segment {seg} B{note}")
        profile_segment = seg
    if cameras and not args.no_floors:
        # the 30 Hz image echo once more before the other scenarios: beside the one after the
        # camera scenarios it shows whether image delivery changed during the run
        with camera_dds():
            r = attempt(
                "floor image echo at 30 Hz, first", run_floor_image, args, 200, log_dir, CAMERA_HZ
            )
        if r is not None:
            floors["image_echo_30hz_first"] = r
    # start-up first: the cold one is then the first node start of this run
    if not args.no_startup and (full or args.only == "start"):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="flashrt_bench_cache_") as tmp:
            # unfused: the node with fuse=false (the plain step captured, nothing compiled),
            # after the warm start has filled the bytecode cache. Later rounds repeat all but
            # the cold start, as "warm#2" and so on.
            one = ["warm", "late", "unfused", "floor"]
            order = ["cold"] + one * args.start_rounds
            for i, label in enumerate(order):
                key = label if i <= len(one) else f"{label}#{(i - 1) // len(one) + 1}"
                # the cold start's files (bytecode, kernels) are written back to disk first:
                # that write-back, seconds later, slowed the imports of the starts right after
                # it (d449101: 2.0-2.2 s against 1.5-1.6), as no start of a robot long after
                # its first would be
                os.sync()
                r = attempt(f"{key} start", run_startup, args, Path(tmp), label, log_dir)
                if r is not None:
                    starts[key] = r

    svc_rate = 500.0 if 500.0 in rates else rates[0]
    timed = rates if full or args.only == "timer" else [svc_rate] if args.only == "services" else []
    for rate in timed:
        with_svc = (full or args.only == "services") and rate == svc_rate
        runs = [(args.seconds, 0.0)]  # (window, publish offset)
        if rate == 1000.0:  # the 60 s run at the offset, beside a plain one when there is one
            off = args.offset_1khz
            runs = [(args.seconds, 0.0), (args.seconds_1khz, off)] if off > 0 else []
            runs = runs[1:] if args.goals else runs  # the goal's row alone
            runs = runs or [(args.seconds_1khz, 0.0)]
        for secs, off in runs:
            label = f"timer {rate:g} Hz" + (f" offset {off:g}" if off else "")
            r = attempt(label, run_timer, args, rate, secs, with_svc, off)
            if r is not None:
                rows.append(r[0])
                svc = r[1] or svc
    offset_rows = []
    if args.publish_offset > 0 and full:
        r = attempt(
            f"timer {svc_rate:g} Hz offset", run_timer, args, svc_rate, args.seconds, False,
            args.publish_offset,
        )  # fmt: skip
        if r is not None:
            offset_rows.append(r[0])
    obs = None
    if full or args.only == "observation":
        obs = attempt("observation", run_observation, args, args.obs_samples)
    flight = None
    if args.seconds_flight > 0 and full:
        got = {}
        for key, extra in (("without", {}), ("with", {"flight_ticks": FLIGHT_TICKS})):
            r = attempt(
                f"flight 1 kHz {key}", run_timer, args, 1000.0, args.seconds_flight, False, 0.0,
                extra,
            )  # fmt: skip
            got[key] = flight_row(r[0]) if r is not None else None
        flight = flight_summary(got["with"], got["without"])
    cam = cam_frames = cam_lock = intake = None
    if cameras:
        n_pairs = args.camera_samples or (30 if q else 500)
        with camera_dds():
            if args.camera_step_on in ("joint_states", "both"):
                cam = attempt("camera", run_camera, args, n_pairs)
            if args.camera_step_on in ("cameras", "both"):
                cam_frames = attempt(
                    "camera frames", run_camera, args, n_pairs, 20, 1.0, CAMERA_JS_HZ, "cameras"
                )
                if args.camera_lockstep:
                    cam_lock = attempt(
                        "camera frames, lockstep",
                        run_camera,
                        *(args, min(n_pairs, 300), 20, 1.0, CAMERA_JS_HZ, "cameras", 0.0),
                    )
            if args.camera_intake:  # the images' way in alone, node and bare floor
                from bench.camera_intake import run_camera_intake, run_floor_camera_intake

                n_in = min(n_pairs, 200)
                intake = attempt("camera intake", run_camera_intake, args, n_in, log_dir)
                if not args.no_floors:
                    r = attempt("floor camera intake", run_floor_camera_intake, args, n_in, log_dir)
                    if r is not None:
                        floors["camera_intake"] = r

    if not args.no_floors:
        for key, fn, a in (
            ("echo", run_floor_echo, (args, args.obs_samples, log_dir)),
            ("service", run_floor_service, (args, args.service_calls, log_dir)),
            ("timer_500", run_floor_timer, (args, 500.0, args.seconds, log_dir)),
            # as long as the node's 1 kHz window, so their overruns compare
            ("timer_1000", run_floor_timer, (args, 1000.0, args.seconds_1khz, log_dir)),
            ("image_echo", run_floor_image, (args, min(args.obs_samples, 500), log_dir)),
            ("image_echo_30hz", run_floor_image, (args, 200, log_dir, CAMERA_HZ)),
        ):
            no_camera = key.startswith("image_echo") and not cameras
            if no_camera or (key == "timer_500" and args.goals):
                continue
            if (
                not full
                and key
                not in {
                    "camera": ("image_echo", "image_echo_30hz"),
                    "timer": ("timer_500", "timer_1000"),
                    "services": ("service",),
                    "observation": ("echo",),
                }.get(args.only, ())  # start: its floor is one of the starts
            ):
                continue
            with camera_dds() if key.startswith("image_echo") else contextlib.nullcontext():
                r = attempt(f"floor {key}", fn, *a)
                if r is None:  # once more, a new process in a new domain: a floor is a baseline
                    # (a ListCapsules floor after an --only services node never answered: 0809464)
                    first = errors.pop()
                    r = attempt(f"floor {key} (retried)", fn, *a)
                    (retried if r is not None else errors).append(first)
            if r is not None:
                floors[key] = r

    device_str = next((r["node"].get("device") for r in rows if r["node"].get("device")), None)
    result = {
        **headline(rows, offset_rows, svc, obs, floors, starts),
        "services": svc,
        "rates": rows,
        "rates_publish_offset": offset_rows,
        "observation": obs,
        "camera_to_action_p50_us": dig(cam, "camera_to_action_p50_us"),
        "camera_to_action_p99_us": dig(cam, "camera_to_action_p99_us"),
        "camera_compressed": bool(args.camera_compressed),
        "camera_fastdds_profile": cam_profile,
        "camera_fastdds_segment_bytes": profile_segment,
        "camera": with_image_floor(cam, floors, args.camera_compressed),
        "camera_frames_to_action_p50_us": dig(cam_frames, "camera_to_action_p50_us"),
        "camera_frames_to_action_p99_us": dig(cam_frames, "camera_to_action_p99_us"),
        "camera_frames": with_image_floor(cam_frames, floors, args.camera_compressed),
        # the pairs in lockstep, beside the lockstep image echo: the like-for-like comparison
        "camera_frames_lockstep_to_action_p50_us": dig(cam_lock, "camera_to_action_p50_us"),
        "camera_frames_lockstep_to_action_p99_us": dig(cam_lock, "camera_to_action_p99_us"),
        "camera_frames_lockstep": with_image_floor(cam_lock, floors, args.camera_compressed),
        "camera_intake": with_intake_floor(intake, floors),
        "floors": floors,
        "start": starts,
        "flight_1khz": flight,
        # per timer run; a run with publish offset is "<hz>_offset" (the 1 kHz rate has both)
        "node_diagnostics": {run_key(r): r["node"] for r in rows},
        "startup_s": {
            **{f"timer_{run_key(r)}": r["startup_s"] for r in rows},
            **({"observation": obs["startup_s"]} if obs else {}),
        },
        "device": args.device,
        "node_device": device_str,
        "policy": args.policy,
        "busy_wait": args.busy_wait,
        "goals": args.goals,
        "realtime_priority": args.realtime_priority,
        "cpu_affinity": args.cpu_affinity,
        "quick": q,
        "errors": errors,
        "floors_retried": retried,
        "attempts": attempts,
        "torch": torch.__version__,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "host_probe": host_probe,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_s": round(time.monotonic() - t_all, 1),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    log(f"wrote {args.out} in {result['wall_s']} s")
    return 1 if errors else 0


def with_image_floor(cam: dict | None, floors: dict, compressed: bool) -> dict | None:
    """A camera scenario's result with its p50 beside the image echo floor (none for
    compressed frames: the floor carries raw images)."""
    if cam is None:
        return None
    ours = cam["camera_to_action_p50_us"]
    floor = dig(floors.get("image_echo"), "p50_us")
    paced = dig(floors.get("image_echo_30hz"), "p50_us")
    return {
        **cam,
        "vs_floor_image_echo_p50_us": None if compressed else versus(ours, floor),
        "vs_floor_image_echo_30hz_p50_us": None if compressed else versus(ours, paced),
    }


def with_intake_floor(intake: dict | None, floors: dict) -> dict | None:
    """camera_intake.py's node figure beside its bare floor from the same run."""
    if intake is None:
        return None
    floor = dig(floors.get("camera_intake"), "p50_us")
    return {**intake, "vs_floor_camera_intake_p50_us": versus(intake["p50_us"], floor)}


def print_table(r: dict) -> None:
    print("\n| scenario | result |\n|---|---|")
    for row in r["rates"] + r["rates_publish_offset"]:
        n = row["node"]
        print(
            f"| timer {row['target_hz']:.0f} Hz, offset {row['publish_offset_s'] * 1e6:.0f} us, "
            f"{row['seconds']} s | achieved {row['achieved_hz']} Hz, "
            f"client jitter p99 {row['period_jitter_p99_us']} us, "
            f"node jitter p99 {n.get('jitter_p99_us')} us, "
            f"overruns {n.get('overruns_in_window')}, step p50/p99 {n.get('step_p50_us')}/"
            f"{n.get('step_p99_us')} us, CPU {row.get('cpu_pct')} %, "
            f"startup {row['startup_s']} s |"
        )
    o = r["observation"]
    if o:
        print(
            f"| observation trigger | obs->action p50/p99 {o['obs_to_action_p50_us']}/"
            f"{o['obs_to_action_p99_us']} us ({o['samples']} samples, {o['basis']}) |"
        )
    s = r["services"]
    if s:
        print(
            f"| services @{s['during_timer_hz']:.0f} Hz | checkpoint {s['checkpoint_p50_us']}/"
            f"{s['checkpoint_p99_us']}, restore {s['restore_p50_us']}/{s['restore_p99_us']}, "
            f"list {s['list_p50_us']}/{s['list_p99_us']} us (p50/p99) |"
        )
    for label, st in r["start"].items():
        print(
            f"| {label} start | first command {st['first_command_s']} s after spawn "
            f"(cache files {st['cache_dir_files_before']} -> {st['cache_dir_files_after']}) |"
        )
    fl = r.get("flight_1khz")
    for key in ("without", "with"):
        f = (fl or {}).get(key)
        if f:
            print(
                f"| 1 kHz, flight_ticks {fl['flight_ticks'] if key == 'with' else 0}, "
                f"{f['seconds']} s | achieved {f['achieved_hz']} Hz, overruns {f['overruns']}, "
                f"node jitter p99 {f['node_jitter_p99_us']} us, client jitter p99 "
                f"{f['client_jitter_p99_us']} us, node step p50 {f['node_step_p50_us']} us |"
            )
    print("\n| figure | ours | bare-rclpy floor | ours - floor |\n|---|---|---|---|")
    for k, v in r["vs_floor"].items():
        print(f"| {k} | {v['ours']} | {v['floor']} | {v['ours_minus_floor']} |")
    if "image_echo" in r["floors"]:
        print(f"| image_echo_p50_us (640x480 rgb8) | - | {r['floor_image_echo_p50_us']} | - |")
    for key, what in (
        ("camera", "default trigger, 30 Hz"),
        ("camera_frames", "step_on cameras, 30 Hz"),
        ("camera_frames_lockstep", "step_on cameras, lockstep"),
    ):
        c = r.get(key) or {}
        for fk, fl in (
            ("vs_floor_image_echo_p50_us", "lockstep"),
            ("vs_floor_image_echo_30hz_p50_us", "30 Hz"),
        ):
            v = c.get(fk)
            if v:
                print(f"| camera->action p50 ({what}) vs image echo ({fl}) | {v['ours']} | "
                      f"{v['floor']} | {v['ours_minus_floor']} |")  # fmt: skip
    if r.get("camera_intake"):
        v = r["camera_intake"]["vs_floor_camera_intake_p50_us"]
        print(f"| camera_intake_p50_us (2 images in) | {v['ours']} | {v['floor']} | "
              f"{v['ours_minus_floor']} |")  # fmt: skip
    keys = (
        "rate_hz period_jitter_p99_us obs_to_action_p50_us service_rtt_p50_us floor_echo_p50_us "
        "floor_service_p50_us floor_service_beside_p50_us floor_jitter_p99_us "
        "node_step_p50_us overruns_1khz_60s delayed_ticks_1khz_60s node_jitter_p99_us_1khz "
        "client_jitter_p99_us_1khz "
        "publish_offset_s_1khz client_jitter_p99_us_1khz_no_offset "
        "floor_jitter_p99_us_1khz floor_overruns_1khz "
        "warm_start_s cold_start_s late_fuse_start_s late_fuse_swap_s unfused_start_s "
        "floor_start_s node_cpu_pct_500hz "
        "floor_image_echo_p50_us"
    ).split()
    print("\nros: " + " ".join(f"{k}={r.get(k)}" for k in keys) + "\n", flush=True)


if __name__ == "__main__":
    sys.exit(main())
