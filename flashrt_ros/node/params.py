"""The node's parameters (DESIGN.md section 5): declared with descriptors, checked at configure."""

from __future__ import annotations

from dataclasses import dataclass

from rcl_interfaces.msg import ParameterDescriptor

DEFAULT_JOINTS = [f"joint{i}" for i in range(1, 7)]

# name: (default, description)
PARAMETERS: dict[str, tuple[object, str]] = {
    "policy": (
        "builtin:hybrid",
        "policy spec: builtin:hybrid, package.module:factory or a .pt2 path",
    ),
    "weights": ("", "weights file for the policy ('' = the shipped weights)"),
    "device": ("auto", "auto | cpu | cuda | cuda:N"),
    "trigger": ("timer", "timer: step at rate_hz; observation: one step per joint_states message"),
    "rate_hz": (100.0, "control rate in timer mode (also the chunk spacing of joint_trajectory)"),
    "joint_names": (DEFAULT_JOINTS, "joints of the observation and the command, in order"),
    "output": ("commands", "commands | joint_trajectory | both"),
    "obs_timeout_s": (0.5, "older observations are stale: no step, no command, the robot holds"),
    "publish_offset_s": (
        0.0,
        "timer mode: publish each command this long after its tick's deadline (0 = as soon as "
        "computed); set above the step's p99 to trade latency for a steady output phase",
    ),
    "capsule_slots": (16, "GPU capsule pool slots, each one state arena"),
    "host_capsule_slots": (0, "pinned-host slots that evicted capsules spill to (0 = drop)"),
    "capsule_dir": ("", "folder for persisted capsules, reloaded at configure ('' = none)"),
    "max_sessions": (4, "sessions that may exist at once (branches included)"),
    "seed": (0, "seed of the policy's noise state"),
    "obs_limit": (
        1000.0,
        "observations with any |value| above this are refused (a sanity bound, not joint limits)",
    ),
    "max_rollout_steps": (10000, "the longest ~/rollout request accepted"),
    "autostart": (True, "configure and activate at start"),
}


@dataclass(frozen=True)
class NodeConfig:
    policy: str
    weights: str
    device: str
    trigger: str
    rate_hz: float
    joint_names: list[str]
    output: str
    obs_timeout_s: float
    publish_offset_s: float
    capsule_slots: int
    host_capsule_slots: int
    capsule_dir: str
    max_sessions: int
    seed: int
    obs_limit: float
    max_rollout_steps: int
    autostart: bool


def declare(node) -> None:
    for name, (default, text) in PARAMETERS.items():
        node.declare_parameter(name, default, ParameterDescriptor(description=text))


def read(node) -> NodeConfig:
    """Read and check every parameter; ValueError names the bad one and what it accepts."""
    v = {name: node.get_parameter(name).value for name in PARAMETERS}
    if v["trigger"] not in ("timer", "observation"):
        raise ValueError(f"trigger={v['trigger']!r}: use 'timer' or 'observation'")
    if v["output"] not in ("commands", "joint_trajectory", "both"):
        raise ValueError(f"output={v['output']!r}: use commands, joint_trajectory or both")
    v["rate_hz"] = float(v["rate_hz"])
    if not 0.1 <= v["rate_hz"] <= 10000.0:
        raise ValueError(f"rate_hz={v['rate_hz']}: must be within 0.1 .. 10000")
    v["obs_timeout_s"] = float(v["obs_timeout_s"])
    if v["obs_timeout_s"] <= 0:
        raise ValueError("obs_timeout_s must be > 0")
    v["publish_offset_s"] = float(v["publish_offset_s"])
    period = 1.0 / v["rate_hz"] if v["trigger"] == "timer" else float("inf")
    if not 0.0 <= v["publish_offset_s"] < period:
        raise ValueError(
            f"publish_offset_s={v['publish_offset_s']}: must be >= 0 and below the period "
            f"1/rate_hz = {1.0 / v['rate_hz']:.6f} s"
        )
    for k, lo in (("capsule_slots", 1), ("host_capsule_slots", 0), ("max_sessions", 1)):
        if int(v[k]) < lo:
            raise ValueError(f"{k}={v[k]}: must be >= {lo}")
    v["joint_names"] = list(v["joint_names"])
    return NodeConfig(**v)
