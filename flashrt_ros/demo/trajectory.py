"""The joint positions a demo run recorded: plain arrays, no ROS (joint_states.csv on disk)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class Trajectory:
    """Joint positions ``q`` (len(t), len(joint_names)) at ``t``, seconds since the story began.

    Kept apart from the summary: the summary is what summary.json says, this is what the plot and
    joint_states.csv need.
    """

    t: np.ndarray
    q: np.ndarray
    joint_names: list[str] = field(default_factory=list)

    def write_csv(self, path: Path) -> Path:
        """One row per joint_states message: t_s, then each joint's position."""
        np.savetxt(
            path,
            np.column_stack([self.t, self.q]),
            delimiter=",",
            fmt="%.6f",
            header="t_s," + ",".join(self.joint_names),
            comments="",
        )
        return path

    @classmethod
    def read_csv(cls, path: Path) -> Trajectory:
        """The inverse of write_csv, joint names from its header."""
        path = Path(path)
        with open(path) as f:
            names = f.readline().strip().split(",")[1:]
        data = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
        if data.size == 0:
            data = np.zeros((0, len(names) + 1))
        return cls(t=data[:, 0], q=data[:, 1:], joint_names=names)
