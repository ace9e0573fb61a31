"""Fast DDS shared-memory files of killed processes are cleaned, those of live ones never:
ros_helpers.clean_stale_fastdds_shm, which the test session runs first. A live Fast DDS
participant holds an flock on the `_el` file of each of its segments and ports (checked by hand
with rmw_fastrtps_cpp of ROS 2 Kilted: taking it fails while the process runs) and removes them
all when it exits; a killed one leaves them, unlocked. Here the lock is held the same way. And
the node itself removes its files when SIGINT ends it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from test.node_client import NodeClient
from test.ros_helpers import clean_stale_fastdds_shm, stale_fastdds_names


def test_only_names_whose_lock_nobody_holds_are_removed(tmp_path):
    for name in ("fastdds_dead", "fastdds_live"):
        (tmp_path / name).write_bytes(b"segment")
        (tmp_path / f"{name}_el").touch()
        (tmp_path / f"sem.{name}_mutex").touch()
    (tmp_path / "fastdds_port7000").touch()  # no _el: nothing tells whether it is in use
    held = os.open(tmp_path / "fastdds_live_el", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # as a live participant holds it
    try:
        assert clean_stale_fastdds_shm(tmp_path) == ["fastdds_dead"]
    finally:
        os.close(held)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fastdds_live",
        "fastdds_live_el",
        "fastdds_port7000",
        "sem.fastdds_live_mutex",
    ]


def _shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("fastdds_*")}


def test_the_node_leaves_no_shared_memory_files_when_it_ends(ros):
    """The node's DDS participant is destroyed on SIGINT, after configure froze the heap
    (gc.freeze), which once kept it alive to the end: every start left its files behind."""
    before = _shm_files()
    proc = ros.start_node({"device": "cpu", "trigger": "timer", "rate_hz": 50.0})
    c = NodeClient(ros, proc)
    c.latest_diag(10.0)  # active, and talking to this process over DDS
    made = _shm_files() - before
    assert proc.stop() == 0
    # a port the node opened first stays while this process still uses it, and in a parallel
    # run the files of other tests' processes come and go: what a participant leaves when it
    # dies is files whose `_el` lock nobody holds
    stale = {n for n in stale_fastdds_names() if f"{n}_el" in made}
    assert not stale, f"the node left {sorted(stale)}"
