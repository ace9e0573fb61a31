"""Serve a LeRobot-shaped chunked policy (ACT, Diffusion Policy, flow-matching heads) unchanged.

The module only has to offer a pure `predict_action_chunk(batch[, noise]) -> (B, chunk, A)` and
a LeRobot-style `config` (input_features, output_features, chunk_size, n_action_steps,
n_obs_steps, optional temporal_ensemble_coeff). Everything stateful that LeRobot keeps in
Python deques around the model lives here, in the arena, so a capsule holds it:

- the observation history: a ring of n_obs_steps per input (float, as the policy sees it),
  started LeRobot's way (the first observation repeated), read back in time order;
- the action queue: the latest chunk, read at cursor `step % n_action_steps` (the cursor is the
  arena's step counter, so it cannot disagree with it);
- temporal ensembling (ACT): a running weighted sum and count per future tick, weights
  exp(-coeff * i) for the i-th prediction of that tick, as LeRobot's ACTTemporalEnsembler;
- the noise: when predict_action_chunk takes `noise`, a counter-based hash (rng.py) of a key
  and a counter kept in the arena, so a restore or a branch replays the same noise bit for bit.

Tick kinds, each captured as its own graph: "infer" (a new chunk) every n_action_steps ticks,
"queue" (pop the next action, reading no input) in between; with ensembling, or
n_action_steps == 1, every tick infers. With n_obs_steps > 1 a third kind, "record", pops and
also pushes the observation into the history: the last n_obs_steps - 1 ticks before an infer,
whose observations that infer reads. Earlier pushes would be overwritten before any read, so
the other queue ticks stage, upload and convert no image (1.8 MB a tick for two 640x480
cameras). The host picks the kind from its mirror of the step counter.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Mapping

import torch
from torch import nn

from flashrt_ros.errors import BadRequest
from flashrt_ros.policies.base import IMAGE_PREFIX, InputSpec, Policy, StateEntry
from flashrt_ros.policies.rng import hashed_normal

log = logging.getLogger(__name__)

INFER, QUEUE, RECORD = 0, 1, 2


def type_name(v) -> str:
    """A LeRobot feature type or normalization mode as its upper-case name: a string, or an
    enum whose name is that."""
    return str(getattr(v, "name", v)).upper()


def feature_field(feature, key: str):
    """A feature's `type` or `shape`: an attribute (LeRobot's PolicyFeature) or a key (the
    plain dict LeRobot's config.json stores); None when it has neither."""
    if isinstance(feature, Mapping):
        return feature.get(key)
    return getattr(feature, key, None)


def feature_type(feature) -> str:
    """ "STATE" | "VISUAL" | "ACTION" | ... from a LeRobot PolicyFeature's `.type`."""
    return type_name(feature_field(feature, "type"))


def lerobot_config(module):
    """The module's LeRobot-style `config`; BadRequest unless it also has predict_action_chunk."""
    cfg = getattr(module, "config", None)
    if cfg is None or not callable(getattr(module, "predict_action_chunk", None)):
        raise BadRequest(
            f"{type(module).__name__} is not LeRobot-shaped: it needs .config and "
            ".predict_action_chunk(batch)"
        )
    return cfg


def _shape(feature, name: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in feature_field(feature, "shape"))
    except (TypeError, ValueError):
        raise BadRequest(f"feature {name!r} has no integer .shape") from None


def _positive_int(v, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise BadRequest(f"config.{field} must be an integer >= 1, got {v!r}")
    return v


class ChunkedPolicy(Policy):
    """A LeRobot-shaped module wrapped in the in-place Policy protocol (see module docstring).

    `step_with_chunk`'s chunk is the plan from this tick on, (chunk_size, action_dim): row 0 is
    this tick's action; without ensembling rows past the end of the latest chunk repeat its
    last action (hold); with ensembling it is the blended plan."""

    # outside the state dict, computed from the config (policy_checks.py)
    derived_buffers = ("rows", "obs_t", "ens_w", "ens_cum", "noise_lanes")

    takes_dict = True

    def __init__(
        self,
        module: nn.Module,
        policy_id: str | None = None,
        check_pure: bool = True,
        time_axis: bool | None = None,
    ):
        """`time_axis`: whether batch entries carry the history as dim 1 (default: when
        n_obs_steps > 1, as LeRobot stacks it). `check_pure` calls predict_action_chunk on a
        batch, another one and the first again at load, and refuses a module whose two outputs
        for the same batch differ (check_pure says why)."""
        super().__init__()
        cfg = lerobot_config(module)
        self.module = module.eval()
        ins = dict(getattr(cfg, "input_features", None) or {})
        outs = dict(getattr(cfg, "output_features", None) or {})
        specs = []
        for name, f in ins.items():
            kind = feature_type(f)
            if kind == "STATE":
                shape = _shape(f, name)
                if len(shape) != 1:  # never trimmed: the module would get another shape
                    raise BadRequest(
                        f"state input {name!r}: want a shape (n,), got {shape} (the history of "
                        "n_obs_steps is added as dim 1 by the runtime, not declared)"
                    )
                specs.append(InputSpec(name, shape, "vector"))
            elif kind == "VISUAL":
                shape = _shape(f, name)
                if not name.startswith(IMAGE_PREFIX) or len(shape) != 3 or shape[0] not in (1, 3):
                    raise BadRequest(
                        f"visual input {name!r}: want observation.images.<cam> of "
                        f"shape (1|3, H, W), got {shape}"
                    )
                specs.append(InputSpec(name, shape, "image"))
            else:
                raise BadRequest(f"input {name!r} of type {kind} is not served (STATE, VISUAL)")
        if not specs:
            raise BadRequest("config.input_features declares no STATE or VISUAL input")
        acts = [(n, f) for n, f in outs.items() if feature_type(f) == "ACTION"]
        if len(acts) != 1:
            raise BadRequest(f"config.output_features must hold one ACTION, got {list(outs)}")
        self._inputs = specs
        self.action_dim = _shape(acts[0][1], acts[0][0])[-1]
        self.obs_dim = next((s.shape[0] for s in specs if s.kind == "vector"), 0)
        self.goal_dim = 0
        self.n_obs = _positive_int(getattr(cfg, "n_obs_steps", 1), "n_obs_steps")
        self.n_action = _positive_int(getattr(cfg, "n_action_steps", None), "n_action_steps")
        chunk = getattr(cfg, "chunk_size", None) or getattr(cfg, "horizon", None)
        self.chunk_len = _positive_int(chunk, "chunk_size")
        if self.n_action > self.chunk_len:
            raise BadRequest(f"n_action_steps {self.n_action} > chunk_size {self.chunk_len}")
        coeff = getattr(cfg, "temporal_ensemble_coeff", None)
        if coeff is not None:
            if (
                isinstance(coeff, bool)
                or not isinstance(coeff, int | float)
                or not math.isfinite(coeff)
            ):
                raise BadRequest(f"temporal_ensemble_coeff must be a finite number, got {coeff!r}")
            if self.n_action != 1:
                raise BadRequest("temporal ensembling infers every tick: n_action_steps must be 1")
        self.coeff = None if coeff is None else float(coeff)
        # the ensemble counts saturate after chunk_len ticks: the check of a compiled step
        # (fusecheck.py) runs past that, so the clamped steady state is compared too
        self.check_ticks = 0 if self.coeff is None else self.chunk_len + 1
        parts = getattr(module, "fuse_parts", ())  # see compile_parts
        self.fuse_parts = (parts,) if isinstance(parts, str) else tuple(parts)
        # The step is compiled whole (checked against the eager step first, fusecheck.py)
        # unless the module names parts to compile or sets fuse_default.
        self.fuse_default = bool(getattr(module, "fuse_default", True))
        self.time_axis = self.n_obs > 1 if time_axis is None else bool(time_axis)
        params = inspect.signature(module.predict_action_chunk).parameters
        self.takes_noise = "noise" in params
        horizon = getattr(cfg, "horizon", None) or self.chunk_len
        self.noise_shape = tuple(getattr(module, "noise_shape", (horizon, self.action_dim)))
        pops = self.coeff is None and self.n_action > 1
        kinds = ("infer", "queue", "record") if self.n_obs > 1 else ("infer", "queue")
        self.tick_kinds = kinds if pops else ("infer",)
        base = policy_id or f"chunked:{type(module).__module__}.{type(module).__qualname__}"
        self.policy_id = (
            f"{base}/c{self.chunk_len}-n{self.n_action}-o{self.n_obs}-e{self.coeff}"
            f"-t{int(self.time_axis)}"
        )
        c = self.chunk_len
        self.register_buffer("rows", torch.arange(c), persistent=False)
        self.register_buffer("obs_t", torch.arange(self.n_obs), persistent=False)
        w = torch.exp(-(self.coeff or 0.0) * torch.arange(c, dtype=torch.float64))
        self.register_buffer("ens_w", w.float(), persistent=False)
        self.register_buffer("ens_cum", torch.cumsum(w, 0).float(), persistent=False)
        n = math.prod(self.noise_shape)
        self.register_buffer("noise_lanes", torch.arange(n, dtype=torch.int64), persistent=False)
        if check_pure:
            self.check_pure()

    # -- protocol ---------------------------------------------------------------------------------
    def compile_parts(self) -> bool:
        """The module's `fuse_parts` (submodule names, e.g. a denoiser called K times a tick)
        compiled in place with nn.Module.compile, which keeps their state_dict names; once per
        module, and it stays compiled."""
        for name in self.fuse_parts:
            part = self.module.get_submodule(name)
            if getattr(part, "_compiled_call_impl", None) is None:
                part.compile(dynamic=False)
        return bool(self.fuse_parts)

    def input_spec(self) -> list[InputSpec]:
        return list(self._inputs)

    def tick_kind(self, step: int) -> int:
        cursor = step % self.n_action
        if len(self.tick_kinds) == 1 or cursor == 0:
            return INFER
        # the next infer (at n_action - cursor ticks from now) reads this tick's observation
        return RECORD if self.n_action - cursor < self.n_obs else QUEUE

    def tick_inputs(self, kind: int) -> tuple[str, ...]:
        return () if kind == QUEUE else tuple(s.name for s in self._inputs)

    def state_spec(self) -> list[StateEntry]:
        f32 = torch.float32
        spec = []
        if self.n_obs > 1:
            for s in self._inputs:
                spec.append(StateEntry(f"hist.{s.name}", f32, (1, self.n_obs, *s.shape), "history"))
        c, a = self.chunk_len, self.action_dim
        if self.coeff is None:
            spec.append(StateEntry("queue", f32, (1, c, a), "queue"))
        else:
            spec.append(StateEntry("ens_sum", f32, (1, c, a), "queue"))
            spec.append(StateEntry("ens_count", torch.int64, (1, c), "queue"))
        if self.takes_noise:
            spec.append(StateEntry("rng", torch.int64, (1, 2), "noise"))
        return spec

    def init_state(self, state: dict[str, torch.Tensor], seed: int) -> None:
        if self.takes_noise:
            state["rng"][:, 0] = int(seed) & 0x7FFFFFFF
            state["rng"][:, 1] = 0

    def step(self, obs, state, action, chunk) -> None:
        self.step_kind(INFER, obs, state, action, chunk)

    def step_kind(self, kind, obs, state, action, chunk) -> None:
        """One tick: push the inputs into the history (but a queue tick: see the module
        docstring), then infer (a new chunk) or pop."""
        step = state["step"]  # (1,) ticks before this one
        if kind != QUEUE:
            self._push(obs, state, step)
        if kind == INFER:  # a queue tick keeps the history but never reads it
            pred = self.predict(self._batch(obs, state, step), state)
            if self.coeff is not None:
                self._ensemble(pred, state, action, chunk)
                return
            state["queue"].copy_(pred)
            queue = pred  # the same values, not read back from the arena just written
        else:
            queue = state["queue"]
        idx = torch.clamp(step % self.n_action + self.rows, max=self.chunk_len - 1)
        plan = queue.index_select(1, idx)
        chunk.copy_(plan)
        action.copy_(plan[:, 0])

    # -- the pieces -------------------------------------------------------------------------------
    def _push(self, obs: dict, state: dict, step: torch.Tensor) -> None:
        """With n_obs_steps > 1, write each input to its history ring's slot step % T."""
        if self.n_obs == 1:
            return
        slot = step % self.n_obs
        for k, v in obs.items():
            state[f"hist.{k}"].index_copy_(1, slot, v[:, None])

    def _batch(self, obs: dict, state: dict, step: torch.Tensor) -> dict:
        """The batch LeRobot would build: with n_obs_steps > 1 each input's ring read back in
        time order (after _push), the slots before the first tick standing for the first
        observation (LeRobot repeats it): slot of max(step - T + 1 + t, 0)."""
        if self.n_obs == 1:
            return {k: v[:, None] if self.time_axis else v for k, v in obs.items()}
        t = self.n_obs
        order = torch.clamp(step - (t - 1) + self.obs_t, min=0) % t
        out = {}
        for k in obs:
            seq = state[f"hist.{k}"].index_select(1, order)
            out[k] = seq if self.time_axis else seq[:, -1]
        return out

    def predict(self, batch: dict, state: dict) -> torch.Tensor:
        """The module's chunk for this batch, with noise drawn from the arena's counter (which
        after_step advances)."""
        if not self.takes_noise:
            return self.module.predict_action_chunk(batch)
        rng = state["rng"]
        noise = hashed_normal(rng[:, :1], rng[:, 1:2], self.noise_lanes[None])
        return self.module.predict_action_chunk(batch, noise=noise.view(1, *self.noise_shape))

    def _ensemble(self, pred, state, action, chunk) -> None:
        """LeRobot's ACTTemporalEnsembler as a running weighted sum and count per future tick:
        the i-th prediction of a tick weighs exp(-coeff * i); the plan is sum / cumsum(w).
        The step only reads the sums: it leaves the new running sum in `chunk`, and
        after_step turns it into the plan and shifts the sums (Policy.after_step says why:
        compiled on the H200, the count was read after its own shift, halving the action)."""
        s, n = state["ens_sum"], state["ens_count"]
        w = self.ens_w.index_select(0, n.view(-1).clamp(max=self.chunk_len - 1)).view_as(n)
        chunk.copy_(s + w[..., None] * pred)

    def after_step(self, kind, state, action, chunk) -> None:
        """Outside compiled code: the noise counter moves on after an inference, and with
        ensembling the running sums (in `chunk`, see _ensemble) become the plan and the sums
        and counts shift left by the tick just consumed, the new last tick empty."""
        if kind != INFER:
            return
        if self.takes_noise:
            state["rng"][:, 1].add_(1)
        if self.coeff is None:
            return
        s, n = state["ens_sum"], state["ens_count"]
        c = self.chunk_len
        count = torch.clamp(n + 1, max=c)
        s[:, :-1].copy_(chunk[:, 1:])
        s[:, -1].zero_()
        chunk.div_(self.ens_cum.index_select(0, (count - 1).view(-1)).view(1, c, 1))
        action.copy_(chunk[:, 0])
        n[:, :-1].copy_(count[:, 1:])
        n[:, -1].zero_()

    # -- load-time checks -------------------------------------------------------------------------
    def example_batch(self, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """A batch of one as the module sees it (history axis included), random but valid."""
        out = {}
        for s in self._inputs:
            shape = (1, self.n_obs, *s.shape) if self.time_axis else (1, *s.shape)
            x = torch.rand(shape, generator=generator)
            out[s.name] = x if s.kind == "image" else x * 2 - 1
        return out

    def _batch_words(self, batch: dict[str, torch.Tensor]) -> str:
        """What the module was given, for an error about a call that failed on it."""
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items())
        hist = f"; n_obs_steps {self.n_obs} puts the history in dim 1" if self.time_axis else ""
        return (
            f"it was given {shapes}{hist}. A module that reads queues or state of its own "
            "(LeRobot's DiffusionPolicy does) is served by wrapping its pure part (README: an "
            "impure predict_action_chunk)"
        )

    def check_pure(self) -> None:
        """Call predict_action_chunk on a batch, on another one, then on the first again (with
        the same noise): different outputs for the same batch mean it draws its own randomness
        or keeps state (an observation history or queues of its own), which no capsule can
        hold, so it is refused. Also checks the output shape."""
        g = torch.Generator().manual_seed(0)
        p = next(self.module.parameters(), None)
        dev = p.device if p is not None else torch.device("cpu")
        first = {k: v.to(dev) for k, v in self.example_batch(g).items()}
        other = {k: v.to(dev) for k, v in self.example_batch(g).items()}
        kw = {}
        if self.takes_noise:
            kw["noise"] = torch.randn((1, *self.noise_shape), generator=g).to(dev)
        outs = []
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for batch in (first, other, first):
                try:
                    y = self.module.predict_action_chunk(
                        {k: v.clone() for k, v in batch.items()}, **kw
                    )
                except Exception as e:
                    raise BadRequest(
                        f"{self.policy_id}: predict_action_chunk failed on an example batch "
                        f"({type(e).__name__}: {e}); {self._batch_words(batch)}"
                    ) from e
                outs.append(y)
        want = (1, self.chunk_len, self.action_dim)
        if not isinstance(outs[0], torch.Tensor) or tuple(outs[0].shape) != want:
            got = tuple(outs[0].shape) if isinstance(outs[0], torch.Tensor) else type(outs[0])
            raise BadRequest(f"{self.policy_id}: predict_action_chunk returned {got}, want {want}")
        if not torch.allclose(outs[0], outs[2], rtol=0.0, atol=0.0, equal_nan=True):
            diff = float((outs[0] - outs[2]).abs().nan_to_num(float("inf")).max())
            raise BadRequest(
                f"{self.policy_id}: predict_action_chunk is not a pure function of its inputs "
                f"(a batch, another one, then the first again{' with the same noise' if kw else ''}"
                f": the two calls on the same batch differ by {diff:g}): it draws its own "
                "randomness or keeps state (its own observation history or action queue), which "
                "a capsule cannot hold. Pass randomness in through a `noise` argument and leave "
                "the history and the queue to the runtime (README: an impure "
                "predict_action_chunk)."
            )
        if not torch.isfinite(outs[0]).all():  # pure, but a step on such inputs would fault
            log.warning(
                "%s: predict_action_chunk gave NaN or Inf on an example batch (state in "
                "[-1, 1], images in [0, 1]); a step whose action is not finite is refused "
                "and poisons its session",
                self.policy_id,
            )
