"""The node's engine, made from its checked parameters: by configure, or ahead of it.

Building the engine is mostly the device loading each kernel of the step on its first launch
(the unfused start's ~0.3-0.45 s beyond a bare rclpy + torch process on the H100/H200
machines), and torch releases the GIL while it launches. An autostarting node knows its
parameters before it imports its own modules (main.py checks them on a throwaway node), so
`Prebuild` makes the engine in a thread from the moment torch is imported, while the main
thread imports the node's modules and makes the node; the autostart's configure then takes it
(`take`) when its parameters are still the same, and builds its own otherwise.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from flashrt_ros.capsules.folder_lock import FolderLock, lock_folder
from flashrt_ros.errors import BadRequest
from flashrt_ros.node.logs import PREBUILD_THREAD, hold_core_logs
from flashrt_ros.obs.images import engine_encoding, match_policy, parse_cameras
from flashrt_ros.obs.joints import JointMapper, fields_hint
from flashrt_ros.policies.base import IMAGE_PREFIX
from flashrt_ros.policies.loader import load_policy
from flashrt_ros.runtime.engine import Engine


@dataclass
class Built:
    """An engine and what configure made on the way to it."""

    cfg: object  # the checked parameters it was made from (params.NodeConfig)
    policy: object
    mapper: JointMapper
    cameras: dict[str, str | None]
    state_key: str  # the vector input's key for dict observations ("" for a vector policy)
    lock: FolderLock | None  # capsule_dir's, held from here to the node's cleanup
    engine: Engine
    load_s: float  # loading the policy and checking it against the parameters

    def release(self) -> None:
        """Give back what no configure took: capsule_dir's lock (the engine goes with the last
        reference to it; it never stepped, so no build of a fused step is running)."""
        self.engine = None
        if self.lock is not None:
            self.lock.release()


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


def make_engine(cfg, owner: str) -> Built:
    """The policy, checked against the parameters, and its engine over capsule_dir (locked for
    `owner`, the node's name). ValueError, RuntimeError, OSError (or another error of the
    policy's own) for what is wrong; nothing is left held then."""
    t_load = time.monotonic()
    policy = load_policy(cfg.policy, weights=cfg.weights or None)
    mapper = JointMapper(cfg.joint_names, limit=cfg.obs_limit, fields=cfg.state_fields)
    misfits = []
    if policy.action_dim != mapper.n:
        misfits.append(
            f"it gives {policy.action_dim} actions and joint_names has {mapper.n} "
            "joints: a command carries one action per joint, in joint_names' order"
        )
    if policy.obs_dim != mapper.dim:
        misfits.append(
            f"it takes {policy.obs_dim} observations and state_fields "
            f"{list(mapper.fields)} of {mapper.n} joints make {mapper.dim} observations"
            + fields_hint(policy.obs_dim, mapper.n)
        )
    if misfits:
        raise ValueError(f"policy {policy.policy_id}: " + "; ".join(misfits))
    cameras = parse_cameras(cfg.cameras)
    state_key = check_inputs(policy, cameras)
    lock = lock_folder(cfg.capsule_dir, owner) if cfg.capsule_dir else None
    load_s = time.monotonic() - t_load
    try:
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
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Built(cfg, policy, mapper, cameras, state_key, lock, engine, load_s)


class Prebuild:
    """`make_engine(cfg, owner)` in a thread of its own, started at once."""

    def __init__(self, cfg, owner: str) -> None:
        self.cfg, self.owner = cfg, owner
        self.built: Built | None = None
        self.error = ""  # why there is none, to follow "the engine made ahead ..."
        # what the core logs meanwhile (the store's reload, a precompiled step's load), for
        # configure to replay through the node's logger: no node exists yet to put it on /rosout
        self._held, self._unhold = hold_core_logs(PREBUILD_THREAD)
        self._thread = threading.Thread(target=self._run, name=PREBUILD_THREAD, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.built = make_engine(self.cfg, self.owner)
        except BaseException as e:  # noqa: BLE001 - configure builds again and says why
            self.error = f"failed ({type(e).__name__}: {e})"
        finally:
            self._unhold()

    def records(self) -> list[logging.LogRecord]:
        """What the core logged during the build, once it ended."""
        return self._held.records

    def take(self, cfg) -> tuple[Built | None, float]:
        """(the engine for `cfg`, seconds waited for the build), once; (None, waited) when it
        failed or was made for other parameters (then released: configure builds anew)."""
        t0 = time.monotonic()
        self._thread.join()
        waited = time.monotonic() - t0
        built, self.built = self.built, None
        if built is not None and built.cfg != cfg:
            built.release()
            self.error, built = "was made for other parameters", None
        return built, waited

    def discard(self, timeout: float = 1.0) -> None:
        """The node stops before a configure took the engine: let go of it (a build still
        running after `timeout` is left to the process's exit)."""
        self._thread.join(timeout)
        built, self.built = self.built, None
        if built is not None:
            built.release()
