"""The policy protocol: what the runtime needs from a policy to serve it from static buffers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from flashrt_ros.obs.keys import IMAGE_PREFIX, STATE_KEY  # noqa: F401  (LeRobot's names)

ROLES = (
    "kv",
    "recurrent",
    "conv",
    "queue",
    "noise",
    "goal",
    "counter",
    "meta",
    "user",
    "history",
)

INPUT_KINDS = ("vector", "image")


@dataclass(frozen=True)
class StateEntry:
    """One named region of the arena. `role` says what kind of state it is (ablations use it)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    role: str = "user"

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= int(s)
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class InputSpec:
    """One observation input, as the policy sees it (no batch axis).

    kind "vector": `shape` (D,), float32, checked finite and within obs_limit.
    kind "image": `shape` (C, H, W); it arrives as an H x W x C uint8 array (ROS's layout; an
    H x W mono8 array for C == 1, or for C == 3 when the engine is told the camera is mono8)
    and reaches the policy as float32 (1, C, H, W) in [0, 1], converted inside the step."""

    name: str
    shape: tuple[int, ...]
    kind: str = "vector"

    def __post_init__(self) -> None:
        if self.kind not in INPUT_KINDS:
            raise ValueError(f"input {self.name!r}: kind must be one of {INPUT_KINDS}")
        if self.kind == "vector" and len(self.shape) != 1:
            raise ValueError(f"input {self.name!r}: a vector has shape (D,), got {self.shape}")
        if self.kind == "image" and (len(self.shape) != 3 or self.shape[0] not in (1, 3)):
            raise ValueError(
                f"input {self.name!r}: an image has shape (1|3, H, W), got {self.shape}"
            )


class Policy(torch.nn.Module):
    """A stateful policy the Engine can capture.

    A tick is `step` (or `step_kind`) and then `after_step`: together they read `obs`
    (1, obs_dim), update the tensors of `state` IN PLACE and write `action` (1, action_dim) and
    `chunk` (1, chunk_len, action_dim); only the Engine calls them, in that order. They must not
    allocate outside temporaries, sync with the host, or branch in Python on tensor values: they
    are captured once and replayed. `state["goal"]` (1, goal_dim) and `state["step"]` (1,) int64
    are always present; the step counter moves on after after_step, by the Engine.
    """

    policy_id: str = "policy"
    obs_dim: int
    action_dim: int
    goal_dim: int
    chunk_len: int = 1
    # False: `step` gets the (1, obs_dim) tensor of the one vector input, as before dict
    # observations existed. True: a dict name -> tensor of the inputs the tick reads.
    takes_dict: bool = False
    # The captured variants of a tick (one graph each); tick_kind picks one per tick.
    tick_kinds: tuple[str, ...] = ("step",)
    # Whether the Engine compiles the step with inductor before capturing it, unless told
    # otherwise. False captures the eager kernels: for a policy whose compiled step was seen to
    # differ from its eager one.
    fuse_default: bool = True
    # Whether the Engine checks at build that two steps from the same arena and inputs agree
    # bit for bit (runtime/purecheck.py): state kept outside the arena or noise of its own are
    # refused. False only for kernels that are not deterministic (atomics): the capsules of
    # such a policy continue only approximately.
    probe_purity: bool = True
    # Ticks the check of a compiled step (runtime/fusecheck.py) runs at least, for a policy
    # whose state takes that long to reach the values it keeps from then on (a queue that
    # fills up); 0: until every tick kind was checked twice.
    check_ticks: int = 0

    def compile_parts(self) -> bool:
        """Compile, in place, the parts of the policy worth compiling on their own; True when
        there are such parts, and the Engine then captures the step around them instead of
        compiling the whole step (for steps whose unrolled loops inductor takes minutes on)."""
        return False

    def input_spec(self) -> list[InputSpec]:
        """The observation inputs; the default is one vector of obs_dim floats, so a policy
        written before dict observations keeps taking `engine.step(vector)`."""
        return [InputSpec(STATE_KEY, (int(self.obs_dim),), "vector")]

    def tick_kind(self, step: int) -> int:
        """Index into tick_kinds of the tick that starts after `step` ticks. Decided on the
        host from its mirror of the step counter, so choosing a graph never syncs."""
        return 0

    def tick_inputs(self, kind: int) -> tuple[str, ...]:
        """The inputs a tick of this kind reads: only those are staged, uploaded and
        converted (a tick that only pops an action queue may read none)."""
        return tuple(i.name for i in self.input_spec())

    def step_kind(
        self,
        kind: int,
        obs,
        state: dict[str, torch.Tensor],
        action: torch.Tensor,
        chunk: torch.Tensor,
    ) -> None:
        """One tick of the given kind; policies with one kind only write `step`."""
        self.step(obs, state, action, chunk)

    def after_step(
        self,
        kind: int,
        state: dict[str, torch.Tensor],
        action: torch.Tensor,
        chunk: torch.Tensor,
    ) -> None:
        """State bookkeeping that rewrites regions the step has read (a queue shifted by one,
        a noise counter advanced), run right after the step of this kind and captured in the
        same graph, but never compiled: inductor has computed a read of an arena view after a
        later write to the arena in the same compiled step (pytorch/pytorch#198101), so a step
        that may be compiled should not rewrite a region it has read, and leave that rewrite
        to this hook. The same rules as `step`: no allocation outside temporaries, no host sync.
        `state["step"]` still holds this tick's value."""

    def state_spec(self) -> list[StateEntry]:
        """Policy-owned state regions; the engine adds goal, step and meta."""
        raise NotImplementedError

    def init_state(self, state: dict[str, torch.Tensor], seed: int) -> None:
        """Fill a fresh session's state in place (zeros are already there)."""

    def step(
        self,
        obs: torch.Tensor,
        state: dict[str, torch.Tensor],
        action: torch.Tensor,
        chunk: torch.Tensor,
    ) -> None:
        raise NotImplementedError

    def weights_digest(self) -> str:
        """Digest of every parameter and buffer (name, dtype, shape and bytes: the same bytes
        as another dtype or shape are other weights), so capsules of other weights are refused.
        The bytes are read as uint8, so dtypes numpy lacks (bfloat16) digest too."""
        # and the tensors modules compute from their configuration (derived_buffers): a setting
        # the policy id does not name still changes the fingerprint (a diffusion policy's
        # number of denoising steps changes its schedule)
        return self._digest(sorted(self.state_dict().items()) + self._derived())

    def weights_digest_v1(self) -> str | None:
        """The digest of the versions before derived_buffers were read (the state dict alone),
        or None where it equals weights_digest(): capsule files those versions wrote carry it,
        and the store still takes them (CapsuleStore.check_header), so an upgrade keeps them."""
        return self._digest(sorted(self.state_dict().items())) if self._derived() else None

    def _derived(self) -> list[tuple[str, torch.Tensor]]:
        """(qualified name, tensor) of every module's derived_buffers, sorted by name."""
        return sorted(
            (f"{prefix}{'.' if prefix else ''}{k}", getattr(m, k))
            for prefix, m in self.named_modules()
            for k in getattr(m, "derived_buffers", ())
        )

    @staticmethod
    def _digest(tensors: list) -> str:
        h = hashlib.sha256()
        for name, t in tensors:
            t = t.detach().cpu().contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:32]
