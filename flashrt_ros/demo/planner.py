"""The demo's planner: rclpy node `flashrt_demo`, the client side of the flashrt node.

It records joint_states, counts commands, keeps the latest diagnostics, publishes goals (and
waits for the node's echo, or for the camera) and calls the capsule services with their
round-trip times. With cameras it keeps the newest camera/<name>/image_raw message of each, for
snapshots of what the policy saw. Spun by a SingleThreadedExecutor in a background thread, so the
story's main thread may block.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from flashrt_ros.demo import DemoError
from flashrt_ros.demo.children import Child
from flashrt_ros.demo.trajectory import Trajectory
from flashrt_ros.node.params import DEFAULT_JOINTS

Diag = tuple[float, dict | None]  # (monotonic time received, the control loop's key/values)


class Planner:
    """rclpy node `flashrt_demo` in its own rclpy context and DDS domain."""

    def __init__(
        self, domain_id: int, joints: list[str] = DEFAULT_JOINTS, cameras: tuple[str, ...] = ()
    ):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import QoSDurabilityPolicy, QoSProfile
        from rclpy.signals import SignalHandlerOptions
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import Float64MultiArray

        from flashrt_ros import srv

        self.joints = list(joints)
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
        self.js_dq = np.zeros(len(self.joints))
        self.n_commands = 0
        self.diag: dict | None = None
        self.diag_t = 0.0
        self.goal_echoes: list[list[float]] = []
        self.cameras = tuple(cameras)
        self.frames: dict[str, tuple[float, object]] = {}  # camera -> (time received, msg)
        self.frame_counts = dict.fromkeys(self.cameras, 0)
        n = self.node
        for cam in self.cameras:
            n.create_subscription(
                Image, f"camera/{cam}/image_raw", lambda m, c=cam: self._on_image(c, m), 5
            )
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
            idx = [list(msg.name).index(j) for j in self.joints]
        except ValueError:
            return
        q = [msg.position[i] for i in idx]
        if len(msg.velocity) == len(msg.name):
            dq = [msg.velocity[i] for i in idx]
        else:
            dq = [0.0] * len(self.joints)
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

    def _on_image(self, camera: str, msg) -> None:
        with self.lock:
            self.frames[camera] = (time.monotonic(), msg)
            self.frame_counts[camera] += 1

    def _on_echo(self, msg) -> None:
        with self.lock:
            self.goal_echoes.append(list(msg.data))

    # -- main-thread API
    def state(self) -> tuple[np.ndarray, np.ndarray]:
        """The latest measured positions and velocities, for a prediction to start from."""
        with self.lock:
            if not self.js_q:
                raise DemoError("no joint_states received")
            return np.asarray(self.js_q[-1]), self.js_dq.copy()

    def trajectory(self, since: float, until: float) -> Trajectory:
        """The joint_states received between two monotonic times, t counted from `since`."""
        with self.lock:
            t = np.asarray(self.js_t) - since
            q = np.asarray(self.js_q, dtype=float).reshape(-1, len(self.joints))
        keep = (t >= 0) & (t <= until - since)
        return Trajectory(t=t[keep], q=q[keep], joint_names=list(self.joints))

    def publish_goal(self, goal, timeout: float = 5.0, echo: bool = True) -> bool:
        """Publish a goal and wait until the node echoes it on ~/goal_applied; with
        echo=False (a policy that sees the goal only in the camera image, where the sim draws
        it) wait for two camera frames newer than the goal instead."""
        goal = [float(g) for g in goal]
        self.goal_pub.publish(self.Float64MultiArray(data=goal))
        if not echo:
            return self.wait_frames(2, timeout) is not None
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if self.goal_echoes and np.allclose(self.goal_echoes[-1], goal):
                    return True
            time.sleep(0.01)
        return False

    def wait_frames(self, n: int = 1, timeout: float = 2.0) -> tuple[float, object] | None:
        """The first camera's message after `n` more have arrived (so it was rendered after
        the call), with the time it was received; None without cameras or after `timeout`."""
        if not self.cameras:
            return None
        cam = self.cameras[0]
        with self.lock:
            target = self.frame_counts[cam] + n
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self.lock:
                if self.frame_counts[cam] >= target:
                    return self.frames[cam]
            time.sleep(0.005)
        return None

    def snapshot(self, timeout: float = 2.0) -> tuple[float, np.ndarray] | None:
        """A fresh frame of the first camera as an H x W x 3 uint8 array (rgb8, the sim's
        encoding), with the time it was received; None when none arrived within `timeout`."""
        got = self.wait_frames(1, timeout)
        if got is None:
            return None
        t, msg = got
        h, w = int(msg.height), int(msg.width)
        rows = np.frombuffer(bytes(msg.data), np.uint8).reshape(h, int(msg.step))
        return t, rows[:, : 3 * w].reshape(h, w, 3).copy()

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
                no_image = [c for c in self.cameras if not self.frame_counts[c]]
            if not pending and js and cmds >= 3 and not no_image:
                return time.monotonic() - t0
            if time.monotonic() > end:
                what = [f"services {sorted(pending)}"] if pending else []
                what += [] if js else ["joint_states"]
                what += [] if cmds else ["commands"]
                what += [f"camera/{c}/image_raw" for c in no_image]
                tails = "\n".join(f"  {c.name} ({c.log_path}):\n{c.log_tail()}" for c in children)
                raise DemoError(f"not ready after {timeout:.0f} s: no {', '.join(what)}\n{tails}")
            time.sleep(0.05)

    def last_diag(self) -> Diag | None:
        """The latest diagnostics received, None before the first."""
        with self.lock:
            return None if self.diag is None else (self.diag_t, dict(self.diag))

    def wait_fresh_diag(self, timeout: float = 2.5) -> Diag:
        """Diagnostics newer than the call (the node publishes them about once a second)."""
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
