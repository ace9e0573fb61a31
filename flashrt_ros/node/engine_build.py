"""The node's policy and engine, built from its config: at configure, or beside the node's start.

`build_engine` is the first half of configure: the policy loaded, checked against the node's
joints and cameras, and its Engine built (on CUDA: the arena, then the first eager step and the
capture). It imports no ROS.

`EarlyBuild` runs it on a thread of its own while an autostarting node is still starting (main.py).
A start is, one after the other (H200 machine, unfused, ad hoc from the node's start-up log at
3aac050): process and rclpy 0.37 s, imports 1.41 s (torch 1.14 of it), the engine 0.36 s, 0.32 of
which is the first eager step, where each op loads its kernels. The engine needs only torch and
the core. The rest of the imports (the message types and the node's own modules, ~0.25 s) and
the node's creation never touch the device, and torch runs its ops, kernel loads included, with
the GIL released. So main.py imports the core first, starts the build with the config that the
parameter check gave, then imports the rest and creates the node. Configure takes the result only
when its own config is the one the build started from (else drops it and builds anew). It also
raises what the build raised, so a bad policy fails configure with the same message either way.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from flashrt_ros.errors import BadRequest
from flashrt_ros.obs.images import engine_encoding, match_policy, parse_cameras
from flashrt_ros.obs.joints import JointMapper
from flashrt_ros.policies.base import IMAGE_PREFIX
from flashrt_ros.policies.loader import load_policy
from flashrt_ros.runtime.engine import Engine


@dataclass
class Built:
    """What configure needs from the build: the engine and what it was checked against."""

    cfg: object  # the node's config (params.NodeConfig) it was built from
    policy: object
    mapper: JointMapper
    cameras: dict[str, str | None]
    state_key: str  # the policy's vector input for dict observations ("" for vector only)
    engine: Engine
    t_load: float  # monotonic: the policy's load began
    t_engine: float  # monotonic: the engine's build began
    thread: str = field(default_factory=lambda: threading.current_thread().name)


def check_inputs(policy, cameras: dict[str, str | None]) -> str:
    """The node serves one vector input (the joint state) and, as images, exactly the
    `cameras`: BadRequest naming both sets otherwise, so a camera policy never starts blind.
    Returns the vector's key for dict observations ("" for a vector-only policy)."""
    specs = list(policy.input_spec())
    vectors = [i.name for i in specs if i.kind == "vector"]
    images = [i.name.removeprefix(IMAGE_PREFIX) for i in specs if i.kind == "image"]
    if len(vectors) != 1:
        raise BadRequest(
            f"policy {policy.policy_id} takes vector inputs {vectors}; the node serves one "
            "(the joint state)"
        )
    match_policy(cameras, images)
    return vectors[0] if images else ""


def build_engine(cfg) -> Built:
    """The policy `cfg` names, checked against its joints and cameras, and its Engine.
    Raises what configure reports: ValueError (BadRequest) on a mismatch, the loader's and the
    Engine's own errors otherwise."""
    t_load = time.monotonic()
    policy = load_policy(cfg.policy, weights=cfg.weights or None)
    mapper = JointMapper(cfg.joint_names, limit=cfg.obs_limit)
    if policy.action_dim != mapper.n or policy.obs_dim != 2 * mapper.n:
        raise ValueError(
            f"policy {policy.policy_id} takes {policy.obs_dim} observations and gives "
            f"{policy.action_dim} actions; joint_names has {mapper.n} joints"
        )
    cameras = parse_cameras(cfg.cameras)
    state_key = check_inputs(policy, cameras)
    t_engine = time.monotonic()
    engine = Engine(
        policy,
        device=cfg.device,
        seed=cfg.seed,
        capsule_slots=cfg.capsule_slots,
        host_capsule_slots=cfg.host_capsule_slots,
        capsule_dir=cfg.capsule_dir or None,
        max_sessions=cfg.max_sessions,  # the rollout scratch session is not counted
        obs_limit=cfg.obs_limit,
        flight_ticks=cfg.flight_ticks,
        compile_cache_dir=cfg.compile_cache_dir or None,
        fuse=None if cfg.fuse else False,  # None: fused on CUDA (the Engine's default)
        late_fuse=cfg.late_fuse,
        image_encodings={  # a compressed camera is decoded to the policy's default
            IMAGE_PREFIX + name: e
            for name, enc in cameras.items()
            if (e := engine_encoding(enc)) is not None
        },
    )
    return Built(cfg, policy, mapper, cameras, state_key, engine, t_load, t_engine)


class EarlyBuild:
    """build_engine(cfg) on a thread (`flashrt-engine-build`), started at once; `take` hands
    the result to configure (see the module docstring)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.seconds: float | None = None  # how long the build ran, once it ended
        self.waited_s = 0.0  # how long `take` waited for it
        self._built: Built | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="flashrt-engine-build", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            self._built = build_engine(self.cfg)
        except BaseException as e:  # noqa: BLE001 - handed to configure, which reports it
            self._error = e
        self.seconds = time.monotonic() - t0

    def take(self, cfg) -> Built | None:
        """The build for `cfg`, once it ended; None (the build dropped) when `cfg` is not the
        config it started from; what the build raised, raised here. Once only."""
        t0 = time.monotonic()
        self.thread.join()
        self.waited_s = time.monotonic() - t0
        built, error = self._built, self._error
        self._built = self._error = None
        if cfg != self.cfg:
            return None
        if error is not None:
            raise error
        return built

    def close(self, timeout: float = 30.0) -> None:
        """Wait for a build nobody took (the start was interrupted) and drop it, so the
        process never exits with a capture under way."""
        self.thread.join(timeout)
        self._built = self._error = None
