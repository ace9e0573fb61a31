"""cuda/prewarm.py: the node makes the device's context beside its imports (never required)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from flashrt_ros.cuda.prewarm import device_index, warm_context


def test_the_device_parameter_names_the_context_to_make():
    assert device_index("cpu") is None
    assert device_index("auto") == 0 and device_index("cuda") == 0
    assert device_index("cuda:3") == 3
    assert warm_context("cpu") is None  # no thread at all for the CPU


def test_a_warmer_ends_either_way_and_never_raises():
    """With a driver it made a context, without one (CI) it says why; neither raises."""
    w = warm_context("cuda:0")
    w.thread.join(60)
    assert not w.thread.is_alive()
    assert (w.seconds is not None) != bool(w.error), (w.seconds, w.error)
    if w.error:
        assert w.context is None and not w.release()  # nothing to give back


@pytest.mark.cuda
def test_torch_uses_the_context_made_before_it_was_imported():
    """In a fresh process: the warmer retains the primary context before torch is imported,
    and torch then computes in that very context."""
    script = textwrap.dedent(
        """
        from flashrt_ros.cuda.prewarm import warm_context
        w = warm_context("cuda")
        import torch
        from cuda.bindings import driver as drv
        w.thread.join(60)
        assert w.seconds is not None, w.error
        x = torch.arange(4, device="cuda").sum().item()
        err, ctx = drv.cuCtxGetCurrent()
        assert int(err) == 0 and int(ctx) == w.context, (ctx, w.context)
        print("ok", x, round(w.seconds, 3))
        """
    )
    pytest.importorskip("cuda.bindings")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    cmd = [sys.executable, "-c", script]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("ok 6 "), r.stdout + r.stderr
