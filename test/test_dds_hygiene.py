"""Fast DDS shared-memory files of killed processes are cleaned, those of live ones never:
ros_helpers.clean_stale_fastdds_shm, which the test session runs first. A live Fast DDS
participant holds an flock on the `_el` file of each of its segments and ports (checked by hand
with rmw_fastrtps_cpp of ROS 2 Kilted: taking it fails while the process runs) and removes them
all when it exits; a killed one leaves them, unlocked. Here the lock is held the same way."""

from __future__ import annotations

import fcntl
import os

from test.ros_helpers import clean_stale_fastdds_shm


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
