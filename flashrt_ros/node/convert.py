"""Conversions between the core's types and ROS messages."""

from __future__ import annotations

import math

import numpy as np
from builtin_interfaces.msg import Duration, Time
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from flashrt_ros.capsules.info import CapsuleInfo
from flashrt_ros.msg import CapsuleInfo as CapsuleInfoMsg


def _sec_nanosec(t: float) -> tuple[int, int]:
    """Whole seconds and nanoseconds, nanosec always < 1e9 (a fraction that rounds up to a
    whole second carries into sec). The fraction is taken before scaling, so wall-clock stamps
    keep their sub-microsecond part."""
    sec = math.floor(t)
    ns = round((t - sec) * 1e9)
    if ns >= 1_000_000_000:
        sec, ns = sec + 1, ns - 1_000_000_000
    return int(sec), int(ns)


def stamp_to_time(stamp: float) -> Time:
    sec, nanosec = _sec_nanosec(stamp)
    return Time(sec=sec, nanosec=nanosec)


def capsule_msg(info: CapsuleInfo) -> CapsuleInfoMsg:
    return CapsuleInfoMsg(
        id=info.id,
        name=info.name,
        session=info.session,
        parent_id=info.parent_id,
        step=int(info.step),
        nbytes=int(info.nbytes),
        tier=info.tier,
        checksum=info.checksum,
        pinned=bool(info.pinned),
        stamp=stamp_to_time(info.stamp),
    )


def evictions(evicted: list[str]) -> str:
    """What a reply adds when the capsule it made evicted others ("" when none): a planner
    learns here, not at its failed restore, that a capsule it counted on is gone."""
    if not evicted:
        return ""
    return (
        f"; the pool was full: evicted {', '.join(evicted)} (pin capsules to keep them, or "
        "raise capsule_slots or host_capsule_slots)"
    )


def command_msg(action: np.ndarray) -> Float64MultiArray:
    msg = Float64MultiArray()
    msg.data = action.tolist()
    return msg


def trajectory_msg(
    chunk: np.ndarray, joint_names: list[str], dt: float, stamp: Time
) -> JointTrajectory:
    """The action chunk as a trajectory: point k is reached k+1 control periods from now."""
    msg = JointTrajectory()
    msg.header.stamp = stamp
    msg.joint_names = joint_names
    for k, row in enumerate(chunk):
        sec, nanosec = _sec_nanosec((k + 1) * dt)
        msg.points.append(
            JointTrajectoryPoint(
                positions=row.tolist(), time_from_start=Duration(sec=sec, nanosec=nanosec)
            )
        )
    return msg
