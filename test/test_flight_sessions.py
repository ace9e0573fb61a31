"""The node's flight record per session (node/flight_services.py), in-process over real rclpy:
a planner that branches into a new session name for every attempt, then drops it, keeps a
bounded record for hours (a soak review found the stamps and counts of every name ever used
kept until the next configure)."""

from __future__ import annotations

import numpy as np

from flashrt_ros.node.flight_services import FlightServices
from flashrt_ros.node.services import Control
from flashrt_ros.node.stats import LoopStats
from flashrt_ros.runtime.engine import Engine
from test.tiny_policy import tiny


def test_a_dropped_session_leaves_nothing_in_the_flight_record(ros):
    eng = Engine(tiny(), device="cpu", flight_ticks=8, max_sessions=3)
    ctl = Control(LoopStats(), ros.node.get_logger(), lambda: None)
    ctl.engine = eng
    flight = FlightServices(ctl, ros.node, None)
    obs = np.linspace(-1, 1, eng.obs_dim).astype(np.float32)
    try:
        for attempt in range(40):
            name = f"try{attempt}"
            with ctl.lock:
                cp = eng.checkpoint()
                eng.branch(cp.id, name)
                flight.forget(eng, name)  # what the branch handler tells it (on_moved)
                eng.set_goal([0.1] * eng.goal_dim, session=name)
                for _ in range(3):
                    eng.step(obs, session=name)
                    flight.tick(eng, name)
                eng.step(obs)
                flight.tick(eng, "main")
                eng.drop_session(name)
                flight.dropped(eng, name)
                eng.drop(cp.id)
        records = (flight._rings, flight._last)
        assert all(set(r) <= {"main"} for r in records), [sorted(r) for r in records]
        main = eng.session("main")
        assert flight._rings["main"].get(main.steps, main.parent_id) is not None  # kept
    finally:
        flight.close()


def test_a_cleanup_lets_the_engine_go(ros):
    """The flight record held the last engine it saw: after a cleanup its arenas, pool and
    flight rings stayed allocated until the next configure, though the node said "engine and
    GPU memory freed" (core diff review). release() (the cleanup calls it) lets it go."""
    import gc
    import weakref

    eng = Engine(tiny(), device="cpu", flight_ticks=8)
    ctl = Control(LoopStats(), ros.node.get_logger(), lambda: None)
    ctl.engine = eng
    flight = FlightServices(ctl, ros.node, None)
    try:
        eng.step(np.zeros(eng.obs_dim, dtype=np.float32))
        flight.tick(eng, "main")
        gone = weakref.ref(eng)
        ctl.engine = eng = None
        gc.collect()
        assert gone() is not None  # still held by the flight record
        flight.release()
        gc.collect()
        assert gone() is None
    finally:
        flight.close()
