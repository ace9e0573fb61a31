"""End-to-end ROS 2 benchmark of the installed flashrt_node (DESIGN.md section 8, "ros").

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
  (c) Checkpoint / Restore / ListCapsules round trips while the node runs the timer at 500 Hz.

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
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

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
def stream_main(rate: float, seconds: float, topic: str) -> int:
    import rclpy
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import JointState

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))
    rclpy.init()
    node = rclpy.create_node(f"flashrt_bench_streamer_{os.getpid()}")
    pub = node.create_publisher(JointState, topic, qos_profile_sensor_data)
    deadline = time.monotonic() + 20.0
    while pub.get_subscription_count() == 0 and time.monotonic() < deadline and not stop["flag"]:
        time.sleep(0.01)
    period = 1.0 / rate
    msg = JointState(name=list(JOINTS))
    n = late = 0
    t_end = time.monotonic() + seconds
    nxt = time.monotonic()
    while not stop["flag"] and time.monotonic() < t_end:
        rem = nxt - time.monotonic()
        if rem > 0.0003:
            time.sleep(rem - 0.0003)
        while time.monotonic() < nxt:
            pass
        msg.position, msg.velocity = obs_row(n)
        pub.publish(msg)
        n += 1
        nxt += period
        if time.monotonic() > nxt:  # we are behind: do not burst, skip the lost slots
            late += 1
            nxt = time.monotonic() + period
    print(json.dumps({"published": n, "late": late}), flush=True)
    node.destroy_node()
    rclpy.shutdown()
    return 0


# ------------------------------------------------------------------------------------------------
class Client:
    """Subscriptions and a persistent executor on the harness node."""

    def __init__(self, ros, proc):
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        from sensor_msgs.msg import JointState
        from std_msgs.msg import Float64MultiArray

        self.ros, self.proc, n = ros, proc, ros.node
        self.cmd_cb: list[int] = []  # monotonic ns in the callback
        self.cmd_rx: list[int] = []  # DDS received_timestamp (system clock ns), 0 if unset
        self.cmd_src: list[int] = []  # DDS source_timestamp (node's publish, system clock ns)
        self.diag: list[tuple[float, dict]] = []
        self._subs = [
            n.create_subscription(Float64MultiArray, proc.topic("commands"), self._on_cmd, 1000),
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

    def _on_diag(self, msg) -> None:
        for st in msg.status:
            if "flashrt" in st.name and self.proc.fqn in st.name:
                self.diag.append((time.monotonic(), {kv.key: kv.value for kv in st.values}))

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

    def wait_subscribed(self, timeout: float = 20.0) -> None:
        if not self.spin_until(lambda: self._js.get_subscription_count() > 0, timeout):
            raise RuntimeError("node does not subscribe joint_states\n" + self.proc.log_tail())

    def publish_obs(self, k: int) -> None:
        self._msg.position, self._msg.velocity = obs_row(k)
        self._js.publish(self._msg)

    def call(self, client, request, timeout: float = 30.0):
        """Round trip of one service call (s), with the reply; spins this client's executor."""
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

    def latest_diag(self, timeout: float = 3.0) -> dict:
        n = len(self.diag)
        self.spin_until(lambda: len(self.diag) > n, timeout)
        return self.diag[-1][1] if self.diag else {}


def diag_numbers(d: dict) -> dict:
    out = {}
    for k in (
        "rate_hz",
        "steps",
        "step_p50_us",
        "step_p99_us",
        "jitter_p99_us",
        "overruns",
        "refused_inputs",
        "stale_ticks",
        "service_p50_us",
        "service_p99_us",
        "device",
        "state",
    ):
        if k in d:
            try:
                out[k] = float(d[k]) if k not in ("device", "state") else d[k]
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
    try:
        ros.call(cli, srv.ListCapsules.Request(), timeout=left)
    except Exception as e:
        raise RuntimeError(
            f"{proc} offered services but did not answer ListCapsules in "
            f"{left:.0f} s ({e!r}); log tail:\n{proc.log_tail()}"
        ) from e
    startup = time.monotonic() - t0
    log(f"node up in {startup:.1f} s ({params})")
    return proc, startup


def node_params(args, **extra) -> dict:
    p = {"device": args.device, "policy": args.policy, "obs_timeout_s": 0.5}
    p.update(extra)
    return p


def streamer(rate: float, seconds: float, topic: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--stream",
        str(rate),
        "--seconds",
        str(seconds),
        "--topic",
        topic,
    ]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def stop_streamer(sp: subprocess.Popen) -> dict:
    if sp.poll() is None:
        sp.send_signal(signal.SIGTERM)
    try:
        out, _ = sp.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        sp.kill()
        out, _ = sp.communicate()
    for line in reversed((out or "").splitlines()):
        with contextlib.suppress(ValueError):
            return json.loads(line)
    return {"output": (out or "")[-500:]}


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


# ------------------------------------------------------------------------------------------------
def run_timer(
    ros, args, rate: float, seconds: float, services: bool, offset: float = 0.0
) -> tuple[dict, dict | None]:
    """One timer-trigger node at `rate`: command rate and jitter; optionally service round trips.
    `offset` is the node's publish_offset_s."""
    proc, startup = start_node(
        ros,
        node_params(args, trigger="timer", rate_hz=rate, publish_offset_s=offset),
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
        i0, t0 = len(cl.cmd_cb), time.monotonic_ns()
        cl.spin_for(seconds)
        i1, t1 = len(cl.cmd_cb), time.monotonic_ns()
        d1 = cl.latest_diag(3.0)
        row = {
            "target_hz": rate,
            "publish_offset_s": offset,
            "seconds": round((t1 - t0) * 1e-9, 2),
            "commands": i1 - i0,
            "achieved_hz": round((i1 - i0) / ((t1 - t0) * 1e-9), 1),
            "startup_s": round(startup, 1),
        }
        cb = jitter_stats(cl.cmd_cb[i0:i1], 1.0 / rate)
        rx = jitter_stats(cl.cmd_rx[i0:i1], 1.0 / rate)
        src = jitter_stats(cl.cmd_src[i0:i1], 1.0 / rate)
        row["client_cb"] = cb
        row["client_dds"] = rx
        row["node_publish"] = src
        row["basis"] = "dds" if rx else "cb"
        row["period_jitter_p99_us"] = (rx or cb).get("jitter_p99_us")
        nd = diag_numbers(d1)
        if "overruns" in nd and "overruns" in diag_numbers(d0):
            nd["overruns_in_window"] = nd["overruns"] - diag_numbers(d0)["overruns"]
        if "steps" in nd and "steps" in diag_numbers(d0):
            nd["steps_in_window"] = nd["steps"] - diag_numbers(d0)["steps"]
        row["node"] = nd
        log(
            f"timer {rate:.0f} Hz: achieved {row['achieved_hz']} Hz, client jitter p99 "
            f"{row['period_jitter_p99_us']} us ({row['basis']}), node jitter p99 "
            f"{nd.get('jitter_p99_us')} us, overruns {nd.get('overruns_in_window')}, "
            f"step p50/p99 {nd.get('step_p50_us')}/{nd.get('step_p99_us')} us"
        )
        if services:
            svc = run_services(cl, proc, args.service_calls)
            svc["during_timer_hz"] = rate
        row["streamer"] = stop_streamer(sp)
    finally:
        if sp is not None and sp.poll() is None:
            stop_streamer(sp)
        cl.close()
        proc.stop()
    return row, svc


def headline(rows: list, offset_rows: list, svc: dict | None, obs: dict | None) -> dict:
    """The "ros" object of DESIGN.md section 8 from the scenario rows, with the rules stated."""
    sustained = [r for r in rows if r["achieved_hz"] >= 0.98 * r["target_hz"]]
    best = max(sustained or rows, key=lambda r: r["target_hz"], default=None)
    # period jitter: at 500 Hz (the goal's rate), the publish-offset run when there is one
    at = [r for r in offset_rows + rows if r["target_hz"] == 500.0] or rows
    j = at[0] if at else None
    return {
        "rate_hz": (best["target_hz"] if best in sustained else best["achieved_hz"]) if best else 0,
        "period_jitter_p99_us": (j["node_publish"] or {}).get("jitter_p99_us") if j else None,
        "obs_to_action_p50_us": obs["obs_to_action_p50_us"] if obs else None,
        "service_rtt_p50_us": max(svc["checkpoint_p50_us"], svc["restore_p50_us"]) if svc else None,
        "obs_to_action_p99_us": obs["obs_to_action_p99_us"] if obs else None,
        "period_jitter_at": {"rate_hz": j["target_hz"], "publish_offset_s": j["publish_offset_s"]}
        if j
        else None,
        "delivery_jitter_p99_us": j["client_dds"].get("jitter_p99_us") if j else None,
        "rate_rule": "highest timer rate achieved within 2% (overruns in the rows)",
        "jitter_rule": "p99 of |interval - period| between the node's commands, from the DDS "
        "source timestamps (taken when the node writes each one) read by the client; "
        "delivery_jitter_p99_us: the same from the client's DDS reception stamps, so it adds "
        "the loopback transport and the receiving process",
        "service_rtt_rule": "max of the Checkpoint and Restore p50 (ListCapsules below)",
    }


def run_services(cl: Client, proc, n: int) -> dict:
    from flashrt_ros import srv

    ros = cl.ros
    ck = ros.client(srv.Checkpoint, proc.service("checkpoint"))
    rs = ros.client(srv.Restore, proc.service("restore"))
    ls = ros.client(srv.ListCapsules, proc.service("list_capsules"))
    dr = ros.client(srv.DropCapsule, proc.service("drop_capsule"))
    for c in (ck, rs, ls, dr):
        if not c.wait_for_service(timeout_sec=10.0):
            raise RuntimeError(f"service {c.srv_name} not available")
    t_ck, t_rs, t_ls, fails = [], [], [], []
    for _ in range(5):  # warm-up, not timed
        _, r = cl.call(ck, srv.Checkpoint.Request())
        if r.success:
            cl.call(rs, srv.Restore.Request(capsule=r.capsule.id))
            cl.call(dr, srv.DropCapsule.Request(capsule=r.capsule.id))
        cl.call(ls, srv.ListCapsules.Request())
    for _ in range(n):
        dt, r = cl.call(ck, srv.Checkpoint.Request())
        t_ck.append(dt)
        if not r.success:
            fails.append(f"checkpoint: {r.message}")
            continue
        dt, rr = cl.call(rs, srv.Restore.Request(capsule=r.capsule.id, verify=False))
        t_rs.append(dt)
        if not rr.success:
            fails.append(f"restore: {rr.message}")
        dt, _ = cl.call(ls, srv.ListCapsules.Request())
        t_ls.append(dt)
        cl.call(dr, srv.DropCapsule.Request(capsule=r.capsule.id))  # keep the pool from filling
    us = lambda a: np.asarray(a) * 1e6  # noqa: E731
    nd = diag_numbers(cl.latest_diag(3.0))
    out = {
        "node_handler_p50_us": nd.get("service_p50_us"),
        "node_handler_p99_us": nd.get("service_p99_us"),
        "calls": n,
        "failures": len(fails),
        "first_failures": fails[:3],
        "checkpoint_p50_us": pct(us(t_ck), 50),
        "checkpoint_p99_us": pct(us(t_ck), 99),
        "restore_p50_us": pct(us(t_rs), 50),
        "restore_p99_us": pct(us(t_rs), 99),
        "list_p50_us": pct(us(t_ls), 50),
        "list_p99_us": pct(us(t_ls), 99),
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
        lat_cb, lat_rx = [], []
        warm = 50
        for k in range(n + warm):
            m = len(cl.cmd_cb)
            t_wall = time.time_ns()
            t_mono = time.monotonic_ns()
            cl.publish_obs(k)
            if not cl.spin_until(lambda m=m: len(cl.cmd_cb) > m, 10.0):
                raise RuntimeError(f"no command for observation {k}\n{proc.log_tail()}")
            if k >= warm:
                lat_cb.append((cl.cmd_cb[-1] - t_mono) * 1e-3)
                if cl.cmd_rx[-1] > 0:
                    lat_rx.append((cl.cmd_rx[-1] - t_wall) * 1e-3)
        d = diag_numbers(cl.latest_diag(3.0))
    finally:
        cl.close()
        proc.stop()
    basis = "dds" if len(lat_rx) == len(lat_cb) else "cb"
    head = lat_rx if basis == "dds" else lat_cb
    out = {
        "samples": len(lat_cb),
        "basis": basis,
        "startup_s": round(startup, 1),
        "obs_to_action_p50_us": pct(head, 50),
        "obs_to_action_p99_us": pct(head, 99),
        "cb_p50_us": pct(lat_cb, 50),
        "cb_p99_us": pct(lat_cb, 99),
        "dds_p50_us": pct(lat_rx, 50),
        "dds_p99_us": pct(lat_rx, 99),
        "node": d,
    }
    log(
        f"observation trigger ({len(lat_cb)} lockstep samples): obs->action p50/p99 "
        f"{out['obs_to_action_p50_us']}/{out['obs_to_action_p99_us']} us ({basis}); "
        f"in the client callback {out['cb_p50_us']}/{out['cb_p99_us']} us; node step p50 "
        f"{d.get('step_p50_us')} us"
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--policy", default="builtin:hybrid")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ros.json")
    ap.add_argument("--quick", action="store_true", help="short smoke run (CPU)")
    ap.add_argument("--rates", default="500,1000", help="timer rates to try, Hz")
    ap.add_argument("--seconds", type=float, default=None, help="window per rate (10; quick 3)")
    ap.add_argument("--obs-samples", type=int, default=None, help="lockstep (2000; quick 200)")
    ap.add_argument("--service-calls", type=int, default=None, help="per service (200; quick 30)")
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument(
        "--publish-offset",
        type=float,
        default=0.0004,
        help="also run the service rate with this publish_offset_s (0 = skip)",
    )
    ap.add_argument("--log-dir", type=Path, default=None, help="node logs (default: beside --out)")
    ap.add_argument("--stream", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--topic", default="/joint_states", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.stream is not None:
        return stream_main(args.stream, args.seconds or 10.0, args.topic)

    q = args.quick
    args.seconds = args.seconds or (3.0 if q else 10.0)
    args.obs_samples = args.obs_samples or (200 if q else 2000)
    args.service_calls = args.service_calls or (30 if q else 200)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    log_dir = args.log_dir or args.out.parent / "ros_logs"

    from test.ros_helpers import HAVE_RCLPY, NODE_EXECUTABLE, RCLPY_IMPORT_ERROR, ros_harness

    if not HAVE_RCLPY:
        log(f"FAILED: {RCLPY_IMPORT_ERROR}")
        return 2
    if not NODE_EXECUTABLE.exists():
        log(f"FAILED: {NODE_EXECUTABLE} is not built (make setup, or bench/ros_gpu.sh)")
        return 2
    import torch

    log(
        f"device {args.device}, rates {rates}, {args.seconds} s each, {args.obs_samples} lockstep "
        f"samples, {args.service_calls} service calls; torch {torch.__version__}, cuda "
        f"{torch.cuda.is_available()}; node logs in {log_dir}"
    )
    t_all = time.monotonic()
    rows, svc, obs, errors = [], None, None, []
    svc_rate = 500.0 if 500.0 in rates else rates[0]
    for rate in rates:
        with ros_harness(log_dir) as ros:
            try:
                row, s = run_timer(ros, args, rate, args.seconds, services=(rate == svc_rate))
                rows.append(row)
                svc = s or svc
            except Exception as e:  # keep the other scenarios
                log(f"FAILED timer {rate} Hz: {e}")
                errors.append(f"timer {rate}: {e}"[:2000])
    offset_rows = []
    if args.publish_offset > 0:
        with ros_harness(log_dir) as ros:
            try:
                offset_rows.append(
                    run_timer(ros, args, svc_rate, args.seconds, False, args.publish_offset)[0]
                )
            except Exception as e:
                log(f"FAILED timer {svc_rate} Hz with publish offset: {e}")
                errors.append(f"timer {svc_rate} offset: {e}"[:2000])
    with ros_harness(log_dir) as ros:
        try:
            obs = run_observation(ros, args, args.obs_samples)
        except Exception as e:
            log(f"FAILED observation trigger: {e}")
            errors.append(f"observation: {e}"[:2000])

    device_str = next((r["node"].get("device") for r in rows if r["node"].get("device")), None)
    result = {
        **headline(rows, offset_rows, svc, obs),
        "services": svc,
        "rates": rows,
        "rates_publish_offset": offset_rows,
        "observation": obs,
        "node_diagnostics": {str(int(r["target_hz"])): r["node"] for r in rows},
        "startup_s": {
            **{f"timer_{int(r['target_hz'])}": r["startup_s"] for r in rows},
            **({"observation": obs["startup_s"]} if obs else {}),
        },
        "device": args.device,
        "node_device": device_str,
        "policy": args.policy,
        "quick": q,
        "errors": errors,
        "torch": torch.__version__,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_s": round(time.monotonic() - t_all, 1),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print_table(result)
    log(f"wrote {args.out} in {result['wall_s']} s")
    return 1 if errors else 0


def print_table(r: dict) -> None:
    print("\n| scenario | result |\n|---|---|")
    for row in r["rates"] + r["rates_publish_offset"]:
        n = row["node"]
        print(
            f"| timer {row['target_hz']:.0f} Hz, offset {row['publish_offset_s'] * 1e6:.0f} us "
            f"| achieved {row['achieved_hz']} Hz, "
            f"client jitter p99 {row['period_jitter_p99_us']} us, "
            f"node jitter p99 {n.get('jitter_p99_us')} us, "
            f"overruns {n.get('overruns_in_window')}, step p50/p99 {n.get('step_p50_us')}/"
            f"{n.get('step_p99_us')} us, startup {row['startup_s']} s |"
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
    print(
        f"\nros: rate_hz={r['rate_hz']} period_jitter_p99_us={r['period_jitter_p99_us']} "
        f"obs_to_action_p50_us={r['obs_to_action_p50_us']} "
        f"service_rtt_p50_us={r['service_rtt_p50_us']}\n",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
