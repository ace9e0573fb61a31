"""Memory soak of the flashrt node: its resident memory (VmRSS, RssAnon) and thread count over
minutes of steady traffic, to tell a leak (RSS that keeps climbing) from warm-up and allocator
caching (RSS that rises, then stays flat).

    . ./env.sh && python3 bench/memory_soak.py --mode mix --minutes 8 --out FILE.json

Starts `python3 -m flashrt_ros.node.main` (device cpu, timer trigger at --rate-hz, flight
recorder of --flight-ticks ticks) under its own namespace, in its own ROS_DOMAIN_ID (--domain)
with LOCALHOST discovery, streams joint_states to it at 100 Hz, and calls its services from
this process with a real rclpy client, in a loop chosen by --mode:

  mix           checkpoint, list, restore, branch, rollout; every few rounds a committed branch
                rollout, drop_session, rewind, reset_session; most capsules dropped (every 4th
                kept, so the pool fills and evicts); a dump_flight every 100 rounds
  js_only       no calls: the joint_states stream and the timer loop alone (the baseline)
  list_only     list_capsules back to back
  ckpt_drop     checkpoint then drop_capsule
  rollout_only  a 20-step scratch rollout
  dump_only     dump_flight once a second (the files are removed after each)
  churn         list_capsules through a new client per call, destroyed after it (as a script
                or the ros2 CLI does)

Every --sample-s seconds it reads /proc/<pid>/status of the node. At the end it writes the JSON
(the samples, calls and failures per service, host facts, and the summary: RSS at start, after
the warm-up and at the end; least-squares slope in MB/min over the first and the last third),
prints one line, and stops the node (SIGINT, then SIGKILL of its process group), on Ctrl-C or
an error too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("mix", "js_only", "list_only", "ckpt_drop", "rollout_only", "dump_only", "churn")
STATUS_KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmSize", "Threads")
OBS_DIM = 12  # the default policy's: 6 joint positions and 6 velocities
JS_HZ = 100.0


def log(*a) -> None:
    print("[memory_soak]", *a, flush=True)


def isolate(domain: int) -> None:
    """Keep DDS on this machine and in our own domain; must run before rclpy is imported (the
    node process inherits the same environment)."""
    os.environ["ROS_DOMAIN_ID"] = str(domain)
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ.pop("ROS_LOCALHOST_ONLY", None)  # deprecated; conflicts with the range
    os.environ.pop("ROS_STATIC_PEERS", None)  # contacted whatever the discovery range


# -- the node process ---------------------------------------------------------------------------
def node_command(args: argparse.Namespace, work: Path) -> list[str]:
    """The node's command line: `-m flashrt_ros.node.main`, as a user runs it from a checkout."""
    from test.ros_helpers import ros_param_args

    params = {
        "device": args.device,
        "trigger": "timer",
        "rate_hz": float(args.rate_hz),
        "flight_ticks": int(args.flight_ticks),
        "capsule_dir": str(work / "capsules"),
        "compile_cache_dir": str(work / "compile_cache"),
    }
    return [
        sys.executable,
        "-m",
        "flashrt_ros.node.main",
        "--ros-args",
        "-r",
        f"__ns:=/{args.namespace}",
        *ros_param_args(params),
    ]


def start_node(cmd: list[str], log_path: Path, namespace: str):
    """Spawn the node in a session of its own: a Ctrl-C here reaches this process only, which
    then stops the node in order, and a last-resort kill takes any child it started too."""
    from test.ros_helpers import NodeProcess

    env = dict(os.environ, PYTHONUNBUFFERED="1", RCUTILS_LOGGING_BUFFERED_STREAM="0")
    with open(log_path, "wb") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=str(ROOT),
            start_new_session=True,
        )
    return NodeProcess(proc, log_path, "flashrt", namespace)


def stop_node(node, timeout: float = 20.0) -> int | None:
    """SIGINT (the node's clean shutdown), then SIGKILL of its process group after `timeout` s;
    the group is killed in any case, so no worker it spawned outlives it."""
    p = node.proc
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGINT)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log(f"node pid {p.pid} still running {timeout:g} s after SIGINT: killed")
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=10)
    return p.returncode


def proc_status(pid: int) -> dict[str, int]:
    """The memory lines (kB) and the thread count of /proc/<pid>/status."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(value.split()[0])
    return out


# -- traffic ------------------------------------------------------------------------------------
class Traffic:
    """The service calls of one mode, counted per service; a failure is a call that raised, timed
    out, or answered success=False (the first few messages are kept)."""

    def __init__(self, ros, node, mode: str) -> None:
        from bench.ros_bench import ServiceCaller
        from test.node_client import SERVICE_TYPES

        self.mode, self.node = mode, node
        self.caller = ServiceCaller(ros)
        self.types = SERVICE_TYPES
        self.clients = {k: self.caller.client(t, node.service(k)) for k, t in self.types.items()}
        self.calls = dict.fromkeys(SERVICE_TYPES, 0)
        self.failures = dict.fromkeys(SERVICE_TYPES, 0)
        self.examples: list[str] = []
        self.rounds = 0
        self.rnd = random.Random(0)

    def call(self, name: str, client=None, **fields):
        req = self.types[name].Request()
        for k, v in fields.items():
            setattr(req, k, v)
        self.calls[name] += 1
        try:
            _, resp = self.caller.call(client or self.clients[name], req, timeout=60.0)
        except Exception as e:
            self._fail(name, repr(e))
            return None
        if not getattr(resp, "success", True):
            self._fail(name, resp.message)
        return resp

    def _fail(self, name: str, why: str) -> None:
        self.failures[name] += 1
        if len(self.examples) < 10:
            self.examples.append(f"{name}: {why}"[:300])
            log("FAIL", self.examples[-1])

    def obs(self, steps: int) -> list[float]:
        return [self.rnd.uniform(-0.5, 0.5) for _ in range(OBS_DIM * steps)]

    def dump(self, capsule_dir: Path) -> None:
        """dump_flight, then remove what it wrote: the soak measures the node, not the disk."""
        r = self.call("dump_flight")
        if r is not None and r.success and r.files:
            folder = Path(r.files[0]).parent
            if folder.resolve().is_relative_to(capsule_dir.resolve()):
                shutil.rmtree(folder, ignore_errors=True)

    def round(self, capsule_dir: Path) -> None:
        """One round of the mode's calls (js_only only waits)."""
        self.rounds += 1
        i, m = self.rounds, self.mode
        if m == "js_only":
            time.sleep(1.0)
        elif m == "list_only":
            self.call("list_capsules")
        elif m == "ckpt_drop":
            r = self.call("checkpoint", name="soak")
            if r is not None and r.success:
                self.call("drop_capsule", capsule=r.capsule.id)
        elif m == "rollout_only":
            self.call("rollout", observations=self.obs(20), n_steps=20)
        elif m == "dump_only":
            self.dump(capsule_dir)
            time.sleep(1.0)
        elif m == "churn":
            name = "list_capsules"
            c = self.caller.client(self.types[name], self.node.service(name))
            try:
                if c.wait_for_service(timeout_sec=10.0):
                    self.call(name, client=c)
                else:
                    self.calls[name] += 1
                    self._fail(name, "a new client never matched the service")
            finally:
                self.caller.node.destroy_client(c)
        else:
            self.mix_round(i, capsule_dir)
        time.sleep(0.02)

    def mix_round(self, i: int, capsule_dir: Path) -> None:
        r = self.call("checkpoint")
        cid = r.capsule.id if r is not None and r.success else ""
        self.call("list_capsules")
        if cid:
            self.call("restore", capsule=cid)
            self.call("branch", capsule=cid, session="b1", goal=[0.1] * 6 if i % 2 else [])
        self.call("rollout", observations=self.obs(20), n_steps=20)
        if i % 5 == 0 and cid:
            self.call("branch", capsule=cid, session="b2")
            self.call("rollout", observations=self.obs(10), n_steps=10, session="b2", commit=True)
            self.call("drop_session", session="b2")
        if i % 3 == 0:
            self.call("rewind", steps_back=2)
        if i % 7 == 0:
            self.call("reset_session", session="b1")
        if cid and i % 4 != 0:  # every 4th kept: the pool fills and evicts the oldest
            self.call("drop_capsule", capsule=cid)
        if i % 100 == 0:
            self.dump(capsule_dir)

    def close(self) -> None:
        self.caller.close()


def stream_joint_states(ros, topic: str, stop: threading.Event) -> threading.Thread:
    """joint_states at 100 Hz from a thread (absolute deadlines, no bursts after a stall), as a
    robot streams them; the timer trigger takes the latest."""
    import math

    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import JointState

    pub = ros.node.create_publisher(JointState, topic, qos_profile_sensor_data)
    names = [f"joint{i}" for i in range(1, 7)]

    def feed() -> None:
        k, nxt = 0, time.monotonic()
        while not stop.is_set():
            pos = [0.1 * math.sin(0.01 * k + j) for j in range(6)]
            pub.publish(JointState(name=names, position=pos, velocity=[0.0] * 6))
            k += 1
            nxt = max(nxt + 1.0 / JS_HZ, time.monotonic())
            stop.wait(nxt - time.monotonic())

    t = threading.Thread(target=feed, name="joint_states", daemon=True)
    t.start()
    return t


def sample(pid: int, t0: float, calls: int) -> dict:
    """One sample of the node's /proc status, in MB, at t_s seconds into the traffic."""
    st = proc_status(pid)

    def mb(key: str) -> float:
        return round(st.get(key, 0) / 1024, 1)

    return {
        "t_s": round(time.monotonic() - t0, 1),
        "rss_mb": mb("VmRSS"),
        "anon_mb": mb("RssAnon"),
        "file_mb": mb("RssFile"),
        "shmem_mb": mb("RssShmem"),
        "vmsize_mb": mb("VmSize"),
        "threads": st.get("Threads", 0),
        "calls": calls,
    }


def sample_loop(
    pid: int, every: float, t0: float, traffic: Traffic, out: list, stop: threading.Event
) -> None:
    """Append a sample every `every` s until stopped or the node is gone."""
    while not stop.is_set():
        try:
            out.append(sample(pid, t0, sum(traffic.calls.values())))
        except (FileNotFoundError, ProcessLookupError):
            return
        stop.wait(every)


# -- summary ------------------------------------------------------------------------------------
def nearest(samples: list[dict], t: float, key: str = "rss_mb") -> float | None:
    """The value of the sample nearest to t s (None when no sample comes within 15 s)."""
    best = min(samples, key=lambda s: abs(s["t_s"] - t), default=None)
    return best[key] if best is not None and abs(best["t_s"] - t) <= 15 else None


def slope(samples: list[dict], lo: float, hi: float, key: str = "rss_mb") -> float | None:
    """Least-squares slope in MB/min of `key` over the samples with lo <= t <= hi: every sample
    counts, so one allocator hiccup at an end point does not make or hide a trend."""
    pts = [(s["t_s"] / 60, s[key]) for s in samples if lo <= s["t_s"] <= hi]
    if len(pts) < 3:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return round(sum((x - mx) * (y - my) for x, y in pts) / sxx, 3) if sxx else None


def summarize(samples: list[dict], warmup_s: float) -> dict:
    """Start, after warm-up, end and peak RSS; slopes over the first and last third of the run."""
    if not samples:
        return {}
    end = samples[-1]["t_s"]
    third = end / 3
    return {
        "duration_s": end,
        "rss_start_mb": samples[0]["rss_mb"],
        "rss_warm_mb": nearest(samples, warmup_s) if end >= warmup_s else None,
        "rss_end_mb": samples[-1]["rss_mb"],
        "rss_peak_mb": max(s["rss_mb"] for s in samples),
        "anon_start_mb": samples[0]["anon_mb"],
        "anon_end_mb": samples[-1]["anon_mb"],
        "threads_start": samples[0]["threads"],
        "threads_end": samples[-1]["threads"],
        "slope_first_third_mb_min": slope(samples, 0, third),
        "slope_last_third_mb_min": slope(samples, end - third, end),
        "anon_slope_last_third_mb_min": slope(samples, end - third, end, "anon_mb"),
        "slope_after_warmup_mb_min": slope(samples, warmup_s, end) if end > warmup_s else None,
    }


def host_facts() -> dict:
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*a: str) -> str:
        env = dict(os.environ, GIT_OPTIONAL_LOCKS="0")  # read only: no index refresh
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, env=env)
        return r.stdout.strip()

    return {
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "loadavg": os.getloadavg(),
        "kernel": platform.release(),
        "libc": " ".join(platform.libc_ver()),
        "python": platform.python_version(),
        "torch": version("torch"),
        "rmw": os.environ.get("RMW_IMPLEMENTATION"),
        "flashrt_malloc": os.environ.get("FLASHRT_MALLOC"),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def plain_interrupts() -> None:
    """Ctrl-C and SIGTERM raise KeyboardInterrupt here. rclpy.init's handlers would instead
    shut the context down and let the loop go on failing every call, with the node running."""
    from rclpy.signals import uninstall_signal_handlers

    uninstall_signal_handlers()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Modes: " + ", ".join(MODES) + " (see the module docstring).",
    )
    ap.add_argument("--mode", choices=MODES, default="mix", help="the traffic (default mix)")
    ap.add_argument("--minutes", type=float, default=8.0, help="traffic duration (default 8)")
    ap.add_argument("--rate-hz", type=float, default=100.0, help="node timer rate (default 100)")
    ap.add_argument(
        "--flight-ticks", type=int, default=50, help="flight recorder ring length (default 50)"
    )
    ap.add_argument("--device", default="cpu", help="the node's device parameter (default cpu)")
    ap.add_argument("--domain", type=int, default=219, help="ROS_DOMAIN_ID (default 219)")
    ap.add_argument("--namespace", default="memsoak", help="the node's namespace")
    ap.add_argument("--sample-s", type=float, default=10.0, help="sampling period (default 10)")
    ap.add_argument(
        "--warmup-s", type=float, default=120.0, help="the 'after warm-up' point (default 120)"
    )
    ap.add_argument("--out", type=Path, help="write the JSON here (FILE.json)")
    ap.add_argument(
        "--log-dir",
        type=Path,
        help="node log, capsule_dir and compile cache (default: a new folder in /tmp, kept)",
    )
    ap.add_argument(
        "--start-timeout", type=float, default=180.0, help="seconds to wait for the node's services"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    isolate(args.domain)
    work = args.log_dir or Path(tempfile.mkdtemp(prefix="memsoak-"))
    work.mkdir(parents=True, exist_ok=True)
    from test.node_client import SERVICE_TYPES
    from test.ros_helpers import ros_harness

    cmd = node_command(args, work)
    result: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "mode": args.mode,
        "settings": {
            "minutes": args.minutes,
            "rate_hz": args.rate_hz,
            "flight_ticks": args.flight_ticks,
            "device": args.device,
            "domain": args.domain,
            "namespace": args.namespace,
            "joint_states_hz": JS_HZ,
            "sample_s": args.sample_s,
            "warmup_s": args.warmup_s,
            "log_dir": str(work),
            "node_command": " ".join(cmd),
        },
        "host": host_facts(),
    }
    samples: list[dict] = []
    stop = threading.Event()
    node = traffic = None
    try:
        with ros_harness(work, args.domain) as ros:
            plain_interrupts()
            t_spawn = time.monotonic()
            node = start_node(cmd, work / "node.log", args.namespace)
            log(f"node pid {node.pid}, log {node.log_path}")
            try:
                ros.wait_for_services(node, tuple(SERVICE_TYPES), args.start_timeout)
                traffic = Traffic(ros, node, args.mode)
                if traffic.call("list_capsules") is None:
                    raise RuntimeError(f"the node does not answer; log:\n{node.log_tail()}")
                result["startup_s"] = round(time.monotonic() - t_spawn, 1)
                log(f"services up in {result['startup_s']} s; {args.mode} for {args.minutes} min")
                stream_joint_states(ros, node.topic("joint_states"), stop)
                t0 = time.monotonic()
                threading.Thread(
                    target=sample_loop,
                    args=(node.pid, args.sample_s, t0, traffic, samples, stop),
                    daemon=True,
                ).start()
                end = t0 + args.minutes * 60
                while time.monotonic() < end:
                    if not node.alive():
                        raise RuntimeError(f"the node exited; log:\n{node.log_tail()}")
                    traffic.round(work / "capsules")
                samples.append(sample(node.pid, t0, sum(traffic.calls.values())))  # the closing one
                result["completed"] = True
            except KeyboardInterrupt:
                result["completed"] = False
                result["interrupted"] = True
                log("interrupted: stopping the node")
            finally:
                stop.set()
                if traffic is not None:
                    traffic.close()
                result["node_exit_code"] = stop_node(node)
    finally:
        if node is not None and node.proc.poll() is None:  # the harness failed before stop_node
            stop_node(node)
    result["samples"] = samples
    if traffic is not None:
        result["rounds"] = traffic.rounds
        result["calls"] = {k: v for k, v in traffic.calls.items() if v}
        result["failures"] = {k: v for k, v in traffic.failures.items() if v}
        result["failure_examples"] = traffic.examples
    result["summary"] = s = summarize(samples, args.warmup_s)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if s:
        print(
            f"memory_soak {args.mode} {s['duration_s'] / 60:.1f} min: RSS start "
            f"{s['rss_start_mb']} / warm {s['rss_warm_mb']} / end {s['rss_end_mb']} MB, slope "
            f"first third {s['slope_first_third_mb_min']} / last third "
            f"{s['slope_last_third_mb_min']} MB/min; calls {sum(traffic.calls.values())}, "
            f"failures {sum(traffic.failures.values())}; node exit {result['node_exit_code']}",
            flush=True,
        )
    return 0 if result.get("completed") else 1


if __name__ == "__main__":
    sys.exit(main())
