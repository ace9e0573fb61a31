"""The fused step built ahead of time (runtime/aot.py), on the CPU, where AOTInductor builds a C++
package of the same step: what a warm start relies on, without a GPU.

The Engine compiles only on CUDA (test_cuda_aot.py runs it there); here the main session's step
is swapped for one made by `AotSteps`, as bench/policies_bench.py does for torch.compile. Each
build compiles C++ (about 20 s on 2 cores), so the builds are shared by the tests of the module.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flashrt_ros import Engine, load_policy
from flashrt_ros.runtime.aot import AotSteps
from flashrt_ros.runtime.session import Session, fused_step
from test.engine_util import observations

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5  # inductor's C++ kernels against eager ones: float32 reassociation only


def aot_engine(policy, folder: Path) -> tuple[Engine, AotSteps]:
    eng = Engine(policy, device="cpu")
    aot = AotSteps(folder, eng.fingerprint, eng.device, fused_step)
    eng._sessions["main"] = Session(
        "main", eng.policy, eng.spec, eng.device, eng.seed, False, aot, 0, eng.encodings
    )
    return eng, aot


def steps(eng: Engine, n: int = 30) -> np.ndarray:
    return np.array([eng.step(o) for o in observations(n)])


CHILD = r"""
import json, sys
from pathlib import Path
from flashrt_ros import load_policy
from test.test_aot import aot_engine, steps
eng, aot = aot_engine(load_policy("builtin:hybrid"), Path(sys.argv[1]))
got = steps(eng)
print("RESULT " + json.dumps({
    "built": aot.built, "loaded": aot.loaded, "actions": got.astype(float).tolist(),
    "compiler": sorted(m for m in ("torch._inductor.compile_fx", "torch._dynamo.convert_frame")
                       if m in sys.modules)}))
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A package built for builtin:hybrid, and the actions of the engine that built it."""
    folder = tmp_path_factory.mktemp("cache")
    eng, aot = aot_engine(load_policy("builtin:hybrid"), folder)
    got = steps(eng)
    assert (aot.built, aot.loaded, aot.fell_back) == (1, 0, [])
    return folder, got


def test_the_built_step_matches_eager(built):
    _, got = built
    want = steps(Engine(load_policy("builtin:hybrid"), device="cpu"))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)


def test_a_fresh_process_loads_it_without_the_compiler_and_steps_bit_for_bit(built):
    folder, got = built
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    r = subprocess.run(
        [sys.executable, "-c", CHILD, str(folder)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stderr[-3000:]
    child = json.loads(line[0][7:])
    assert (child["built"], child["loaded"]) == (0, 1)
    assert child["compiler"] == []  # a warm start never imports dynamo or inductor
    assert np.array_equal(np.array(child["actions"], dtype=np.float32), got)


def test_changed_weights_never_meet_the_old_package(built, tmp_path):
    folder, got = built
    policy = load_policy("builtin:hybrid")
    with torch.no_grad():
        next(iter(policy.parameters())).mul_(1.01)
    eng, aot = aot_engine(policy, folder)
    other = steps(eng)
    assert (aot.built, aot.loaded) == (1, 0)  # another fingerprint: its own package
    assert len(list((folder / "aot").glob("step-*.pt2"))) == 2
    want = steps(Engine(policy, device="cpu"))
    np.testing.assert_allclose(other, want, rtol=0, atol=TOL)
    assert not np.allclose(other, got, rtol=0, atol=TOL)


def test_a_package_that_does_not_load_is_rebuilt(built, tmp_path, caplog):
    folder, got = built
    (tmp_path / "aot").mkdir()
    for p in (folder / "aot").glob("step-*.pt2"):  # as a writer that crashed would leave it
        (tmp_path / "aot" / p.name).write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="flashrt_ros.runtime.aot"):
        eng, aot = aot_engine(load_policy("builtin:hybrid"), tmp_path)
        again = steps(eng)
    assert (aot.built, aot.loaded) == (1, 0)
    assert "does not load: rebuilding it" in caplog.text
    assert np.array_equal(again, got)
    assert not list((tmp_path / "aot").glob(".build-*"))  # no temporary file left behind


def test_a_package_that_crashes_its_test_process_is_never_installed(tmp_path, monkeypatch, caplog):
    """A package whose loader crashes (a segmentation fault was seen on the GPU machine) would
    crash every later start that opens it: it is tried in another process first, and on a
    failure the step is torch.compile'd instead, with a warning."""
    from flashrt_ros.runtime import aot as aot_mod

    monkeypatch.setattr(aot_mod, "TRY", "import os; os.abort()")  # as a crashing loader would
    with caplog.at_level(logging.WARNING, logger="flashrt_ros.runtime.aot"):
        eng, aot = aot_engine(load_policy("builtin:hybrid"), tmp_path)
        got = steps(eng)
    assert (aot.built, aot.loaded, len(aot.fell_back)) == (0, 0, 1)
    assert "could not run the package" in aot.fell_back[0]
    assert "torch.compile" in caplog.text
    assert not list((tmp_path / "aot").iterdir())  # nothing installed, no temporary file left
    want = steps(Engine(load_policy("builtin:hybrid"), device="cpu"))
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
