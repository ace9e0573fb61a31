"""A session: one state arena, its static IO buffers and its captured steps (one per tick
kind of the policy: e.g. a tick that infers and a tick that only pops the action queue)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashrt_ros.cuda import ring as ring_kernel
from flashrt_ros.cuda.copy import copy_io
from flashrt_ros.errors import CapacityError
from flashrt_ros.policies.base import Policy, StateEntry
from flashrt_ros.runtime import fusecheck, purecheck
from flashrt_ros.runtime.arena import Arena
from flashrt_ros.runtime.flight import FlightRing, record
from flashrt_ros.runtime.graph import StepPlan
from flashrt_ros.runtime.inputs import InputBuffers, policy_inputs
from flashrt_ros.runtime.precompiled import PrecompiledSteps


def raw_step(policy: Policy, obs, views, action, chunk, kind: int = 0) -> None:
    """The policy step of this kind. Its after_step and the engine-owned step counter follow
    it, called by the caller outside any compiled code (see _plan). The outputs are NaN until
    the step writes them: an element a step leaves unwritten faults like a NaN (the Engine's
    finite check) instead of sending the last tick's value, or the zeros the buffers start
    with, to a robot (a policy author's review: `action = x` instead of `action.copy_(x)`)."""
    action.fill_(float("nan"))
    chunk.fill_(float("nan"))
    if kind == 0 and len(policy.tick_kinds) == 1:
        policy.step(obs, views, action, chunk)
    else:
        policy.step_kind(kind, obs, views, action, chunk)


def arena_step(
    policy: Policy, buf, obs, action, chunk, table: tuple, ring=None, kind: int = 0, conv=None
) -> None:
    """raw_step over views made from the arena's bytes inside the call. The compiler sees one
    mutated input (the arena) instead of many aliasing views of different dtypes, which
    aot_autograd cannot functionalize. With `ring` (the torch path of the flight recorder:
    the CPU, or CUDA without cuda/ring.py's kernel), the arena the step starts from is
    written to its slot first, inside the same function, the slot index computed from the
    step counter on the device. With `conv` (dict policies), `obs` is the dict
    of raw input buffers and the images are converted here, inside the step."""
    views = {
        name: buf[off : off + n].view(dtype).view(shape) for name, dtype, shape, off, n in table
    }
    if ring is not None:
        record(ring, buf, views["step"])
    if conv is not None:
        obs = policy_inputs(obs, conv)
    raw_step(policy, obs, views, action, chunk, kind)


_fused_step = None
RECOMPILE_LIMIT = 64  # compiled variants of the step per process (policies x tick kinds)


def fused_step():
    """arena_step compiled by inductor (elementwise chains fused into few kernels), shared by
    all sessions: same shapes, so one compilation serves every arena (one per tick kind). It
    is captured into our own graph afterwards; inductor's own cudagraphs are off because they
    skip in-place state."""
    global _fused_step
    if _fused_step is None:
        # Each (policy, tick kind) is one compiled variant of arena_step. Past dynamo's limit
        # (8) it would silently run the step uncompiled, and a session captured then would give
        # other float results than its twin: a branch would no longer continue bit for bit
        # (seen on the H200 with several policies in one process). Raise the limit, and fail
        # loudly rather than fall back.
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
        if hasattr(cfg, "fail_on_recompile_limit_hit"):
            cfg.fail_on_recompile_limit_hit = True
        _fused_step = torch.compile(arena_step, dynamic=False)
    return _fused_step


@dataclass
class PlanSet:
    """A session's steps, one per tick kind, swapped in together (Session.use_plans)."""

    fused: bool  # the compiled step, or the eager kernels
    plans: list[StepPlan]
    step_fns: list[Callable[[], None]]  # per kind: the step without IO
    runs: list[Callable[[bool], None]]  # per kind: run(use_fused), the policy step alone


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
        flight_ticks: int = 0,
        encodings: dict[str, str] | None = None,
        precompiled: PrecompiledSteps | None = None,
        check_fused: bool = False,
        check_pure: bool = False,
    ):
        """`flight_ticks` > 0 gives the session a flight ring of that many states (flight.py),
        allocated here, before the step is captured, and written by the captured step.
        `encodings` maps each image input to its camera encoding (inputs.resolve_encodings).
        With `fuse`, `precompiled` (precompiled.py) loads or compiles-and-saves each tick kind's
        fused step ahead of time instead of torch.compile's tracing on first call. With
        `check_fused`, a fused step is first checked against the eager one (fusecheck.py);
        when they differ, `fused_mismatch` says how and the step is captured unfused. With
        `check_pure` (and the policy's probe_purity), the eager step is first checked to be a
        function of the arena and the inputs alone (purecheck.py): BadRequest if not."""
        self.name = name
        self.arena = Arena(spec, device)
        self.views = self.arena.views
        specs = policy.input_spec()
        self._encodings = dict(encodings or {})
        self.inputs = InputBuffers(specs, self._encodings, device)
        # the vector form's buffers (the first vector input; None for an image-only policy)
        first = next((i.name for i in specs if i.kind == "vector"), None)
        self.obs = self.inputs.dev.get(first)
        self.obs_np = self.inputs.np.get(first)
        self.action = torch.zeros((1, policy.action_dim), dtype=torch.float32, device=device)
        self.chunk = torch.zeros(
            (1, policy.chunk_len, policy.action_dim), dtype=torch.float32, device=device
        )
        if torch.device(device).type == "cuda":  # pinned staging for async copies
            self.host_action = torch.zeros(self.action.shape, pin_memory=True)
            self.host_chunk = torch.zeros(self.chunk.shape, pin_memory=True)
        else:  # on the CPU the static buffers are the host buffers
            self.host_action, self.host_chunk = self.action, self.chunk
        # numpy views of the host buffers: staging and reading allocate no tensors per tick
        self.action_np = self.host_action[0].numpy()
        self.chunk_np = self.host_chunk[0].numpy()
        self.steps = 0  # host mirror of views["step"], so reading it never syncs
        self.parent_id = ""
        # bumped whenever the arena is put elsewhere than its last step left it (restore,
        # branch into it, copy, reset, rewind): work spread over several steps (a committed
        # rollout) sees that another request moved the session under it
        self.generation = 0
        with torch.no_grad():
            policy.init_state(self.views, seed)
            self.views["meta"][0, 0] = int(seed)
        buf = self.arena.buf
        table = tuple(
            (e.name, e.dtype, tuple(e.shape), r.offset, r.nbytes)
            for e, r in zip(spec, self.arena.rows, strict=True)
        )
        self.table = table
        fused = (precompiled or fused_step()) if fuse else None
        self.fused_fn = fused  # what prepare_plans takes (the steps themselves are per kind)
        self.flight = None
        if flight_ticks:
            try:
                self.flight = FlightRing(flight_ticks, self.arena.nbytes, device)
            except RuntimeError as e:  # out of (device) memory: a bound, not a fault
                raise CapacityError(
                    f"cannot allocate the flight recorder's ring for session {name!r}: "
                    f"{flight_ticks} ticks x {self.arena.nbytes} B = "
                    f"{flight_ticks * self.arena.nbytes / 2**20:.0f} MiB ({e}); lower "
                    "flight_ticks (or max_sessions: every session has a ring)"
                ) from None
        ring = self.flight.words if self.flight is not None else None
        # On CUDA the ring write is our own kernel (cuda/ring.py), launched in the step graph
        # beside the input uploads; elsewhere it is torch's scatter inside the step function.
        self.ring_kernel = bool(
            ring is not None
            and use_graph
            and torch.device(device).type == "cuda"
            and ring_kernel.usable(ring, buf, self.views["step"])
        )
        kinds = range(len(policy.tick_kinds))
        # per tick kind: the inputs it reads, in input_spec order (only those are staged)
        self.tick_names = [
            tuple(n for n in self.inputs.dev if n in set(policy.tick_inputs(k))) for k in kinds
        ]
        # every buffer a step writes or reads; the check and the warm-up put them back
        self._protect = [buf, *self.inputs.dev.values(), self.action, self.chunk]
        self._policy, self._ring, self._device, self._use_graph = policy, ring, device, use_graph
        self.fused_mismatch = ""  # why the fused step was not served (check_fused)
        if check_pure and policy.probe_purity:  # eager, before anything is compiled
            self._check_pure(policy)
        plans = self._make_plans(fused)
        if fused is not None and check_fused:
            self.fused_mismatch = self._check_fused(policy, plans.runs)
            if self.fused_mismatch:  # served from its eager kernels
                plans = self._make_plans(None)
        # Warm-up writes ring slots too; they hold no listed step (flight() lists steps from
        # `lo` = 0 on, and slot k is listed only once a real step has rewritten it).
        for plan in plans.plans:
            plan.capture(self._protect)
        self.use_plans(plans)

    def _make_plans(self, fused, loaded_only: bool = False, with_ring: bool = True) -> PlanSet:
        """One StepPlan per tick kind, not yet captured; `fused`: the compiled step or None.
        `loaded_only`: a precompiled step must already be loaded (PrecompiledSteps.step)."""
        kinds = range(len(self._policy.tick_kinds))
        made = [self._plan(self._policy, k, fused, loaded_only, with_ring) for k in kinds]
        return PlanSet(fused is not None, *(list(x) for x in zip(*made, strict=True)))

    def use_plans(self, plans: PlanSet) -> None:
        """Serve these plans from the next tick on (a commit boundary: only between steps)."""
        self.plans = plans.plans
        self._step_fns, self._runs = plans.step_fns, plans.runs
        self.plan = self.plans[0]
        self.step_fn = self._step_fns[0]  # the first kind's step, without IO
        self.fused = plans.fused
        # With a graph, the input uploads and the output downloads are memcpy nodes of the
        # graph: a tick is then one launch and one wait, with nothing else issued per step.
        self.io_in_graph = self.plan.use_graph

    def prepare_plans(self, fused) -> PlanSet:
        """Plans with the compiled step `fused` over this session's buffers, captured without
        running anything (Late fusing, latefuse.py: another thread may be stepping this
        session meanwhile). The compiled step must already have run once for these shapes, on
        a session built like this one, so that capture finds it compiled and its lazy state
        made. Served only once use_plans() swaps them in."""
        plans = self._make_plans(fused, loaded_only=True)
        for plan in plans.plans:
            plan.capture_only()
        return plans

    def warm_fused(self) -> None:
        """Run each tick kind's step once, on a probe session that is thrown away after: on
        the CPU, where capture() runs nothing, this compiles the step for these shapes
        (latefuse.py)."""
        with torch.no_grad():
            for fn in self._step_fns:
                fn()

    def _check_pure(self, policy: Policy) -> None:
        """purecheck.check_pure over this session's buffers (put back after): each tick kind's
        eager step and after_step, without the flight ring's write (not the policy's; on the
        CPU a copy of the whole ring to put it back cost its size again, review)."""
        runs = self._make_plans(None, with_ring=False).runs
        outputs = {"the state": self.arena.buf, "action": self.action, "chunk": self.chunk}
        purecheck.check_pure(
            policy.policy_id,
            policy.tick_kind,
            len(policy.tick_kinds),
            lambda kind: runs[kind](False),
            lambda: self.views["step"].add_(1),
            self.views,
            outputs,
            self._protect,
            list(self.inputs.dev.values()),
        )

    def _check_fused(self, policy: Policy, runs: list) -> str:
        """fusecheck.check_fused over this session's buffers, which are put back after. Where
        the step function writes the flight ring itself (no ring kernel), the ring is one of
        its outputs: a fused write to the wrong slot would be a wrong rewind later."""
        outputs = {**self.views, "action": self.action, "chunk": self.chunk}
        keep = self._protect
        if self._ring is not None and not self.ring_kernel:
            outputs["flight ring"] = self._ring
            keep = [*keep, self._ring]
        saved = [t.clone() for t in keep]
        try:
            return fusecheck.check_fused(
                policy.tick_kind,
                lambda kind, use_fused: runs[kind](use_fused),
                lambda: self.views["step"].add_(1),
                self.tick_names,
                self.inputs.dev,
                outputs,
                min_ticks=policy.check_ticks,
            )
        finally:
            with torch.no_grad():
                for t, s in zip(keep, saved, strict=True):
                    t.copy_(s)

    def _plan(
        self,
        policy: Policy,
        kind: int,
        fused,
        loaded_only: bool = False,
        with_ring: bool = True,
    ) -> tuple[StepPlan, Callable, Callable]:
        """The StepPlan of one tick kind: its step function over the static buffers and, with a
        graph, the uploads of the inputs it reads and the output downloads around it; with
        the step function without IO and run(use_fused), the policy step alone. `with_ring`
        False leaves the flight ring's write out (the purity probe's plans)."""
        ring, device, use_graph = self._ring if with_ring else None, self._device, self._use_graph
        views, action, chunk = self.views, self.action, self.chunk
        buf, table = self.arena.buf, self.table
        names = self.tick_names[kind]
        dev = {n: self.inputs.dev[n] for n in names}
        if policy.takes_dict:
            conv, obs = self.conversions(names), dev
        else:
            conv, obs = None, self.obs

        own_ring = ring if ring is not None and self.ring_kernel else None
        ring = None if own_ring is not None else ring  # what the step function records itself
        step = views["step"]
        args = (policy, buf, obs, action, chunk, table, ring, kind, conv)
        if isinstance(fused, PrecompiledSteps):  # its check step writes the ring (args[6])
            fused = fused.step(arena_step, args, fused_step, keep=(6,), loaded_only=loaded_only)

        def step_fn() -> None:
            if own_ring is not None:
                ring_kernel.launch(own_ring, buf, step)
            policy_step_fn()

        def run(use_fused: bool) -> None:
            """The policy's step of this kind (and the torch ring write), fused or eager, then
            its after_step, never compiled (Policy.after_step)."""
            if use_fused:
                fused(*args)
            else:
                if ring is not None:
                    record(ring, buf, step)
                x = policy_inputs(obs, conv) if conv is not None else obs
                raw_step(policy, x, views, action, chunk, kind)
            policy.after_step(kind, views, action, chunk)

        use_fused = fused is not None

        def policy_step_fn() -> None:
            run(use_fused)
            # Its own kernel, after the step. Inside a compiled step, inductor could compute an
            # output that reads the counter (a queue cursor) after this write: it does not
            # order the readers of a dtype view of the arena before a later write to the arena
            # (pytorch/pytorch#198101; docs/design.md, "Checking the fused step").
            step.add_(1)

        plan = StepPlan(step_fn, device, use_graph, default_device=fused is None)
        if plan.use_graph:
            host = {n: self.inputs.host[n] for n in names}
            host_action, host_chunk = self.host_action, self.host_chunk
            # The ring write reads the arena, the uploads write only input buffers: in the
            # graph they are two branches that run side by side, joined before the step.
            side = torch.cuda.Stream(device) if own_ring is not None else None

            def io_step_fn() -> None:
                if side is not None:
                    cur = torch.cuda.current_stream(device)
                    side.wait_stream(cur)
                    with torch.cuda.stream(side):
                        ring_kernel.launch(own_ring, buf, step)
                for n, d in dev.items():
                    copy_io(d, host[n])
                if side is not None:
                    cur.wait_stream(side)
                    policy_step_fn()
                else:
                    step_fn()
                copy_io(host_action, action)
                copy_io(host_chunk, chunk)

            plan.fn = io_step_fn
        return plan, step_fn, run

    def conversions(self, names: tuple[str, ...]) -> tuple:
        """inputs.policy_inputs' rows for these inputs: vectors as they are, images by their
        encoding and channel count."""
        specs = self.inputs.specs
        return tuple(
            (n, None, 0) if specs[n].kind == "vector" else (n, self._encoding(n), specs[n].shape[0])
            for n in names
        )

    def _encoding(self, name: str) -> str:
        shape = self.inputs.shapes[name]
        return self._encodings.get(name, "mono8" if shape[2] == 1 else "rgb8")

    def state_replaced(self) -> None:
        """Called by the Engine after anything other than a step or a rewind rewrote the arena
        (restore, branch, session copy, reset): the state now starts a new line of steps, so the
        flight ring's older slots no longer lead here. Host bookkeeping only: the arena itself
        is the newest state, and the next step records it."""
        self.generation += 1
        if self.flight is not None:
            self.flight.restart(self.steps)

    def flight_steps(self) -> range:
        """The steps whose state this session holds, oldest first (only the current one when
        the recorder is off)."""
        if self.flight is None:
            return range(self.steps, self.steps + 1)
        return self.flight.held(self.steps)

    def flight_state(self, step: int) -> torch.Tensor:
        """The bytes of a held step: the arena for the current one, else its ring slot."""
        if step == self.steps or self.flight is None:
            return self.arena.buf
        return self.flight.row(step)

    def rewind_to(self, step: int) -> None:
        """Back to a held step older than the current one, with one device copy; the steps
        older than it stay held."""
        self.flight.rewind(step, self.steps, self.arena.buf)
        self.steps = step
        self.generation += 1

    @property
    def captured(self) -> bool:
        return self.plan.graph is not None
