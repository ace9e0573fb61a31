"""What the demo needs to know about the policy it serves, read from the policy itself: the same
spec the node loads (``load_policy(spec)``), its ``input_spec()`` (the cameras: every
``observation.images.<name>`` input and its size) and its arena (what a capsule holds).

The sim arm renders one image size, rgb8, for all its cameras; a policy that wants another
layout (two sizes, a 1-channel image) is refused here with a message, before any node starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashrt_ros.demo import DemoError

DEFAULT_POLICY = "builtin:hybrid"


@dataclass(frozen=True)
class PolicyInfo:
    """The served policy as the demo sees it (plain data, goes into summary.json)."""

    spec: str
    policy_id: str
    obs_dim: int
    goal_dim: int
    action_dim: int
    cameras: tuple[str, ...] = ()
    image_hw: tuple[int, int] | None = None
    # the joint_states arrays its observation is made of (the node's state_fields)
    state_fields: tuple[str, ...] = ("position", "velocity")
    # the arena's regions (policy state, then goal and step counter): what a capsule holds
    state: tuple[dict, ...] = field(default_factory=tuple)

    @property
    def visual(self) -> bool:
        """Whether it reads camera images (then ~/rollout, vector rows only, cannot drive it)."""
        return bool(self.cameras)

    @property
    def takes_goal(self) -> bool:
        """Whether the goal is an input of the node (`goal` topic, a branch's goal); else the
        policy sees the goal only in the camera image, where the sim draws it."""
        return self.goal_dim > 0

    def as_dict(self) -> dict:
        return {
            "spec": self.spec,
            "policy_id": self.policy_id,
            "obs_dim": self.obs_dim,
            "goal_dim": self.goal_dim,
            "action_dim": self.action_dim,
            "cameras": list(self.cameras),
            "image_hw": list(self.image_hw) if self.image_hw else None,
            "state_fields": list(self.state_fields),
            "capsule_state": [dict(s) for s in self.state],
        }


def describe_policy(spec: str, n_joints: int) -> PolicyInfo:
    """Load `spec` as the node will (shipped weights) and describe it; DemoError when the demo's
    sim arm cannot serve it (observation = n_joints positions, then velocities or not,
    n_joints actions, a goal of n_joints values or none, images of one size in rgb8)."""
    from flashrt_ros.errors import BadRequest
    from flashrt_ros.policies.loader import load_policy
    from flashrt_ros.runtime.session import engine_entries

    try:
        policy = load_policy(spec)
    except BadRequest as e:
        raise DemoError(f"policy {spec!r}: {e}") from e
    inputs = policy.input_spec()
    images = [i for i in inputs if i.kind == "image"]
    vectors = [i for i in inputs if i.kind == "vector"]
    problems = []
    fields = {(n_joints,): ("position",), (2 * n_joints,): ("position", "velocity")}
    shapes = [tuple(v.shape) for v in vectors]
    if len(shapes) != 1 or shapes[0] not in fields:
        problems.append(
            f"its vector inputs are {[(v.name, v.shape) for v in vectors]}; the sim arm gives one "
            f"of {n_joints} values (positions) or {2 * n_joints} (positions then velocities)"
        )
    if int(policy.action_dim) != n_joints:
        problems.append(f"it has {policy.action_dim} actions; the sim arm has {n_joints} joints")
    if int(policy.goal_dim) not in (0, n_joints):
        problems.append(f"its goal has {policy.goal_dim} values; the demo's goals have {n_joints}")
    if not images and int(policy.goal_dim) == 0:
        problems.append(
            "it takes neither a goal nor a camera: the demo's story is about reaching goals, "
            "which it could not see"
        )
    sizes = sorted({tuple(i.shape) for i in images})
    if len(sizes) > 1:
        problems.append(f"its cameras have sizes {sizes}; the sim arm renders one size for all")
    if images and images[0].shape[0] != 3:
        problems.append(
            f"its image {images[0].name!r} has {images[0].shape[0]} channel(s); the sim arm "
            "publishes rgb8"
        )
    if problems:
        raise DemoError(f"policy {spec!r} does not fit the demo's sim arm: " + "; ".join(problems))
    prefix = "observation.images."
    state = tuple(
        {
            "name": e.name,
            "shape": list(e.shape),
            "dtype": str(e.dtype).replace("torch.", ""),
            "role": e.role,
            "nbytes": int(e.nbytes),
        }
        for e in list(policy.state_spec()) + list(engine_entries(policy))
    )
    return PolicyInfo(
        spec=spec,
        policy_id=str(policy.policy_id),
        obs_dim=int(policy.obs_dim),
        goal_dim=int(policy.goal_dim),
        action_dim=int(policy.action_dim),
        cameras=tuple(i.name[len(prefix) :] for i in images),
        image_hw=(int(images[0].shape[1]), int(images[0].shape[2])) if images else None,
        state_fields=fields[shapes[0]],
        state=state,
    )
