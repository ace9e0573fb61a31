"""The fused step compiled ahead of time (runtime/precompiled.py): a warm start loads it and
steps bit for bit like the process that compiled it; a tampered or stale artifact is never used;
other weights or other policy code never meet it. Each engine lives in its own process, as a
node's start does (fuse=True on the CPU: inductor's C++ kernels, ~20 s to compile here)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from flashrt_ros.runtime.arena import fingerprint
from flashrt_ros.runtime.precompiled import step_key

HERE = Path(__file__).resolve().parent

CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {here!r})
from flashrt_ros import Engine, load_policy
from tiny_policy import tiny
if {device!r} == "cpu":
    eng = Engine(tiny(), device="cpu", fuse=True, compile_cache_dir={cache!r})
else:  # the node's default policy, fused by default on CUDA
    eng = Engine(load_policy("builtin:hybrid"), device={device!r}, compile_cache_dir={cache!r})
assert eng.fuse and eng.session("main").captured == ({device!r} != "cpu")
acts = [eng.step(np.linspace(-1, 1, eng.obs_dim).astype(np.float32) * i) for i in range(6)]
np.save({out!r}, np.stack(acts))
print("EVENTS " + json.dumps({{"folder": str(eng.precompiled.folder),
                              "events": eng.precompiled.events}}))
"""


def engine_run(cache: Path, out: Path, device: str = "cpu") -> dict:
    code = CHILD.format(here=str(HERE), cache=str(cache), out=str(out), device=device)
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=os.environ
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("EVENTS ")][-1]
    return {**json.loads(line[7:]), "log": p.stderr}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    cache = tmp_path_factory.mktemp("compile_cache")
    ref = cache.parent / "ref.npy"
    first = engine_run(cache, ref)
    return cache, ref, first


def test_a_warm_start_loads_the_step_and_steps_bit_for_bit(compiled, tmp_path):
    cache, ref, first = compiled
    (ev,) = first["events"]
    assert ": compiled in " in ev and "saved to" in ev, ev
    files = sorted(p.name for p in Path(first["folder"]).iterdir())
    assert files == [  # no temporary file left behind
        ev.split(":")[0] + ".bin",
        ev.split(":")[0] + ".json",
    ]
    again = engine_run(cache, tmp_path / "warm.npy")
    (ev2,) = again["events"]
    assert ": loaded in " in ev2, ev2
    assert np.array_equal(np.load(tmp_path / "warm.npy"), np.load(ref))


def test_a_tampered_artifact_is_not_used_and_is_compiled_again(compiled, tmp_path):
    cache, ref, first = compiled
    folder = Path(first["folder"])
    name = first["events"][0].split(":")[0]
    meta = folder / f"{name}.json"
    good = json.loads(meta.read_text())
    meta.write_text(json.dumps({**good, "check": "0" * 64}))  # as if other kernels were saved
    run = engine_run(cache, tmp_path / "a.npy")
    refused, again = run["events"]
    assert "not used (its check step gives other bytes" in refused, refused
    assert ": compiled in " in again and "saved to" in again, again
    assert "not used" in run["log"]
    assert json.loads(meta.read_text())["check"] == good["check"]  # saved again, right
    assert np.array_equal(np.load(tmp_path / "a.npy"), np.load(ref))
    # a file that does not load at all: the same
    (folder / f"{name}.bin").write_bytes(b"not a compiled function")
    run = engine_run(cache, tmp_path / "b.npy")
    assert "not used (" in run["events"][0] and ": compiled in " in run["events"][1]
    assert np.array_equal(np.load(tmp_path / "b.npy"), np.load(ref))
    assert ": loaded in " in engine_run(cache, tmp_path / "c.npy")["events"][0]


IMPORTS = "import torch\nfrom flashrt_ros.policies.base import Policy, StateEntry\n"


def policy_class(name: str, step: str, indent: str = "") -> str:
    """The source of a two-float test policy class `name` whose step ends with `step` (the
    action from the accumulated state `acc`), at `indent` (inside a function when not "")."""
    body = f"""
class {name}(Policy):
    policy_id = "test:{name.lower()}"
    obs_dim, action_dim, goal_dim, chunk_len = 2, 2, 2, 1

    def state_spec(self):
        return [StateEntry("acc", torch.float32, (1, 2), "recurrent")]

    def step(self, obs, state, action, chunk):
        {step}
        chunk.copy_(action[:, None])
"""
    return "\n".join(indent + ln if ln else ln for ln in body.splitlines()) + "\n"


SQUASHED = 'state["acc"].mul_(0.5).add_(obs)\n        action.copy_(squash(state["acc"]))'

CHECK_CHILD = """
import json, sys
import numpy as np
sys.path.insert(0, {folder!r})
from flashrt_ros import Engine
from {module} import {factory} as make
fused = Engine(make(), device="cpu", fuse=True, compile_cache_dir={cache!r})
obs = [[0.1 * i, -0.2 * i] for i in range({n})]
acts = np.array([fused.step(o) for o in obs])
plain = Engine(make(), device="cpu")
ref = np.array([plain.step(o) for o in obs])
print("EVENTS " + json.dumps({{"events": fused.precompiled.events,
                              "finite": bool(np.isfinite(acts).all()),
                              "max_diff": float(abs(acts - ref).max())}}))
"""


def check_run(folder: Path, module: str, factory: str, n: int = 4) -> dict:
    """CHECK_CHILD in a fresh process on the policy `module.factory` written in `folder`: the
    fused engine's precompile events, and how far its actions are from an unfused engine's."""
    for f in folder.glob("*.py"):
        _before_start(f)
    child = folder / "child.py"
    cache = folder / "cache"
    fields = {"folder": str(folder), "module": module, "factory": factory, "n": n}
    child.write_text(CHECK_CHILD.format(cache=str(cache), **fields))
    _before_start(child)
    p = subprocess.run([sys.executable, str(child)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("EVENTS ")][-1][7:])
    return {**got, "log": p.stderr}


def test_a_policy_torch_cannot_save_still_runs_compiled_the_usual_way(tmp_path):
    """A policy class defined inside a function (as a test or a notebook does) cannot be
    compiled ahead of time; the engine says so and compiles it on first call as before (this
    failed the node's configure once, on the H200)."""
    local = policy_class("Local", SQUASHED.replace("squash", "torch.tanh"), indent="    ")
    src = f"{IMPORTS}\ndef make():{local}\n    return Local()\n"
    (tmp_path / "local_policy.py").write_text(src)
    got = check_run(tmp_path, "local_policy", "make", n=5)
    (ev,) = got["events"]
    assert "not compiled ahead of time (TypeError" in ev and "local scope" in ev, ev
    assert got["max_diff"] < 1e-6
    assert "not compiled ahead of time" in got["log"]  # logged


def test_a_policy_that_changes_python_state_in_its_step_runs_compiled_the_usual_way(tmp_path):
    """A step that changes a Python attribute fails the saved step's guards on its next call
    (torch.compile would compile again): the second check call catches it, and the engine
    uses torch.compile."""
    step = 'self.calls += 1\n        action.copy_(state["acc"].add_(obs * self.calls))'
    src = IMPORTS + policy_class("Counting", step)
    # impure on purpose (the Engine's purity probe would refuse it): the guards are the point
    src += (
        "\n\ndef make():\n    p = Counting()\n    p.calls = 0\n"
        "    p.probe_purity = False\n    return p\n"
    )
    (tmp_path / "counting_policy.py").write_text(src)
    got = check_run(tmp_path, "counting_policy", "make", n=1)
    (ev,) = got["events"]
    assert "not compiled ahead of time (RuntimeError: GuardManager check failed" in ev, ev
    assert got["finite"]


def test_a_helper_module_that_changed_is_seen_and_the_step_compiled_again(tmp_path):
    """The key reads the policy's class files; a helper the step calls from another module
    is not one of them. Its source is recorded with the step, so an edited helper is never
    served by the old compiled code."""
    src = IMPORTS + "from policy_helper import squash\n" + policy_class("Helped", SQUASHED)
    (tmp_path / "helped_policy.py").write_text(src)
    helper = tmp_path / "policy_helper.py"
    helper.write_text("import torch\n\ndef squash(x):\n    return torch.tanh(x)\n")
    first = check_run(tmp_path, "helped_policy", "Helped")
    assert [": compiled in " in e for e in first["events"]] == [True], first["events"]
    helper.write_text("import torch\n\ndef squash(x):\n    return 0.5 * torch.tanh(x)\n")
    second = check_run(tmp_path, "helped_policy", "Helped")
    refused, again = second["events"]
    assert "not used (the source of policy_helper changed since it was compiled)" in refused
    assert ": compiled in " in again, again
    assert second["max_diff"] < 1e-6  # the new helper's actions, not the old step's


def user_policy_src(scale: float) -> str:
    step = 'state["acc"].add_(obs * SCALE)\n        action.copy_(state["acc"])'
    return IMPORTS + policy_class("UserPolicy", step) + f"\nSCALE = {scale}\n"


def _before_start(path: Path) -> None:
    """Date a file before this process started, as a module installed beforehand is."""
    past = time.time() - 3600
    os.utime(path, (past, past))


def test_other_weights_or_other_policy_code_get_another_folder(tmp_path, monkeypatch):
    """The key covers what the engine fingerprint does not: the code that is compiled. A user
    policy whose source changes (same policy_id, same weights) must not load the old step."""
    monkeypatch.syspath_prepend(str(HERE))
    from tiny_policy import tiny

    cpu = torch.device("cpu")

    def key(p) -> str:
        fp = fingerprint(p.policy_id, p.weights_digest(), [], "cpu")
        return step_key(fp, p, cpu)

    assert key(tiny(0.5)) == key(tiny(0.5))
    assert key(tiny(0.5)) != key(tiny(0.25))  # other weights
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = tmp_path / "user_policy_mod.py"
    mod.write_text(user_policy_src(1.0))
    m = importlib.import_module("user_policy_mod")
    assert key(m.UserPolicy()) is None  # written after this process started: not trusted
    _before_start(mod)
    k1 = key(m.UserPolicy())
    assert k1 is not None
    mod.write_text(user_policy_src(2.0))
    _before_start(mod)
    m = importlib.reload(m)
    assert key(m.UserPolicy()) not in (k1, None)
    # a class with no source file (exec'd, `python -c`, a notebook cell): no key, no artifact
    scope: dict = {"__name__": "exec_policy"}
    exec(user_policy_src(1.0), scope)
    assert key(scope["UserPolicy"]()) is None


@pytest.mark.cuda
def test_on_cuda_a_warm_start_loads_the_captured_fused_step_bit_for_bit(tmp_path):
    """The node's case: builtin:hybrid fused on CUDA, compiled and saved by one process, loaded
    by the next, and captured in its CUDA graph; both step alike to the bit."""
    first = engine_run(tmp_path / "cache", tmp_path / "a.npy", "cuda")
    assert [": compiled in " in e for e in first["events"]] == [True], first["events"]
    again = engine_run(tmp_path / "cache", tmp_path / "b.npy", "cuda")
    assert [": loaded in " in e for e in again["events"]] == [True], again["events"]
    assert np.array_equal(np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy"))


EDITED_CHILD = """
import json, sys
sys.path.insert(0, {folder!r})
import helped_policy  # the helper's first version is in memory now
open({helper!r}, "w").write({new!r})  # and the file is edited (a git pull under a running node)
from flashrt_ros import Engine
eng = Engine(helped_policy.Helped(), device="cpu", fuse=True, compile_cache_dir={cache!r})
print("EVENTS " + json.dumps(eng.precompiled.events))
"""


def test_a_helper_edited_after_the_process_started_is_never_saved_under_its_new_source(tmp_path):
    """torch records an inlined module's source from the disk, while the step it compiled is
    the code in memory: a helper edited after the process imported it would be saved as the
    new source with the old code, and every later start would serve the old code. Such a
    step is compiled and served, not saved; the next process compiles the new helper."""
    src = IMPORTS + "from policy_helper import squash\n" + policy_class("Helped", SQUASHED)
    (tmp_path / "helped_policy.py").write_text(src)
    helper = tmp_path / "policy_helper.py"
    helper.write_text("import torch\n\ndef squash(x):\n    return torch.tanh(x)\n")
    for f in tmp_path.glob("*.py"):
        _before_start(f)
    new = "import torch\n\ndef squash(x):\n    return 0.5 * torch.tanh(x)\n"
    code = EDITED_CHILD.format(
        folder=str(tmp_path), helper=str(helper), new=new, cache=str(tmp_path / "cache")
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    (ev,) = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("EVENTS ")][-1][7:])
    assert "not saved" in ev and "policy_helper changed on disk after this process" in ev, ev
    later = check_run(tmp_path, "helped_policy", "Helped")
    assert [": compiled in " in e for e in later["events"]] == [True], later["events"]
    assert later["max_diff"] < 1e-6  # the new helper's actions
