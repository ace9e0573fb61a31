"""A session: one state arena, its static IO buffers and its captured step."""

from __future__ import annotations

import torch

from flashrt_ros.cuda.copy import copy_io
from flashrt_ros.policies.base import Policy, StateEntry
from flashrt_ros.runtime.arena import Arena
from flashrt_ros.runtime.graph import StepPlan


def raw_step(policy: Policy, obs, views, action, chunk) -> None:
    """The whole tick: the policy step, then the engine-owned step counter."""
    policy.step(obs, views, action, chunk)
    views["step"].add_(1)


def arena_step(policy: Policy, buf, obs, action, chunk, table: tuple) -> None:
    """raw_step over views made from the arena's bytes inside the call. The compiler sees one
    mutated input (the arena) instead of many aliasing views of different dtypes, which
    aot_autograd cannot functionalize."""
    views = {
        name: buf[off : off + n].view(dtype).view(shape) for name, dtype, shape, off, n in table
    }
    raw_step(policy, obs, views, action, chunk)


_fused_step = None


def fused_step():
    """raw_step compiled by inductor (elementwise chains fused into few kernels), shared by all
    sessions: same shapes, so one compilation serves every arena. It is captured into our own
    graph afterwards; inductor's own cudagraphs are off because they skip in-place state."""
    global _fused_step
    if _fused_step is None:
        _fused_step = torch.compile(arena_step, dynamic=False)
    return _fused_step


def engine_entries(policy: Policy) -> list[StateEntry]:
    """State every session has whatever the policy: goal, step counter, metadata."""
    return [
        StateEntry("goal", torch.float32, (1, policy.goal_dim), "goal"),
        StateEntry("step", torch.int64, (1,), "counter"),
        StateEntry("meta", torch.int64, (1, 4), "meta"),
    ]


class Session:
    """Everything one stream of control needs; the engine steps and copies it at boundaries."""

    def __init__(
        self,
        name: str,
        policy: Policy,
        spec: list[StateEntry],
        device: torch.device,
        seed: int,
        use_graph: bool,
        fuse: bool = False,
    ):
        self.name = name
        self.arena = Arena(spec, device)
        self.views = self.arena.views
        self.obs = torch.zeros((1, policy.obs_dim), dtype=torch.float32, device=device)
        self.action = torch.zeros((1, policy.action_dim), dtype=torch.float32, device=device)
        self.chunk = torch.zeros(
            (1, policy.chunk_len, policy.action_dim), dtype=torch.float32, device=device
        )
        if torch.device(device).type == "cuda":  # pinned staging for async copies
            self.host_obs = torch.zeros(self.obs.shape, pin_memory=True)
            self.host_action = torch.zeros(self.action.shape, pin_memory=True)
            self.host_chunk = torch.zeros(self.chunk.shape, pin_memory=True)
        else:  # on the CPU the static buffers are the host buffers
            self.host_obs, self.host_action, self.host_chunk = self.obs, self.action, self.chunk
        # numpy views of the host buffers: staging and reading allocate no tensors per tick
        self.obs_np = self.host_obs[0].numpy()
        self.action_np = self.host_action[0].numpy()
        self.chunk_np = self.host_chunk[0].numpy()
        self.steps = 0  # host mirror of views["step"], so reading it never syncs
        self.parent_id = ""
        with torch.no_grad():
            policy.init_state(self.views, seed)
            self.views["meta"][0, 0] = int(seed)
        views, obs, action, chunk = self.views, self.obs, self.action, self.chunk
        buf = self.arena.buf
        table = tuple(
            (e.name, e.dtype, tuple(e.shape), r.offset, r.nbytes)
            for e, r in zip(spec, self.arena.rows, strict=True)
        )
        fused = fused_step() if fuse else None

        def step_fn() -> None:
            if fused is not None:
                fused(policy, buf, obs, action, chunk, table)
            else:
                raw_step(policy, obs, views, action, chunk)

        self.step_fn = step_fn  # the step over the static device buffers, without IO
        self.plan = StepPlan(step_fn, device, use_graph)
        # With a graph, the observation upload and the output downloads are memcpy nodes of the
        # graph: a tick is then one launch and one wait, with nothing else issued per step.
        self.io_in_graph = self.plan.use_graph
        if self.io_in_graph:
            host_obs, host_action, host_chunk = self.host_obs, self.host_action, self.host_chunk

            def io_step_fn() -> None:
                copy_io(obs, host_obs)
                step_fn()
                copy_io(host_action, action)
                copy_io(host_chunk, chunk)

            self.plan.fn = io_step_fn
        self.plan.capture([self.arena.buf, self.obs, self.action, self.chunk])

    def state_replaced(self) -> None:
        """Called by the Engine after anything other than a step rewrote the arena (restore,
        branch, session copy, reset, rewind): the state now starts a new line of steps."""

    @property
    def captured(self) -> bool:
        return self.plan.graph is not None
