"""The node's engine build (node/engine_build.py) and its early run beside an autostarting
node's start: the same engine either way, only for the config it was started from, and the
build's errors reported by configure as before."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flashrt_ros.node.engine_build import EarlyBuild, build_engine
from flashrt_ros.node.params import NODE_PARAMS
from test.engine_util import observations

CFG = dataclasses.replace(NODE_PARAMS.config({}), device="cpu")
OBS = observations(6, seed=5)


def _actions(engine) -> np.ndarray:
    return np.array([engine.step(o) for o in OBS])


def test_an_early_build_is_the_engine_configure_would_build() -> None:
    early = EarlyBuild(CFG)
    built = early.take(CFG)
    assert built is not None and built.thread == "flashrt-engine-build"
    assert early.seconds is not None and early.waited_s >= 0.0
    inline = build_engine(CFG)
    assert built.engine.fingerprint == inline.engine.fingerprint
    assert built.state_key == inline.state_key and built.cameras == inline.cameras == {}
    np.testing.assert_array_equal(_actions(built.engine), _actions(inline.engine))
    assert early.take(CFG) is None  # taken once: a later configure builds its own


def test_an_early_build_for_another_config_is_dropped() -> None:
    early = EarlyBuild(CFG)
    assert early.take(dataclasses.replace(CFG, seed=CFG.seed + 1)) is None


def test_an_early_build_that_failed_raises_at_take_as_the_inline_build() -> None:
    bad = dataclasses.replace(CFG, policy="builtin:nope")
    with pytest.raises(ValueError) as inline:
        build_engine(bad)
    early = EarlyBuild(bad)
    with pytest.raises(ValueError) as taken:
        early.take(bad)
    assert str(taken.value) == str(inline.value) and "builtin:nope" in str(taken.value)
    # another config drops the failure with the build: configure builds anew
    early = EarlyBuild(bad)
    assert early.take(CFG) is None


def test_a_build_nobody_took_is_waited_for_and_dropped() -> None:
    early = EarlyBuild(CFG)
    early.close()
    assert not early.thread.is_alive()
    assert early.take(CFG) is None
