"""The fused step built ahead of time (runtime/aot.py) on the CUDA graph path, on the GPU machine:

    FLASHRT_REQUIRE_CUDA=1 python3 -m pytest -q -m cuda test/test_cuda_aot.py

With a compile cache folder the first Engine builds one package per tick kind; a second one (in
this process, and in a fresh process: a warm start) loads them, never imports the compiler, and
steps bit for bit like the first, within TOL of eager, with capsules that replay.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashrt_ros import Engine, load_policy
from test.test_cuda_policies import TOL, lerobot_like, run, stream

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"builtin:hybrid": lambda: load_policy("builtin:hybrid"), "lerobot_like": lerobot_like}

CHILD = r"""
import json, sys
import numpy as np
from flashrt_ros import Engine, load_policy
from test.test_cuda_aot import POLICIES
from test.test_cuda_policies import run, stream
eng = Engine(POLICIES[sys.argv[1]](), device="cuda", seed=3, fuse=True,
             compile_cache_dir=sys.argv[2])
got = run(eng, stream(eng, 24))
print("RESULT " + json.dumps({
    "fused_by": eng.fused_by, "captured": eng.session("main").captured,
    "compiler": sorted(m for m in ("torch._inductor.compile_fx", "torch._dynamo.convert_frame")
                       if m in sys.modules),
    "actions": got.astype(np.float64).tolist()}))
"""


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_warm_start_loads_the_packages_and_steps_bit_for_bit_like_the_cold_one(name, tmp_path):
    cache = tmp_path / "cache"
    cold = Engine(POLICIES[name](), device="cuda", seed=3, fuse=True, compile_cache_dir=cache)
    kinds = len(cold.policy.tick_kinds)
    assert cold.fused_by == f"ahead of time: 0 package(s) loaded, {kinds} built"
    assert cold.session("main").captured
    assert len(list((cold.compile_cache / "aot").glob("step-*.pt2"))) == kinds
    warm = Engine(POLICIES[name](), device="cuda", seed=3, fuse=True, compile_cache_dir=cache)
    assert warm.fused_by == f"ahead of time: {kinds} package(s) loaded, 0 built"
    eager = Engine(POLICIES[name](), device="cuda", seed=3, use_graph=False)

    obs = stream(cold, 24)
    got = run(cold, obs)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, run(eager, obs), rtol=0, atol=TOL)
    assert np.array_equal(run(warm, obs[:6]), got[:6])
    cap = warm.checkpoint(name="mid")
    assert np.array_equal(run(warm, obs[6:]), got[6:])
    warm.restore(cap.id)
    assert np.array_equal(run(warm, obs[6:]), got[6:])
    warm.branch(cap.id, "alt")
    assert np.array_equal(run(warm, obs[6:], session="alt"), got[6:])

    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run(
        [sys.executable, "-c", CHILD, name, str(cache)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    child = json.loads(line[0][7:])
    assert child["fused_by"] == f"ahead of time: {kinds} package(s) loaded, 0 built"
    assert child["captured"] and child["compiler"] == []
    assert np.array_equal(np.array(child["actions"], dtype=np.float32), got)


def test_changed_weights_build_another_package(tmp_path):
    a = Engine(load_policy("builtin:hybrid"), device="cuda", fuse=True, compile_cache_dir=tmp_path)
    policy = load_policy("builtin:hybrid")
    with torch.no_grad():
        next(iter(policy.parameters())).mul_(1.01)
    b = Engine(policy, device="cuda", fuse=True, compile_cache_dir=tmp_path)
    assert a.fingerprint != b.fingerprint
    assert b.fused_by == "ahead of time: 0 package(s) loaded, 1 built"
    assert len(list(tmp_path.glob("*/aot/step-*.pt2"))) == 2
