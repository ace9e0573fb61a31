"""The node's latency plumbing, over real rclpy/DDS: the services on their own node and
executor thread keep their names and their commit-boundary behaviour; the observation trigger
steps off the executor; the compile cache is keyed by the engine fingerprint.

No timings are asserted (the machine is noisy): bench/ros_bench.py shows the speed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from flashrt_ros.runtime.engine import Engine
from test.node_client import NodeClient
from test.ros_helpers import REPO_ROOT, preserved_environ
from test.tiny_policy import tiny, tiny_other

TINY = "test.tiny_policy:tiny"


def _env_with_tests() -> dict:
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{old}" if old else str(REPO_ROOT)}


def _start(ros, params: dict, **kw):
    saved = os.environ.get("PYTHONPATH")
    os.environ.update(_env_with_tests())
    try:
        return ros.start_node(params, **kw)
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def _cache_line(proc) -> str:
    return proc.log_match(r"compile cache (\S+)").group(1)


def test_engine_compile_cache_keyed_by_fingerprint(tmp_path: Path) -> None:
    with preserved_environ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # Engine sets them
        a = Engine(tiny(), device="cpu", compile_cache_dir=tmp_path)
        assert a.compile_cache == tmp_path / a.fingerprint
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / a.fingerprint / "inductor")
        assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / a.fingerprint / "triton")
        b = Engine(tiny_other(), device="cpu", compile_cache_dir=tmp_path)
        assert b.fingerprint != a.fingerprint and b.compile_cache != a.compile_cache
        assert Engine(tiny(), device="cpu", compile_cache_dir=tmp_path).compile_cache == (
            a.compile_cache
        )
        assert Engine(tiny(), device="cpu").compile_cache is None
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([a.fingerprint, b.fingerprint])


def test_node_compile_cache_folder_per_policy(ros, tmp_path: Path) -> None:
    """A real node start: the folder is <compile_cache_dir>/<fingerprint>; other weights give
    another folder, the same policy the same one."""
    cache = tmp_path / "cache"
    seen = []
    for policy in (TINY, "test.tiny_policy:tiny_other", TINY):
        proc = _start(ros, {"device": "cpu", "policy": policy, "compile_cache_dir": str(cache)})
        seen.append(_cache_line(proc))
        # the same line tells an operator where the start went, each part once
        line = proc.log_match(r"start-up: .*").group(0)
        for part in ("process + rclpy", "imports", "policy load", "engine compile_capture"):
            assert len(re.findall(rf"{re.escape(part)} \d", line)) == 1, line
        proc.stop()
    assert seen[0] == seen[2] != seen[1]
    assert {Path(s).parent for s in seen} == {cache}
    assert sorted(p.name for p in cache.iterdir()) == sorted({Path(s).name for s in seen})
    fp = Engine(tiny(), device="cpu").fingerprint
    assert Path(seen[0]).name == fp


def test_services_keep_their_names_and_commit_boundaries(ros) -> None:
    """The services answer under /flashrt/<name> from their own node while the loop runs, and
    a restore still continues bit for bit."""
    proc = _start(ros, {"device": "cpu", "policy": TINY, "trigger": "observation"})
    want = {f"/flashrt/{s}" for s in ("checkpoint", "restore", "branch", "rollout")}
    want |= {"/flashrt/list_capsules", "/flashrt/rewind"}

    def missing() -> set[str]:  # discovery is asynchronous: a name may come a little later
        return want - set(dict(ros.node.get_service_names_and_types()))

    assert ros.spin_until(lambda: not missing(), 20), f"not served: {sorted(missing())}"
    cli = NodeClient(ros, proc)
    obs = np.linspace(-0.5, 0.5, 12)
    for _ in range(5):
        cli.step(obs)
    r = cli.call("checkpoint")
    assert r.success, r.message
    a = [cli.step(obs) for _ in range(5)]
    assert cli.call("restore", capsule=r.capsule.id).success
    b = [cli.step(obs) for _ in range(5)]
    assert np.array_equal(np.array(a), np.array(b))
    assert r.capsule.id in [c.id for c in cli.call("list_capsules").capsules]
    diag = cli.latest_diag()
    assert "service_lock_wait_p99_us" in diag and "service_p50_us" in diag
    # where a round trip went: waiting for its take (from the middleware's reception stamp),
    # and sending the reply; both measured, both well under the test's timeouts
    queued, reply = float(diag["service_queue_p50_us"]), float(diag["service_reply_p50_us"])
    assert 0.0 < queued < 1e6 and 0.0 < reply < 1e6, diag
    for name in ("checkpoint", "restore", "list_capsules"):  # handler, take and reply per service
        for part in ("", "_queue", "_reply"):
            assert 0.0 < float(diag[f"service_{name}{part}_p50_us"]) < 1e6, (part, diag)
    assert "service_branch_p50_us" not in diag  # only the services called
    assert diag["services_thread"] == "flashrt-inputs"  # observation mode: the thread that steps
