"""The flashrt closed-loop demo: the built-in policy drives the simulated arm, and a small planner
checkpoints, branches, rolls out and restores the policy's execution state while it runs.

    make demo                       # = python -m flashrt_ros.demo
    python -m flashrt_ros.demo --out /tmp/demo --duration 30 --rate 50 --domain-id 77

It starts ``flashrt_sim_arm`` and ``flashrt_node`` (timer trigger) as subprocesses in a DDS domain
of its own, kept on this machine (ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST), and always stops them
(SIGINT, then kill) at the end, also on errors and Ctrl-C. The planner (an rclpy node in this
process) records joint_states and runs this story, timed as fractions of ``--duration``:

1. goal A;
2. ``checkpoint`` "before_goal_b" (pinned) before the goal change; ``branch`` it into sessions
   try_b (goal B) and try_c (goal C) and ``rollout`` both, closed loop on observations that a copy
   of the arm model predicts, to compare the alternatives without touching the robot;
3. goal B; a few seconds later the move to B is declared failed (simulated);
4. ``restore`` "before_goal_b" into the live session: the policy's execution state (observation
   history, recurrent state, action queue, goal, step counter) goes back to the checkpoint. The arm
   does not teleport: the restored policy drives it back toward A from where it is;
5. ``branch`` "before_goal_b" into session plan_c with goal C and activate=True: the live commands
   now come from the branch.

Every service call's round-trip time is measured. At the end it prints a summary and writes, in
``--out``: demo.png (joint positions, goals, events), summary.json, joint_states.csv (the recorded
positions) and the logs of both nodes (sim_arm.log, flashrt_node.log).
Exit status: 0 when every capsule operation succeeded, 1 otherwise, 2 when the nodes did not
come up, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
JOINTS = [f"joint{i}" for i in range(1, 7)]
DEFAULT_DOMAIN_ID = 77
DEFAULT_DURATION = 36.0
GOALS = {
    "A": [0.8, -0.5, 0.6, -0.4, 0.5, 0.3],
    "B": [-0.6, 0.6, -0.7, 0.5, -0.4, -0.6],
    "C": [0.2, 0.9, 1.0, -0.8, -0.7, 0.6],
}
# the story, as fractions of --duration (after the start-up)
T_CHECKPOINT = 0.25
T_FAILURE = 0.45
T_PLAN_C = 0.58
ROLLOUT_HORIZON_S = 1.0
SIM_RATE_HZ = 100.0  # the arm model's dt (0.01 s), as the built-in policy was trained


class DemoError(RuntimeError):
    pass


# -- processes -------------------------------------------------------------------------------------
def _executable(name: str) -> Path:
    for cand in (REPO_ROOT / "install" / "flashrt_ros" / "lib" / "flashrt_ros" / name,):
        if cand.exists():
            return cand
    found = shutil.which(name)
    if found:
        return Path(found)
    raise DemoError(f"{name} is not built: run `make setup` (and `. ./env.sh`)")


def _params_file() -> Path:
    for cand in (
        REPO_ROOT / "config" / "flashrt.yaml",
        REPO_ROOT / "install" / "flashrt_ros" / "share" / "flashrt_ros" / "config" / "flashrt.yaml",
    ):
        if cand.exists():
            return cand
    raise DemoError("config/flashrt.yaml not found")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM when the demo dies, even by SIGKILL."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """A node subprocess with its log file."""

    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str]):
        self.name, self.log_path = name, log_path
        with open(log_path, "wb") as log:
            log.write(("$ " + " ".join(args) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=str(REPO_ROOT),
                preexec_fn=_die_with_parent if os.name == "posix" else None,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "<no log>"
        return "\n".join("    " + ln for ln in lines[-n:])

    def interrupt(self) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)

    def wait_or_kill(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
            return self.proc.returncode


def stop_children(children: list[Child], timeout: float = 8.0) -> None:
    """Stop in reverse start order, each before the next: the policy node first, so the arm does
    not get commands while it shuts down."""
    for c in reversed(children):
        c.interrupt()
        c.wait_or_kill(timeout)


# -- the planner -----------------------------------------------------------------------------------
class Planner:
    """rclpy node `flashrt_demo`, spun by a SingleThreadedExecutor in a background thread."""

    def __init__(self, domain_id: int):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import QoSDurabilityPolicy, QoSProfile
        from rclpy.signals import SignalHandlerOptions
        from sensor_msgs.msg import JointState
        from std_msgs.msg import Float64MultiArray

        from flashrt_ros import srv

        self.srv = srv
        self.Float64MultiArray = Float64MultiArray
        self.context = Context()
        rclpy.init(
            context=self.context,
            domain_id=domain_id,
            signal_handler_options=SignalHandlerOptions.NO,
        )
        self.node = rclpy.create_node("flashrt_demo", context=self.context)
        self.lock = threading.Lock()
        self.js_t: list[float] = []
        self.js_q: list[list[float]] = []
        self.js_dq = np.zeros(6)
        self.n_commands = 0
        self.diag: dict | None = None
        self.diag_t = 0.0
        self.diag_first: tuple[float, dict] | None = None
        self.goal_echoes: list[list[float]] = []
        n = self.node
        n.create_subscription(JointState, "joint_states", self._on_js, 50)
        n.create_subscription(Float64MultiArray, "commands", self._on_cmd, 10)
        n.create_subscription(DiagnosticArray, "/diagnostics", self._on_diag, 10)
        latched = QoSProfile(depth=1, durability=QoSDurabilityPolicy.TRANSIENT_LOCAL)
        n.create_subscription(Float64MultiArray, "/flashrt/goal_applied", self._on_echo, latched)
        self.goal_pub = n.create_publisher(Float64MultiArray, "goal", 10)
        self.clients = {
            name: n.create_client(typ, f"/flashrt/{name}")
            for name, typ in (
                ("checkpoint", srv.Checkpoint),
                ("restore", srv.Restore),
                ("branch", srv.Branch),
                ("list_capsules", srv.ListCapsules),
                ("drop_capsule", srv.DropCapsule),
                ("rollout", srv.Rollout),
            )
        }
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(n)
        self.thread = threading.Thread(target=self._spin, name="planner-spin", daemon=True)
        self.thread.start()

    def _spin(self) -> None:
        with contextlib.suppress(Exception):  # ends with the context's shutdown
            while self.context.ok():
                self.executor.spin_once(timeout_sec=0.1)

    # -- callbacks (executor thread)
    def _on_js(self, msg) -> None:
        try:
            idx = [list(msg.name).index(j) for j in JOINTS]
        except ValueError:
            return
        q = [msg.position[i] for i in idx]
        dq = [msg.velocity[i] for i in idx] if len(msg.velocity) == len(msg.name) else [0.0] * 6
        with self.lock:
            self.js_t.append(time.monotonic())
            self.js_q.append(q)
            self.js_dq = np.asarray(dq)

    def _on_cmd(self, msg) -> None:
        with self.lock:
            self.n_commands += 1

    def _on_diag(self, msg) -> None:
        for st in msg.status:
            if "flashrt" in st.name and "control loop" in st.name:
                d = {kv.key: kv.value for kv in st.values}
                with self.lock:
                    self.diag, self.diag_t = d, time.monotonic()

    def _on_echo(self, msg) -> None:
        with self.lock:
            self.goal_echoes.append(list(msg.data))

    # -- main-thread API
    def state(self) -> tuple[np.ndarray, np.ndarray]:
        with self.lock:
            if not self.js_q:
                raise DemoError("no joint_states received")
            return np.asarray(self.js_q[-1]), self.js_dq.copy()

    def publish_goal(self, goal, timeout: float = 5.0) -> bool:
        """Publish a goal and wait until the node echoes it on ~/goal_applied."""
        goal = [float(g) for g in goal]
        self.goal_pub.publish(self.Float64MultiArray(data=goal))
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if self.goal_echoes and np.allclose(self.goal_echoes[-1], goal):
                    return True
            time.sleep(0.01)
        return False

    def call(self, name: str, /, timeout: float = 15.0, **fields):
        """Call /flashrt/<name>; returns (response, round-trip seconds)."""
        cli = self.clients[name]
        req = cli.srv_type.Request()
        for k, v in fields.items():
            setattr(req, k, v)
        done = threading.Event()
        t0 = time.perf_counter()
        fut = cli.call_async(req)
        fut.add_done_callback(lambda _f: done.set())
        if not done.wait(timeout):
            fut.cancel()
            raise DemoError(f"/flashrt/{name}: no reply within {timeout} s")
        rtt = time.perf_counter() - t0
        if fut.exception() is not None:
            raise DemoError(f"/flashrt/{name}: {fut.exception()}")
        return fut.result(), rtt

    def wait_ready(self, children: list[Child], timeout: float) -> float:
        """Wait for every service, joint_states and the first commands; returns seconds waited."""
        t0 = time.monotonic()
        end = t0 + timeout
        pending = dict(self.clients)
        while True:
            for c in children:
                if not c.alive():
                    raise DemoError(
                        f"{c.name} exited with code {c.proc.returncode} during start-up; "
                        f"log {c.log_path}:\n{c.log_tail()}"
                    )
            for name in list(pending):
                if pending[name].service_is_ready():
                    del pending[name]
            with self.lock:
                js, cmds = len(self.js_q), self.n_commands
            if not pending and js and cmds >= 3:
                return time.monotonic() - t0
            if time.monotonic() > end:
                what = [f"services {sorted(pending)}"] if pending else []
                what += [] if js else ["joint_states"]
                what += [] if cmds else ["commands"]
                tails = "\n".join(f"  {c.name} ({c.log_path}):\n{c.log_tail()}" for c in children)
                raise DemoError(f"not ready after {timeout:.0f} s: no {', '.join(what)}\n{tails}")
            time.sleep(0.05)

    def wait_fresh_diag(self, timeout: float = 2.5) -> tuple[float, dict | None]:
        with self.lock:
            t_prev = self.diag_t
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if self.diag_t > t_prev:
                    return self.diag_t, dict(self.diag)
            time.sleep(0.02)
        with self.lock:
            return self.diag_t, (dict(self.diag) if self.diag else None)

    def close(self) -> None:
        import rclpy

        with contextlib.suppress(Exception):
            rclpy.shutdown(context=self.context)
        self.thread.join(timeout=2.0)
        with contextlib.suppress(Exception):
            self.executor.shutdown(timeout_sec=0)
        with contextlib.suppress(Exception):
            self.node.destroy_node()


# -- the story -------------------------------------------------------------------------------------
class Story:
    def __init__(self, planner: Planner, duration: float, rate_hz: float, log=print):
        self.p = planner
        self.duration = duration
        self.rate_hz = rate_hz
        self.log = log
        self.t0 = time.monotonic()
        self.events: list[dict] = []
        self.goal_segments: list[dict] = []
        self.rollouts: list[dict] = []
        self.end: float | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def sleep_until(self, frac: float) -> None:
        left = frac * self.duration - self.now()
        if left > 0:
            time.sleep(left)

    def say(self, text: str) -> None:
        self.log(f"[t={self.now():6.2f} s] {text}")

    def _event(self, kind: str, label: str, **extra) -> dict:
        ev = {"t": round(self.now(), 4), "kind": kind, "label": label, **extra}
        self.events.append(ev)
        return ev

    def goal(self, name: str, segment_label: str | None = None) -> None:
        ok = self.p.publish_goal(GOALS[name])
        label = segment_label or f"goal {name}"
        self._event("goal", f"goal {name}", goal=name, success=ok)
        self.goal_segments.append({"t": self.events[-1]["t"], "goal": GOALS[name], "label": label})
        self.say(f"goal {name} {GOALS[name]}" + ("" if ok else "  (not echoed by the node!)"))

    def op(self, kind: str, label: str, service: str, plot: bool = True, **fields) -> object:
        t = self.now()
        resp, rtt = self.p.call(service, **fields)
        step = None
        if service == "checkpoint" and resp.success:
            step = int(resp.capsule.step)
        elif service in ("restore", "branch") and resp.success:
            step = int(resp.step)
        ev = {
            "t": round(t, 4),
            "kind": kind,
            "label": label,
            "service": service,
            "success": bool(resp.success),
            "message": resp.message,
            "rtt_ms": round(rtt * 1e3, 3),
            "step": step,
            "plot": plot,
        }
        if service == "checkpoint" and resp.success:
            ev["capsule"] = {
                "id": resp.capsule.id,
                "name": resp.capsule.name,
                "nbytes": int(resp.capsule.nbytes),
                "tier": resp.capsule.tier,
                "checksum": resp.capsule.checksum,
            }
        self.events.append(ev)
        status = "ok" if resp.success else "FAILED"
        self.say(
            f"{label}: {status} in {rtt * 1e3:.2f} ms"
            + (f", step {step}" if step is not None else "")
            + f" ({resp.message})"
        )
        return resp

    def rollout(self, session: str, goal_name: str, horizon_s: float) -> dict:
        """Closed-loop what-if: step `session` (commit=True, never the live one) one policy step
        per call on observations that a copy of the arm model predicts from the actions."""
        from flashrt_ros.sim.dynamics import ArmModel

        q, dq = self.p.state()
        model = ArmModel(dt=1.0 / SIM_RATE_HZ)
        model.reset(np.clip(q, model.lower, model.upper))
        model._dq = dq.astype(np.float64)  # start from the measured velocity too
        substeps = max(1, round(SIM_RATE_HZ / self.rate_hz))
        n_steps = max(1, round(horizon_s * self.rate_hz))
        t = self.now()
        rtts, actions = [], []
        for _ in range(n_steps):
            obs = model.observation()
            resp, rtt = self.p.call(
                "rollout",
                session=session,
                capsule="",
                observations=obs.tolist(),
                n_steps=1,
                commit=True,
            )
            rtts.append(rtt)
            if not resp.success:
                break
            a = np.asarray(resp.actions, dtype=float)
            actions.append(a)
            for _ in range(substeps):
                model.step(a)
        ok = len(actions) == n_steps
        goal = np.asarray(GOALS[goal_name])
        final_target = actions[-1] if actions else np.full(6, np.nan)
        res = {
            "session": session,
            "goal": goal_name,
            "n_steps": n_steps,
            "success": ok,
            "message": "" if ok else resp.message,
            "calls": len(rtts),
            "total_ms": round(sum(rtts) * 1e3, 2),
            "rtt_p50_ms": round(float(np.percentile(rtts, 50)) * 1e3, 3),
            "rtt_max_ms": round(float(np.max(rtts)) * 1e3, 3),
            "predicted_final_target": np.round(final_target, 4).tolist(),
            "predicted_final_q": np.round(model.q, 4).tolist(),
            "predicted_error_to_goal": round(float(np.linalg.norm(model.q - goal)), 4),
            "start_error_to_goal": round(float(np.linalg.norm(q - goal)), 4),
        }
        self.rollouts.append(res)
        self.events.append(
            {
                "t": round(t, 4),
                "kind": "rollout",
                "label": f"rollout {session}",
                "service": "rollout",
                "success": ok,
                "message": res["message"] or f"{n_steps} steps, closed loop on the arm model",
                "rtt_ms": res["rtt_p50_ms"],
                "step": None,
                "plot": True,
                "calls": len(rtts),
                "total_ms": res["total_ms"],
            }
        )
        self.say(
            f"rollout {session} (goal {goal_name}): {n_steps} steps in {len(rtts)} calls, "
            f"{res['total_ms']:.0f} ms total, p50 {res['rtt_p50_ms']:.2f} ms/call; predicted "
            f"final target {np.round(final_target, 2).tolist()}, predicted distance to "
            f"{goal_name} {res['start_error_to_goal']:.2f} -> "
            f"{res['predicted_error_to_goal']:.2f} rad"
        )
        return res

    def run(self) -> None:
        self.goal("A")
        self.sleep_until(T_CHECKPOINT)
        self.say("planner: about to change the goal; checkpoint first")
        self.op(
            "checkpoint",
            'checkpoint "before_goal_b"',
            "checkpoint",
            session="",
            name="before_goal_b",
            pin=True,
            persist=False,
        )
        self.say("planner: compare the alternatives B and C on forks of the checkpoint")
        for g in ("B", "C"):
            self.op(
                "branch",
                f"branch -> try_{g.lower()} (goal {g})",
                "branch",
                capsule="before_goal_b",
                session=f"try_{g.lower()}",
                activate=False,
                goal=[float(x) for x in GOALS[g]],
            )
        for session, g in (("try_b", "B"), ("try_c", "C")):
            self.rollout(session, g, ROLLOUT_HORIZON_S)
        self.goal("B")
        self.sleep_until(T_FAILURE)
        self._event("failure", "move to B FAILED (simulated)")
        self.say("simulated failure: the move to B is declared failed")
        self.op(
            "restore",
            'restore "before_goal_b" (verify)',
            "restore",
            capsule="before_goal_b",
            session="",
            verify=True,
        )
        self.goal_segments.append(
            {"t": self.events[-1]["t"], "goal": GOALS["A"], "label": "restored: goal A"}
        )
        self.sleep_until(T_PLAN_C)
        self.op(
            "branch",
            "branch -> plan_c (goal C, live)",
            "branch",
            capsule="before_goal_b",
            session="plan_c",
            activate=True,
            goal=[float(x) for x in GOALS["C"]],
        )
        self.goal_segments.append(
            {"t": self.events[-1]["t"], "goal": GOALS["C"], "label": "plan_c: goal C"}
        )
        self.sleep_until(1.0)
        self.end = self.now()


# -- summary ---------------------------------------------------------------------------------------
def _f(d: dict | None, key: str, default=float("nan")) -> float:
    try:
        return float((d or {}).get(key, default))
    except (TypeError, ValueError):
        return default


def build_summary(
    args,
    story: Story,
    planner: Planner,
    startup_s: float,
    wall_s: float,
    diag0: tuple[float, dict | None],
    diag1: tuple[float, dict | None],
    listing,
) -> dict:
    with planner.lock:
        t = np.asarray(planner.js_t) - story.t0
        q = np.asarray(planner.js_q, dtype=float).reshape(-1, 6)
    keep = (t >= 0) & (t <= story.duration + 0.5)
    t, q = t[keep], q[keep]
    goal = np.asarray(story.goal_segments[-1]["goal"]) if story.goal_segments else np.zeros(6)
    final_q = q[-1] if len(q) else np.full(6, np.nan)
    (t_d0, d0), (t_d1, d1) = diag0, diag1
    steps0, steps1 = _f(d0, "steps", 0.0), _f(d1, "steps", 0.0)
    achieved = (steps1 - steps0) / (t_d1 - t_d0) if d0 and d1 and t_d1 > t_d0 else float("nan")
    ops = [e for e in story.events if e.get("service")]
    capsules = []
    if listing is not None:
        capsules = [
            {
                "id": c.id,
                "name": c.name,
                "session": c.session,
                "parent_id": c.parent_id,
                "step": int(c.step),
                "nbytes": int(c.nbytes),
                "tier": c.tier,
                "pinned": bool(c.pinned),
            }
            for c in listing.capsules
        ]
    return {
        "duration_s": story.duration,
        "story_s": round(story.end if story.end is not None else story.now(), 3),
        "startup_s": round(startup_s, 3),
        "wall_s": round(wall_s, 3),
        "rate_hz": args.rate,
        "domain_id": args.domain_id,
        "joint_names": JOINTS,
        "goals": GOALS,
        "active_goal": story.goal_segments[-1]["label"] if story.goal_segments else None,
        "final_q": np.round(final_q, 4).tolist(),
        "final_error_rad": {
            "norm": round(float(np.linalg.norm(final_q - goal)), 4),
            "max_abs": round(float(np.max(np.abs(final_q - goal))), 4),
        },
        "steps": int(steps1),
        "story_steps": int(steps1 - steps0),
        # counters over the story alone (the totals include the start-up)
        "story_overruns": int(_f(d1, "overruns", 0.0) - _f(d0, "overruns", 0.0)),
        "story_stale_ticks": int(_f(d1, "stale_ticks", 0.0) - _f(d0, "stale_ticks", 0.0)),
        "achieved_rate_hz": round(achieved, 2) if math.isfinite(achieved) else None,
        "diagnostics_end": d1 or {},
        "events": story.events,
        "capsule_ops": ops,
        "all_ops_ok": all(e["success"] for e in ops),
        "rollouts": story.rollouts,
        "goal_segments": story.goal_segments,
        "capsules_end": capsules,
        "sessions_end": list(listing.sessions) if listing is not None else [],
        "live_session_end": listing.live_session if listing is not None else None,
        "pool_bytes_used": int(listing.pool_bytes_used) if listing is not None else None,
        "pool_bytes_total": int(listing.pool_bytes_total) if listing is not None else None,
        "_t": t,
        "_q": q,
    }


def print_summary(s: dict, out: Path) -> None:
    d = s["diagnostics_end"]
    p = print
    p("")
    p("=" * 78)
    p("flashrt demo summary")
    p("=" * 78)
    p(
        f"duration        {s['story_s']:.1f} s of story (+ {s['startup_s']:.1f} s node start-up), "
        f"{s['wall_s']:.1f} s wall in all"
    )
    p(
        f"policy loop     {s['steps']} steps ({s['story_steps']} during the story) at "
        f"{s['rate_hz']:g} Hz target; achieved "
        f"{s['achieved_rate_hz']} Hz (diagnostics: {d.get('rate_hz', '?')} Hz), device "
        f"{d.get('device', '?')}"
    )
    p(
        f"step time       p50 {d.get('step_p50_us', '?')} us, p99 {d.get('step_p99_us', '?')} us; "
        f"period jitter p99 {d.get('jitter_p99_us', '?')} us"
    )
    p(
        f"counters        overruns {d.get('overruns', '?')} ({s['story_overruns']} during the "
        f"story), stale ticks {d.get('stale_ticks', '?')} ({s['story_stale_ticks']} during the "
        f"story), refused inputs {d.get('refused_inputs', '?')}"
    )
    p("")
    p("capsule operations (round trip measured by the planner; step = the session step the")
    p("operation took effect at, on the commit boundary between two steps):")
    p(f"  {'t (s)':>7}  {'operation':<36} {'ok':<4} {'rtt (ms)':>9}  {'step':>6}")
    for e in s["capsule_ops"]:
        rtt = f"{e['rtt_ms']:.2f}" + ("*" if e["kind"] == "rollout" else "")
        step = "" if e["step"] is None else str(e["step"])
        p(
            f"  {e['t']:7.2f}  {e['label']:<36} {'yes' if e['success'] else 'NO':<4} {rtt:>9}  "
            f"{step:>6}"
        )
        if not e["success"]:
            p(f"           -> {e['message']}")
    p("  * rollout: p50 per call; one call per predicted policy step (commit=True into the fork)")
    p("")
    p("what-if rollouts from the checkpoint (closed loop on the arm model, the robot untouched):")
    for r in s["rollouts"]:
        p(
            f"  {r['session']} (goal {r['goal']}): predicted final target "
            f"{[round(x, 2) for x in r['predicted_final_target']]}, distance to goal "
            f"{r['start_error_to_goal']:.2f} -> {r['predicted_error_to_goal']:.2f} rad "
            f"in {r['n_steps']} steps"
        )
    p("")
    p(
        f"capsules in the pool at the end ({len(s['capsules_end'])}; pool "
        f"{s['pool_bytes_used']} / {s['pool_bytes_total']} bytes; sessions "
        f"{', '.join(s['sessions_end'])}; live session {s['live_session_end']!r}):"
    )
    for c in s["capsules_end"]:
        p(
            f"  {c['id']:<14} name={c['name'] or '-':<16} session={c['session']:<8} "
            f"step={c['step']:<6} {c['nbytes']} B on {c['tier']}{', pinned' if c['pinned'] else ''}"
        )
    p("")
    fe = s["final_error_rad"]
    p(
        f"final joint error to the active goal ({s['active_goal']}): norm {fe['norm']:.3f} rad, "
        f"max {fe['max_abs']:.3f} rad"
    )
    p("")
    p("note: restore rewinds the policy's execution state (observation history / KV ring,")
    p("recurrent and convolution state, action queue, goal, step counter) to the checkpoint, byte")
    p("for byte. It does not move the robot: the arm stayed where the failed move to B left it,")
    p("and the restored policy, pursuing goal A again, steered it from there. The branch into")
    p("plan_c then forked the same capsule with goal C and made that session live.")
    p("")
    p(
        f"files: {out / 'demo.png'}, {out / 'summary.json'}, {out / 'joint_states.csv'}, "
        f"node logs in {out}"
    )


# -- main ------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m flashrt_ros.demo",
        description=(
            "Closed-loop demo: the built-in policy drives the simulated arm while a planner "
            "calls checkpoint / branch / rollout / restore; prints a summary, writes a PNG plot "
            "and summary.json."
        ),
    )
    ap.add_argument(
        "--out", type=Path, default=Path("out/demo"), help="output directory (default: ./out/demo)"
    )
    ap.add_argument(
        "--duration",
        type=float,
        default=DEFAULT_DURATION,
        help=f"seconds of the scripted story, after node start-up "
        f"(default {DEFAULT_DURATION:g}; at least 8)",
    )
    ap.add_argument("--rate", type=float, default=50.0, help="policy rate in Hz (default 50)")
    env_dom = os.environ.get("FLASHRT_DEMO_DOMAIN_ID")
    ap.add_argument(
        "--domain-id",
        type=int,
        default=int(env_dom) if env_dom else DEFAULT_DOMAIN_ID,
        help="ROS_DOMAIN_ID for the demo's nodes (default $FLASHRT_DEMO_DOMAIN_ID "
        f"or {DEFAULT_DOMAIN_ID}); discovery always stays on localhost",
    )
    ap.add_argument(
        "--startup-timeout",
        type=float,
        default=90.0,
        help="seconds to wait for the nodes to come up (default 90)",
    )
    args = ap.parse_args(argv)
    if not (args.duration >= 8.0):
        ap.error("--duration must be at least 8 s")
    if not (math.isfinite(args.rate) and 1.0 <= args.rate <= 1000.0):
        ap.error("--rate must be within 1 .. 1000 Hz")
    if not 0 <= args.domain_id <= 232:
        ap.error("--domain-id must be within 0 .. 232")
    return args


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wall0 = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    # DDS stays on this machine, in the demo's own domain (this process and its children)
    os.environ["ROS_DOMAIN_ID"] = str(args.domain_id)
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ.pop("ROS_LOCALHOST_ONLY", None)
    env = dict(os.environ, PYTHONUNBUFFERED="1", RCUTILS_LOGGING_BUFFERED_STREAM="0")
    node_env = dict(env)
    node_env.setdefault("OMP_NUM_THREADS", "1")  # a tiny model: one thread steps it fastest

    with contextlib.suppress(ValueError):  # only the main thread may set handlers
        signal.signal(signal.SIGTERM, _raise_interrupt)

    children: list[Child] = []
    planner: Planner | None = None
    print(
        f"flashrt demo: domain {args.domain_id} (localhost only), policy at {args.rate:g} Hz, "
        f"story {args.duration:g} s, output in {out}"
    )
    try:
        sim_exe, node_exe, params = (
            _executable("flashrt_sim_arm"),
            _executable("flashrt_node"),
            _params_file(),
        )
        children.append(
            Child(
                "flashrt_sim_arm",
                [
                    sys.executable,
                    str(sim_exe),
                    "--ros-args",
                    "-p",
                    f"rate_hz:={SIM_RATE_HZ}",
                ],
                out / "sim_arm.log",
                env,
            )
        )
        children.append(
            Child(
                "flashrt_node",
                [
                    sys.executable,
                    str(node_exe),
                    "--ros-args",
                    "--params-file",
                    str(params),
                    "-p",
                    "trigger:=timer",
                    "-p",
                    f"rate_hz:={float(args.rate)}",
                    "-p",
                    "output:=commands",
                ],
                out / "flashrt_node.log",
                node_env,
            )
        )
        planner = Planner(args.domain_id)
        print("starting flashrt_sim_arm and flashrt_node (torch import takes a few seconds) ...")
        try:
            startup = planner.wait_ready(children, args.startup_timeout)
        except DemoError as e:
            print(f"flashrt demo: error: {e}", file=sys.stderr)
            return 2
        print(f"nodes up after {startup:.1f} s: services answer, commands flowing")
        _, diag_pre = planner.wait_fresh_diag(2.5)
        device = (diag_pre or {}).get("device", "?")
        print(f"flashrt node on device {device}; story starts now")

        story = Story(planner, args.duration, args.rate)
        diag0 = (time.monotonic(), diag_pre)
        with planner.lock:
            if planner.diag is not None:
                diag0 = (planner.diag_t, dict(planner.diag))
        story.run()
        diag1 = planner.wait_fresh_diag(2.5)
        listing, rtt = planner.call("list_capsules")
        story.events.append(
            {
                "t": round(story.now(), 4),
                "kind": "list",
                "label": "list_capsules",
                "service": "list_capsules",
                "success": True,
                "message": f"{len(listing.capsules)} capsules",
                "rtt_ms": round(rtt * 1e3, 3),
                "step": None,
                "plot": False,
            }
        )
        summary = build_summary(
            args, story, planner, startup, time.monotonic() - wall0, diag0, diag1, listing
        )
    except KeyboardInterrupt:
        print("\nflashrt demo: interrupted; stopping the nodes", file=sys.stderr)
        return 130
    except DemoError as e:
        print(f"flashrt demo: error: {e}", file=sys.stderr)
        for c in children:
            print(f"--- {c.name} log tail ({c.log_path}):\n{c.log_tail()}", file=sys.stderr)
        return 1
    finally:
        if planner is not None:
            planner.close()
        stop_children(children)
        for c in children:  # a node that had to be killed or crashed is worth a word
            if c.proc.returncode not in (0, None, -signal.SIGINT, 130):
                print(
                    f"note: {c.name} exited with code {c.proc.returncode} (log {c.log_path})",
                    file=sys.stderr,
                )

    # the outputs (nodes already stopped)
    t, q = summary.pop("_t"), summary.pop("_q")
    from flashrt_ros.demo_plot import plot_demo

    csv = out / "joint_states.csv"
    np.savetxt(
        csv,
        np.column_stack([t, q]) if len(t) else np.zeros((0, 7)),
        delimiter=",",
        fmt="%.6f",
        header="t_s," + ",".join(JOINTS),
        comments="",
    )
    png = plot_demo({**summary, "t": t, "q": q}, out / "demo.png")
    summary["files"] = {
        "plot": str(png),
        "summary": str(out / "summary.json"),
        "joint_states": str(csv),
        "logs": [str(c.log_path) for c in children],
    }
    summary["wall_s"] = round(time.monotonic() - wall0, 3)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print_summary(summary, out)
    if not summary["all_ops_ok"]:
        print("flashrt demo: some capsule operations failed (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
