"""Shared fixtures: DDS isolation for every test, and a harness for tests that need ROS.

Every test runs with ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST and its own ROS_DOMAIN_ID in
os.environ (autouse), so subprocesses it starts stay on loopback and away from other tests. Inside
a module that uses `ros_module`, tests keep that module's domain so they can reach its nodes.

Fixtures (see ros_helpers.py for the API of RosHarness / NodeProcess):
- `ros` / `ros_module`: RosHarness (rclpy Context + client node `ros.node`, `ros.start_node(...)`,
  `ros.client(SrvType, name)`, `ros.call(client, request, timeout)`, `ros.spin_for(s)`,
  `ros.spin_until(pred, timeout)`); all nodes it started are stopped at teardown.
- `start_node`: shorthand for `ros.start_node`: start_node(params={}, extra_args=[], ...)
  -> NodeProcess (`.service("list_capsules")`, `.topic("commands")`, `.log_tail()`, `.stop()`).
- `ros_node`: the rclpy client node of `ros`.
- `ros_domain`: the ROS_DOMAIN_ID of the current test (int).
Tests marked `cuda` (test_cuda.py) are skipped where torch sees no CUDA device; with
FLASHRT_REQUIRE_CUDA=1 that is an error instead (the GPU machine must not skip them silently).
Tests needing ROS are skipped only when rclpy cannot be imported outside `make test`; with env.sh
sourced (FLASHRT_ROOT set) a missing rclpy is an error.
"""

from __future__ import annotations

import os

import pytest

from test import ros_helpers
from test.ros_helpers import (
    HAVE_RCLPY,
    RCLPY_IMPORT_ERROR,
    RosHarness,
    fresh_domain_id,
    ros_harness,
)


def pytest_configure(config):
    # inductor checks each SIMD level of the CPU by building a probe and loading it in a child
    # Python (~2.7 s each, ~5.5 s per compiling process on a 2-core CI machine); the levels it
    # checks are those /proc/cpuinfo lists, so the suite takes them as working. Set before the
    # first import of inductor, and inherited by every child process a test starts.
    os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
    # Fast DDS files left by ROS processes killed in earlier runs: a new process may be given
    # one of their ports and then receive nothing (ros_helpers.clean_stale_fastdds_shm). Once
    # per run, before any test: in a parallel run the controller does it (a worker could meet
    # the files of the other's node starting, before it locked them).
    # FLASHRT_TEST_SHM_CLEAN=0: whoever started this run did it (test/run_suite.py)
    if not hasattr(config, "workerinput") and os.environ.get(ros_helpers.SHM_CLEAN) != "0":
        ros_helpers.clean_stale_fastdds_shm()
    # rclpy -> rosidl_parser -> lark-parser 0.12 imports the deprecated sre_* modules
    config.addinivalue_line("filterwarnings", "ignore:module 'sre_:DeprecationWarning")
    config.addinivalue_line(
        "markers",
        "exclusive: the verdict rests on timing (a rate, a latency, a watchdog's period), so "
        "`make test` runs it one at a time at normal priority, beside the others, which run "
        "under SCHED_IDLE (test/run_suite.py)",
    )
    config.addinivalue_line(
        "markers",
        "cuda: needs a CUDA device (the GPU machine: pytest -m cuda test/test_cuda.py); skipped "
        "where there is none, an error instead with FLASHRT_REQUIRE_CUDA=1",
    )


def _no_cuda_reason() -> str | None:
    try:
        import torch
    except Exception as exc:  # pragma: no cover - torch is a dependency
        return f"torch not importable ({exc!r})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped without a CUDA device (torch is imported only when such
    a test was collected); with FLASHRT_REQUIRE_CUDA=1 that is a usage error instead."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    if not marked:
        return
    reason = _no_cuda_reason()
    if reason is None:
        return
    if os.environ.get("FLASHRT_REQUIRE_CUDA") == "1":
        raise pytest.UsageError(f"FLASHRT_REQUIRE_CUDA=1 but {reason}: the cuda tests cannot run")
    skip = pytest.mark.skip(reason=f"{reason} (cuda marker)")
    for item in marked:
        item.add_marker(skip)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Captured output and logs as valid UTF-8: a test that logs a file name that is not
    UTF-8 (test_node_host) left surrogates in them, which pytest-xdist cannot send from a
    worker to the controller (the run ended in an INTERNALERROR)."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [(key, _utf8(text)) for key, text in report.sections]


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_module_domain: list[int] = []  # domain of the live `ros_module` harness, if any


def require_rclpy() -> None:
    if HAVE_RCLPY:
        return
    if os.environ.get("FLASHRT_ROOT"):
        pytest.fail(f"env.sh is sourced but {RCLPY_IMPORT_ERROR}")
    pytest.skip(RCLPY_IMPORT_ERROR or "rclpy not importable")


@pytest.fixture(autouse=True)
def ros_domain(monkeypatch) -> int:
    """LOCALHOST discovery and a fresh ROS_DOMAIN_ID (or the module harness's) for every test."""
    domain = _module_domain[-1] if _module_domain else fresh_domain_id()
    monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    monkeypatch.setenv("ROS_DOMAIN_ID", str(domain))
    monkeypatch.delenv("ROS_LOCALHOST_ONLY", raising=False)
    monkeypatch.delenv("ROS_STATIC_PEERS", raising=False)  # contacted even with LOCALHOST
    monkeypatch.delenv("FLASHRT_MALLOC", raising=False)  # nodes start with their own settings
    return domain


@pytest.fixture
def ros(ros_domain, tmp_path) -> RosHarness:
    require_rclpy()
    with ros_harness(tmp_path / "ros", domain_id=ros_domain) as harness:
        yield harness


@pytest.fixture(scope="module")
def ros_module(tmp_path_factory) -> RosHarness:
    require_rclpy()
    log_dir = tmp_path_factory.mktemp("ros_module")
    with ros_harness(log_dir) as harness:
        _module_domain.append(harness.domain_id)
        try:
            yield harness
        finally:
            _module_domain.remove(harness.domain_id)


@pytest.fixture
def start_node(ros):
    return ros.start_node


@pytest.fixture
def ros_node(ros):
    return ros.node


__all__ = ["ros_helpers", "require_rclpy"]
