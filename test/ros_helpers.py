"""Helpers for tests that talk to a running flashrt node over DDS (kept on loopback).

Plain functions and context managers, usable from fixtures of any scope (see conftest.py;
import as `from test.ros_helpers import ...`):

    with ros_harness(tmp_dir) as ros:           # fresh ROS_DOMAIN_ID, LOCALHOST discovery
        node = ros.start_node({"trigger": "observation"})   # installed flashrt_node, waits for it
        cli = ros.client(ListCapsules, node.service("list_capsules"))
        resp = ros.call(cli, ListCapsules.Request(), timeout=10.0)

Every node started is stopped (SIGINT, then SIGKILL) when the harness exits.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
INSTALL_PREFIX = REPO_ROOT / "install" / "flashrt_ros"
NODE_EXECUTABLE = INSTALL_PREFIX / "lib" / "flashrt_ros" / "flashrt_node"
PARAMS_FILE = REPO_ROOT / "config" / "flashrt.yaml"

try:  # rclpy is importable under `make test` (env.sh); elsewhere ROS tests are skipped
    import rclpy
    from rclpy.context import Context
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy

    NodeNameNonExistentError = _rclpy.NodeNameNonExistentError

    RCLPY_IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    rclpy = None  # type: ignore[assignment]
    RCLPY_IMPORT_ERROR = f"rclpy not importable ({exc!r}); run the tests via `make test`"

HAVE_RCLPY = RCLPY_IMPORT_ERROR is None

# Test domains are 101..200 (env.sh picks 1..100 for interactive use); spread by pid so that
# concurrent pytest processes on one machine do not meet. The workers of one parallel run
# (pytest-xdist: PYTEST_XDIST_WORKER gw0, gw1, ...) each take a band of their own, because two
# workers walking the same span in step would meet on a domain for as long as the run lasts.
_DOMAIN_BASE = 101
_DOMAIN_SPAN = 100
_domain_counter = itertools.count()


def _domain_band() -> tuple[int, int]:
    """(first domain, how many) of this process's band: FLASHRT_TEST_DOMAINS ("first-last",
    set by test/run_suite.py for each of its two runs) or all test domains, split evenly
    among the workers of a parallel run."""
    base, span = _DOMAIN_BASE, _DOMAIN_SPAN
    band = os.environ.get("FLASHRT_TEST_DOMAINS", "")
    if band:
        first, last = (int(x) for x in band.split("-"))
        base, span = first, last - first + 1
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return base, span
    width = span // count
    return base + int(worker[2:]) % count * width, width


def fresh_domain_id() -> int:
    """A ROS_DOMAIN_ID not used before by this process (cycles through its band)."""
    n = next(_domain_counter)
    base, span = _domain_band()
    return base + (os.getpid() * 7 + n) % span


@contextlib.contextmanager
def ros_domain(domain_id: int | None = None) -> Iterator[int]:
    """Set ROS_DOMAIN_ID (fresh unless given) and LOCALHOST discovery in os.environ; restore."""
    domain_id = fresh_domain_id() if domain_id is None else int(domain_id)
    keys = (
        "ROS_DOMAIN_ID",
        "ROS_AUTOMATIC_DISCOVERY_RANGE",
        "ROS_LOCALHOST_ONLY",
        "ROS_STATIC_PEERS",
    )
    with preserved_environ(*keys):
        os.environ["ROS_DOMAIN_ID"] = str(domain_id)
        os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
        os.environ.pop("ROS_LOCALHOST_ONLY", None)
        os.environ.pop("ROS_STATIC_PEERS", None)  # contacted even with LOCALHOST discovery
        yield domain_id


@contextlib.contextmanager
def preserved_environ(*keys: str) -> Iterator[None]:
    """Whatever the body does to these os.environ entries is undone on exit (set again to the
    old value, or removed where there was none)."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def importable_tests() -> Iterator[None]:
    """A node process started in the body can import test policies from this repository."""
    with preserved_environ("PYTHONPATH"):
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = f"{REPO_ROOT}{os.pathsep}{old}" if old else str(REPO_ROOT)
        yield


def ros_param_args(params: dict[str, Any] | None) -> list[str]:
    """`-p name:=value` overrides; values are written as YAML (JSON is valid YAML)."""
    args: list[str] = []
    for name, value in (params or {}).items():
        if isinstance(value, tuple):
            value = list(value)
        args += ["-p", f"{name}:={json.dumps(value)}"]
    return args


def _join(namespace: str, name: str) -> str:
    ns = "/" + namespace.strip("/") if namespace.strip("/") else ""
    return f"{ns}/{name}"


class NodeProcess:
    """A flashrt_node process started by start_node / RosHarness.start_node."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, name: str, namespace: str):
        self.proc = proc
        self.log_path = log_path
        self.name = name
        self.namespace = namespace
        self.fqn = _join(namespace, name)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def service(self, short: str) -> str:
        """Full name of a private service: service("list_capsules") -> /ns/flashrt/list_capsules."""
        return f"{self.fqn}/{short.lstrip('~/')}"

    def topic(self, name: str) -> str:
        """Full name of a relative topic: topic("commands") -> /ns/commands."""
        return _join(self.namespace, name)

    def log_tail(self, n_lines: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "<no log>"
        return "\n".join(lines[-n_lines:])

    def log_match(self, pattern: str, timeout: float = 30.0) -> re.Match:
        """The first match of `pattern` in the node's log, waiting for it up to `timeout` s
        (AssertionError with the log's tail after)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = re.search(pattern, self.log_path.read_text(errors="replace"))
            if m:
                return m
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} in the log\n{self.log_tail()}")

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGINT, then SIGKILL after `timeout` s. Returns the exit code.

        By default 10 s, and 30 s in the shared run (this process under SCHED_IDLE): there a
        node beside a timed test that keeps both CPUs busy can get no CPU for many seconds, and
        killed after 10 s its clean exit read -9 (a fresh-clone run's stop test)."""
        if timeout is None:
            timeout = 30.0 if in_shared_run() else 10.0
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def __repr__(self) -> str:
        return f"NodeProcess({self.fqn}, pid={self.proc.pid}, log={self.log_path})"


def launch_node(
    params: dict[str, Any] | None = None,
    extra_args: Sequence[str] = (),
    *,
    log_dir: Path,
    name: str = "flashrt",
    namespace: str = "",
    params_file: Path | str | None = PARAMS_FILE,
    executable: Path | str = NODE_EXECUTABLE,
    env: dict[str, str] | None = None,
) -> NodeProcess:
    """Start the installed flashrt_node without waiting; stdout+stderr go to a log in log_dir.

    `extra_args` go after `--ros-args` (e.g. ["-r", "joint_states:=/sim/joint_states"]).
    """
    executable = Path(executable)
    if not executable.exists():
        raise FileNotFoundError(f"{executable} is not built: run `make setup`")
    ros_args = ["--ros-args", "-r", f"__node:={name}"]
    if namespace.strip("/"):
        ros_args += ["-r", f"__ns:=/{namespace.strip('/')}"]
    if params_file:
        ros_args += ["--params-file", str(params_file)]
    log_dir = Path(log_dir)
    # the compile cache in the test's own folder: tests never write to, or read, ~/.cache
    params = {"compile_cache_dir": str(log_dir / "compile_cache"), **(params or {})}
    ros_args += ros_param_args(params)
    ros_args += list(extra_args)
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{name}{'_' + namespace.strip('/').replace('/', '_') if namespace.strip('/') else ''}"
    log_path = log_dir / f"node_{stem}_{int(time.time() * 1000) % 10**8}.log"
    proc_env = dict(os.environ if env is None else env)
    proc_env.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    proc_env["PYTHONUNBUFFERED"] = "1"
    proc_env.setdefault("RCUTILS_LOGGING_BUFFERED_STREAM", "0")
    with open(log_path, "wb") as log:
        log.write(f"$ {executable} {' '.join(ros_args)}\n".encode())
        log.flush()
        # the executable is a `#!/usr/bin/env python3` launcher: run it with this interpreter
        proc = subprocess.Popen(
            [sys.executable, str(executable), *ros_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=proc_env,
            cwd=str(REPO_ROOT),
        )
    return NodeProcess(proc, log_path, name, namespace)


def call(node, client, request, timeout: float = 10.0):
    """Call a service and spin `node` (in its own context) until the reply; raise on timeout."""
    deadline = time.monotonic() + timeout
    if not client.wait_for_service(timeout_sec=timeout):
        raise TimeoutError(f"service {client.srv_name} not available after {timeout} s")
    future = client.call_async(request)
    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    try:
        while not future.done():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            executor.spin_once(timeout_sec=min(left, 0.1))
    finally:
        executor.remove_node(node)
        executor.shutdown(timeout_sec=0)
    if not future.done():
        future.cancel()
        raise TimeoutError(f"no reply from {client.srv_name} within {timeout} s")
    if future.exception() is not None:
        raise future.exception()
    return future.result()


def spin_for(node, seconds: float) -> None:
    """Spin `node` (subscriptions, timers) for `seconds`."""
    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    try:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            executor.spin_once(timeout_sec=min(left, 0.05))
    finally:
        executor.remove_node(node)
        executor.shutdown(timeout_sec=0)


def in_shared_run() -> bool:
    """This process is in make test's shared run: SCHED_IDLE (test/run_suite.py), where the
    nodes it starts can get no CPU for seconds beside the timed run."""
    return os.sched_getscheduler(0) == os.SCHED_IDLE


# obs_timeout_s of a lockstep node of the shared run whose test names none (starved_run_params)
SHARED_RUN_OBS_TIMEOUT_S = 5.0


def starved_run_params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    """The node's parameters, with obs_timeout_s 5 s for an observation-trigger node of the
    shared run (this process under SCHED_IDLE, test/run_suite.py) whose test sets none.

    Beside a timed test that keeps both CPUs busy, an idle-class node can get no CPU for longer
    than the default 0.5 s: its step then ends older than obs_timeout_s, and it rightly holds
    the command (a 589 ms step failed a fresh-clone run's lockstep test). That is the node's
    safety rule, which tests of their own check with their own obs_timeout_s; every other test
    steps in lockstep and wants its command."""
    if not in_shared_run():
        return params
    p = dict(params or {})
    if p.get("trigger") == "observation" and "obs_timeout_s" not in p:
        p["obs_timeout_s"] = SHARED_RUN_OBS_TIMEOUT_S
    return p


SHM_CLEAN = "FLASHRT_TEST_SHM_CLEAN"  # "0": a test run leaves /dev/shm to whoever started it


def clean_stale_fastdds_shm(folder: Path | str = "/dev/shm") -> list[str]:
    """Remove the shared-memory files of Fast DDS processes that are gone; returns their names.

    A live participant holds an flock on each `<name>_el` file next to its segments and ports,
    and removes all of them when it exits normally; a process that was SIGKILLed (a test's or
    a benchmark's last resort) leaves them behind, and a later process that gets the same port
    can fail to open it ("open_and_lock_file failed") and then receive nothing. Only a name
    whose `_el` lock nobody holds is removed, with its `sem.<name>_mutex`; anything without an
    `_el` file is left alone, as is everything of a live process, ours or anyone's."""
    removed = []
    for el in _unlocked_fastdds_locks(folder):  # unlinked while we hold the lock
        base = el.name[: -len("_el")]
        for f in (el.with_name(base), el.with_name(f"sem.{base}_mutex"), el):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
        removed.append(base)
    return removed


def stale_fastdds_names(folder: Path | str = "/dev/shm") -> list[str]:
    """Names of Fast DDS shared-memory files (without `_el`) whose `_el` lock nobody holds:
    their process is gone (clean_stale_fastdds_shm says why that matters)."""
    return [el.name[: -len("_el")] for el in _unlocked_fastdds_locks(folder)]


def _unlocked_fastdds_locks(folder: Path | str) -> Iterator[Path]:
    """Each `fastdds_*_el` whose lock nobody holds, yielded while this process holds it."""
    import fcntl

    for el in sorted(Path(folder).glob("fastdds_*_el")):
        try:
            fd = os.open(el, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # taken: its owner is gone
        except OSError:
            os.close(fd)
            continue
        try:
            yield el
        finally:
            os.close(fd)


def spin_until(node, predicate, timeout: float = 10.0) -> bool:
    """Spin `node` until predicate() is true; returns its last value."""
    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    try:
        end = time.monotonic() + timeout
        while not predicate():
            left = end - time.monotonic()
            if left <= 0:
                return bool(predicate())
            executor.spin_once(timeout_sec=min(left, 0.05))
        return True
    finally:
        executor.remove_node(node)
        executor.shutdown(timeout_sec=0)


class RosHarness:
    """One DDS domain, one rclpy Context with a client node, and the node processes started.

    Attributes: domain_id, context, node (rclpy Node named flashrt_test_client), log_dir.
    """

    def __init__(self, log_dir: Path, domain_id: int):
        if not HAVE_RCLPY:
            raise RuntimeError(RCLPY_IMPORT_ERROR)
        self.log_dir = Path(log_dir)
        self.domain_id = domain_id
        self.context = Context()
        rclpy.init(context=self.context, domain_id=domain_id)
        self.node = rclpy.create_node(f"flashrt_test_client_{os.getpid()}", context=self.context)
        self.processes: list[NodeProcess] = []
        self._clients: dict[tuple[type, str], Any] = {}

    # -- node processes
    def start_node(
        self,
        params: dict[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        *,
        name: str = "flashrt",
        namespace: str = "",
        wait_services: Sequence[str] = ("list_capsules",),
        timeout: float = 60.0,
        **launch_kwargs: Any,
    ) -> NodeProcess:
        """Start the installed flashrt_node in this domain and wait until its services answer
        discovery (fails with the node's log tail if it exits or times out)."""
        self._wait_name_free(name, namespace)
        params = starved_run_params(params)
        env = dict(os.environ)
        env["ROS_DOMAIN_ID"] = str(self.domain_id)
        env["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
        proc = launch_node(
            params,
            extra_args,
            log_dir=self.log_dir,
            name=name,
            namespace=namespace,
            env=env,
            **launch_kwargs,
        )
        self.processes.append(proc)
        try:
            self.wait_for_services(proc, wait_services, timeout)
        except BaseException:
            proc.stop()
            raise
        return proc

    def wait_for_services(
        self, proc: NodeProcess, services: Sequence[str], timeout: float = 60.0
    ) -> None:
        deadline = time.monotonic() + timeout
        for short in services:
            full = proc.service(short)
            while full not in self.served_by(proc):
                if not proc.alive():
                    raise RuntimeError(
                        f"{proc} exited with {proc.proc.returncode} before offering {full}; "
                        f"log tail:\n{proc.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{proc} did not offer {full} within {timeout} s; log tail:\n"
                        f"{proc.log_tail()}"
                    )
                spin_for(self.node, 0.1)

    def _wait_name_free(self, name: str, namespace: str, timeout: float = 30.0) -> None:
        """Until an earlier node of this name that we started has left the graph: one that was
        killed (a stop past its timeout on a starved machine) keeps its services there until
        its DDS lease runs out (~20 s), and the new node would be taken as up at once."""
        fqn = _join(namespace, name)
        ours = [p for p in self.processes if p.fqn == fqn]
        if not ours or any(p.alive() for p in ours):  # no predecessor, or a twin on purpose
            return
        end = time.monotonic() + timeout
        while self._served(name, namespace) and time.monotonic() < end:
            spin_for(self.node, 0.05)

    def served_by(self, proc: NodeProcess) -> set[str]:
        """The services `proc`'s node serves, as this process's graph knows them. By node: the
        graph lists a service that only our own client asks for too, and an earlier node of
        that name keeps its entries after a kill until its DDS lease runs out; with all names,
        a restarted node was taken as up once this test had called its list_capsules, and the
        test then waited 20 s for a node still importing torch."""
        return self._served(proc.name, proc.namespace)

    def _served(self, name: str, namespace: str) -> set[str]:
        ns = "/" + namespace.strip("/")
        served: set[str] = set()
        # the lifecycle services are the node's own, the capsule services its host node's
        for node in (name, f"{name}_services"):
            try:
                by = self.node.get_service_names_and_types_by_node(node, ns)
            except NodeNameNonExistentError:  # not in the graph (yet)
                continue
            served |= {n for n, _ in by}
        return served

    def stop_all(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()

    # -- clients
    def client(self, srv_type, name: str):
        """A cached service client of the harness node."""
        key = (srv_type, name)
        if key not in self._clients:
            self._clients[key] = self.node.create_client(srv_type, name)
        return self._clients[key]

    def call(self, client, request, timeout: float = 10.0):
        return call(self.node, client, request, timeout)

    def spin_for(self, seconds: float) -> None:
        spin_for(self.node, seconds)

    def spin_until(self, predicate, timeout: float = 10.0) -> bool:
        return spin_until(self.node, predicate, timeout)

    def close(self) -> None:
        try:
            self.stop_all()
        finally:
            with contextlib.suppress(Exception):
                self.node.destroy_node()
            with contextlib.suppress(Exception):
                rclpy.shutdown(context=self.context)


@contextlib.contextmanager
def ros_harness(log_dir: Path, domain_id: int | None = None) -> Iterator[RosHarness]:
    """Fresh domain (in os.environ too), rclpy context + client node; everything torn down."""
    with ros_domain(domain_id) as dom:
        harness = RosHarness(Path(log_dir), dom)
        try:
            yield harness
        finally:
            harness.close()
