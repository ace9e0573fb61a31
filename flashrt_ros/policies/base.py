"""The policy protocol: what the runtime needs from a policy to serve it from static buffers."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

ROLES = ("kv", "recurrent", "conv", "queue", "noise", "goal", "counter", "meta", "user")


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


class Policy(torch.nn.Module):
    """A stateful policy the Engine can capture.

    `step` reads `obs` (1, obs_dim), updates the tensors of `state` IN PLACE and writes `action`
    (1, action_dim) and `chunk` (1, chunk_len, action_dim). It must not allocate outside
    temporaries, sync with the host, or branch in Python on tensor values: it is captured once
    and replayed. `state["goal"]` (1, goal_dim) and `state["step"]` (1,) int64 are always present.
    """

    policy_id: str = "policy"
    obs_dim: int
    action_dim: int
    goal_dim: int
    chunk_len: int = 1

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
        """Digest of every parameter and buffer, so capsules of other weights are refused."""
        h = hashlib.sha256()
        for name, t in sorted(self.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:32]
