"""The demo's node subprocesses (flashrt_sim_arm, flashrt_node): started with their own log file,
always stopped, and they die with the demo even when it is killed."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from flashrt_ros.demo import DemoError

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def executable(name: str) -> Path:
    """The colcon-installed launcher of `name` (else one on PATH): the nodes run as on a robot."""
    for cand in (REPO_ROOT / "install" / "flashrt_ros" / "lib" / "flashrt_ros" / name,):
        if cand.exists():
            return cand
    found = shutil.which(name)
    if found:
        return Path(found)
    raise DemoError(f"{name} is not built: run `make setup` (and `. ./env.sh`)")


def params_file() -> Path:
    """The shipped parameters, from the checkout first so its edits count."""
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
        """The last lines of its log, indented, for error messages."""
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


def start_nodes(
    children: list[Child],
    out: Path,
    rate_hz: float,
    sim_rate_hz: float,
    env: dict[str, str],
    node_env: dict[str, str],
    policy: str = "builtin:hybrid",
    cameras: tuple[str, ...] = (),
    image_hw: tuple[int, int] | None = None,
    camera_rate_hz: float = 30.0,
    state_fields: tuple[str, ...] = ("position", "velocity"),
) -> None:
    """Start the sim arm, then the policy node (`policy`, timer trigger at `rate_hz`, commands
    only, its observation made of `state_fields`). With `cameras` (the policy's image inputs,
    all `image_hw`), the sim publishes camera/<name>/image_raw rgb8 at `camera_rate_hz` and the
    node subscribes them.

    Each is appended to `children` as soon as it runs, so the caller stops whatever started even
    when a later start fails.
    """
    sim_exe, node_exe, params = (
        executable("flashrt_sim_arm"),
        executable("flashrt_node"),
        params_file(),
    )
    names = "[" + ", ".join(cameras) + "]"
    sim_args = [sys.executable, str(sim_exe), "--ros-args", "-p", f"rate_hz:={sim_rate_hz}"]
    if cameras:
        h, w = image_hw or (64, 64)
        sim_args += ["-p", f"camera_names:={names}", "-p", f"camera_rate_hz:={camera_rate_hz}"]
        sim_args += ["-p", f"camera_height:={h}", "-p", f"camera_width:={w}"]
    children.append(Child("flashrt_sim_arm", sim_args, out / "sim_arm.log", env))
    node_args = [
        sys.executable,
        str(node_exe),
        "--ros-args",
        "--params-file",
        str(params),
        "-p",
        f"policy:={policy}",
        "-p",
        "trigger:=timer",
        "-p",
        f"rate_hz:={float(rate_hz)}",
        "-p",
        "output:=commands",
        "-p",
        "state_fields:=[" + ", ".join(state_fields) + "]",
    ]
    if cameras:
        node_args += ["-p", f"cameras:={names}"]
    children.append(Child("flashrt_node", node_args, out / "flashrt_node.log", node_env))


def stop_children(children: list[Child], timeout: float = 8.0) -> None:
    """Stop in reverse start order, each before the next: the policy node first, so the arm does
    not get commands while it shuts down."""
    for c in reversed(children):
        c.interrupt()
        c.wait_or_kill(timeout)
