"""The node's engine, made by configure from its checked parameters: the policy, checked
against joint_names, state_fields and cameras, capsule_dir's lock, and the Engine over them.
Kept apart from flashrt_node.py so that the lifecycle reads as the transitions it makes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from flashrt_ros.capsules.folder_lock import FolderLock, lock_folder
from flashrt_ros.errors import BadRequest
from flashrt_ros.obs.images import engine_encoding, match_policy, parse_cameras
from flashrt_ros.obs.joints import JointMapper, fields_hint
from flashrt_ros.policies.base import IMAGE_PREFIX
from flashrt_ros.policies.loader import load_policy
from flashrt_ros.runtime.engine import Engine


@dataclass
class Built:
    """An engine and what configure made on the way to it."""

    policy: object
    mapper: JointMapper
    cameras: dict[str, str | None]
    state_key: str  # the vector input's key for dict observations ("" for a vector policy)
    lock: FolderLock | None  # capsule_dir's, held from here to the node's cleanup
    engine: Engine
    load_s: float  # loading the policy and checking it against the parameters


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
    return Built(policy, mapper, cameras, state_key, lock, engine, load_s)
