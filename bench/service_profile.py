"""Where a service call's time goes inside the node: the handlers' parts, timed in the node.

    python3 bench/service_profile.py [--device cuda] [--calls 200] [--rate 500] [--busy-wait]
                                     [--out FILE]

Starts flashrt_node (this file, run as the node: the installed node's main() with timers
wrapped around the parts of a checkpoint, a restore and a list) in timer mode at `--rate` on a
joint_states stream of the same rate, then calls checkpoint, restore (unverified), list and drop
in rounds, as ros_bench.py's services row does, from an idle client. Writes the client's round
trips, the node's /diagnostics service figures and the p50/p99 of each wrapped part. Run where
flashrt_node is built (`make build`; on the GPU machine after bench/ros_gpu.sh). DDS stays on
loopback (ros_helpers.ros_harness picks a domain).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS_ENV = "FLASHRT_SERVICE_PROFILE_OUT"


def _pcts(v: list[float]) -> dict:
    import numpy as np

    a = np.asarray(v)
    return {
        "n": len(v),
        "p50_us": round(float(np.percentile(a, 50)), 1),
        "p99_us": round(float(np.percentile(a, 99)), 1),
    }


def _as_node() -> None:
    """The node, with its parts timed; the times go to $FLASHRT_SERVICE_PROFILE_OUT once a file
    of that name with the suffix .want appears (the driver makes it after its calls)."""
    times: dict[str, list[float]] = {}

    def wrap(owner, name: str, label: str) -> None:
        f = getattr(owner, name)

        def record(t0: float) -> None:
            times.setdefault(label, []).append((time.perf_counter() - t0) * 1e6)

        if inspect.iscoroutinefunction(f):  # an `async def` handler: timed to its return

            @functools.wraps(f)
            async def timed_async(*a, **k):
                t0 = time.perf_counter()
                try:
                    return await f(*a, **k)
                finally:
                    record(t0)

            setattr(owner, name, timed_async)
            return

        @functools.wraps(f)
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                record(t0)

        setattr(owner, name, timed)

    from flashrt_ros.capsules.pool import CapsulePool
    from flashrt_ros.cuda import graphs
    from flashrt_ros.node import convert, host, services
    from flashrt_ros.runtime.engine import Engine
    from flashrt_ros.runtime.probe import CheckpointProbe

    names = ("checkpoint", "restore", "capsules", "_checkpoint_into", "_probe_finite", "_wait")
    for n in (*names, "_to_freeze", "_finite_checksum", "_check_new_name"):
        wrap(Engine, n, f"engine.{n}")
    for n in ("issue", "result"):
        wrap(CheckpointProbe, n, f"probe.{n}")
    wrap(graphs, "launch", "graphs.launch")  # the probe's graph (the kernels' checkpoint pass)
    for n in ("adopt", "info", "free_slot", "slot_row", "digest_row", "_record", "peek_id"):
        wrap(CapsulePool, n, f"pool.{n}")
    for n in ("checkpoint", "restore", "list_capsules"):
        wrap(services.CapsuleServices, n, f"handler.{n}")
    for n in ("user_session", "configured", "timed"):
        wrap(services.Control, n, f"control.{n}")
    wrap(services, "capsule_msg", "convert.capsule_msg")
    wrap(convert, "capsule_msg", "convert.capsule_msg")
    wrap(host.ServiceHost, "_reply", "host.reply")
    serve_one = host.ServiceHost._serve_one

    def serve_timed(self, srv, stop=None):  # per service: the take, the handler and the reply
        t0 = time.perf_counter()
        try:
            return serve_one(self, srv, stop)
        finally:
            label = f"host.serve_one.{self._names.get(srv, '?')}"
            times.setdefault(label, []).append((time.perf_counter() - t0) * 1e6)

    host.ServiceHost._serve_one = serve_timed

    from flashrt_ros.node import waitloop

    waiting = waitloop.WaitLoop.waiting

    @contextlib.contextmanager
    def waiting_timed(self):  # each look at the wait set, per thread and kind (busy: no wait)
        with waiting(self) as wait:

            def timed_wait(timeout_ns, stop=None):
                t0 = time.perf_counter()
                try:
                    return wait(timeout_ns, stop)
                finally:
                    kind = "poll" if timeout_ns == 0 else "wait"
                    label = f"waitloop.{kind}.{threading.current_thread().name}"
                    times.setdefault(label, []).append((time.perf_counter() - t0) * 1e6)

            yield timed_wait

    waitloop.WaitLoop.waiting = waiting_timed

    def dump_when_asked() -> None:
        # a thread, not a SIGUSR1 handler: on the H100 (2026-12-06) the handler's parts never
        # came back, while on the CPU they did; a thread needs no main thread to run it
        out = Path(os.environ[PARTS_ENV])
        want = out.with_suffix(".want")
        while True:
            if want.exists():
                parts = {k: _pcts(v) for k, v in sorted(times.items())}
                out.write_text(json.dumps(parts, indent=1))
                want.unlink()
            time.sleep(0.05)

    threading.Thread(target=dump_when_asked, name="profile-dump", daemon=True).start()
    from flashrt_ros.node.main import main

    sys.exit(main())


def _drive(args) -> dict:
    sys.path.insert(0, str(ROOT))
    from bench.ros_bench import ServiceCaller, stop_streamer, streamer
    from flashrt_ros import srv
    from test.node_client import NodeClient
    from test.ros_helpers import ros_harness

    parts = Path(args.out).with_suffix(".parts.json")
    os.environ[PARTS_ENV] = str(parts)
    logs = Path(args.out).parent / "service_profile_logs"
    with ros_harness(logs) as ros:
        params = {
            "device": args.device,
            "trigger": "timer",
            "rate_hz": args.rate,
            "obs_timeout_s": 0.5,
            "busy_wait": args.busy_wait,
        }
        sp = streamer(args.rate, 600.0, "/joint_states")
        proc = ros.start_node(
            params,
            wait_services=("list_capsules", "checkpoint", "restore"),
            timeout=300.0,
            executable=Path(__file__).resolve(),
            extra_args=["--log-level", args.log_level] if args.log_level else [],
        )
        try:
            time.sleep(3.0)
            sc = ServiceCaller(ros)
            ck = sc.client(srv.Checkpoint, proc.service("checkpoint"))
            rs = sc.client(srv.Restore, proc.service("restore"))
            ls = sc.client(srv.ListCapsules, proc.service("list_capsules"))
            dr = sc.client(srv.DropCapsule, proc.service("drop_capsule"))
            for c in (ck, rs, ls, dr):
                assert c.wait_for_service(timeout_sec=20.0), c.srv_name
            rtt: dict[str, list[float]] = {"checkpoint": [], "restore": [], "list": []}
            for i in range(args.calls + 5):
                dt, r = sc.call(ck, srv.Checkpoint.Request())
                if not r.success:
                    raise RuntimeError(r.message)
                dt2, _ = sc.call(rs, srv.Restore.Request(capsule=r.capsule.id, verify=False))
                dt3, _ = sc.call(ls, srv.ListCapsules.Request())
                sc.call(dr, srv.DropCapsule.Request(capsule=r.capsule.id))
                if i >= 5:
                    rtt["checkpoint"].append(dt * 1e6)
                    rtt["restore"].append(dt2 * 1e6)
                    rtt["list"].append(dt3 * 1e6)
            diag = NodeClient(ros, proc).latest_diag()
            parts.with_suffix(".want").touch()
            for _ in range(50):
                if parts.exists():
                    break
                time.sleep(0.1)
            sc.close()
        finally:
            proc.stop()
            stop_streamer(sp)
    return {
        "params": params,
        "log_level": args.log_level or "info",
        "round_trips": {k: _pcts(v) for k, v in rtt.items()},
        "node_diag": {k: v for k, v in diag.items() if k.startswith("service")},
        "parts": json.loads(parts.read_text()) if parts.exists() else None,
    }


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rate", type=float, default=500.0)
    ap.add_argument("--busy-wait", action="store_true")
    ap.add_argument(
        "--log-level", default="", help="the node's log level (warn: no line per request)"
    )
    ap.add_argument("--out", type=Path, default=Path("service_profile.json"))
    args = ap.parse_args()
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    path = [str(ROOT), os.environ.get("PYTHONPATH")]
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    result = _drive(args)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    if "--ros-args" in sys.argv:
        sys.argv[0] = "flashrt_node"
        _as_node()
    sys.exit(main())
