"""load_policy: turn a policy spec string into a Policy."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import math
import os
import traceback
from pathlib import Path

import torch

from flashrt_ros.errors import BadRequest
from flashrt_ros.policies.base import Policy
from flashrt_ros.policies.hybrid import HybridConfig, HybridPolicy
from flashrt_ros.policies.visuomotor_common import WEIGHTS_DIR, load_weights

log = logging.getLogger(__name__)

BUILTIN_WEIGHTS = WEIGHTS_DIR / "hybrid.pt"

# builtin:hybrid config fields its weights do not depend on (weight shapes and training alike)
HYBRID_RUNTIME_ONLY = ("kv_len", "noise_std")


def _hybrid_config(overrides: dict) -> HybridConfig:
    """HybridConfig from keyword overrides, each checked (an int field takes a positive int, a
    float field a finite number >= 0), so a bad override is a BadRequest, not a TypeError deep in
    module construction."""
    fields = {f.name: f for f in dataclasses.fields(HybridConfig)}
    for k, v in overrides.items():
        if k not in fields:
            raise BadRequest(f"builtin:hybrid: unknown override {k!r} (known: {', '.join(fields)})")
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise BadRequest(f"builtin:hybrid: {k} must be a number, got {v!r}")
        if isinstance(getattr(HybridConfig, k), int):
            if not isinstance(v, int) or v < 1:
                raise BadRequest(f"builtin:hybrid: {k} must be an integer >= 1, got {v!r}")
        elif not math.isfinite(v) or v < 0:
            raise BadRequest(f"builtin:hybrid: {k} must be finite and >= 0, got {v!r}")
    cfg = HybridConfig(**overrides)
    if cfg.d_model % cfg.n_heads:
        raise BadRequest(
            f"builtin:hybrid: d_model={cfg.d_model} must be a multiple of n_heads={cfg.n_heads}"
        )
    return cfg


def _chunked_builtin(spec: str, weights, overrides: dict) -> Policy:
    """builtin:act / builtin:diffusion: the LeRobot-shaped module served by ChunkedPolicy.
    Overrides go to the factory (size="sim" | "lerobot", cameras, image_hw, n_action_steps,
    num_inference_steps, ...). These modules are pure by construction, so the load-time
    purity probe (two forward passes) is skipped."""
    from flashrt_ros.policies.chunked import ChunkedPolicy

    if spec == "builtin:act":
        from flashrt_ros.policies.act import make_act as factory
    else:
        from flashrt_ros.policies.diffusion import make_diffusion as factory
    kw = dict(overrides)
    if weights:
        kw["weights"] = weights
    try:
        module = factory(**kw)
    except (ValueError, TypeError) as e:
        raise BadRequest(f"{spec}: {e}") from e
    except Exception as e:  # an override no check foresaw (a size of 0 ...): still the caller's
        raise BadRequest(
            f"{spec}: these overrides do not make a policy ({type(e).__name__}: {e})"
        ) from e
    size = kw.get("size", "sim")
    policy = ChunkedPolicy(module, policy_id=f"{spec}/{size}", check_pure=False)
    # pure by construction, and the Engine's probe would run whole denoising loops eagerly at
    # every build (two eager lerobot-100 inferences: 2 x 0.83 s on the H200, latest.md)
    policy.probe_purity = False
    return policy.eval()


def load_policy(spec: str = "builtin:hybrid", weights: str | None = None, **overrides) -> Policy:
    """Build a policy from a spec.

    - "builtin:hybrid": the shipped hybrid policy with its trained weights; keyword overrides of
      HybridConfig (e.g. kv_len=2048, d_model=256) make variants. Weight shapes do not depend on
      kv_len, so a longer ring keeps the trained weights; other changes start from seeded init.
    - "builtin:act", "builtin:diffusion": LeRobot-shaped visuomotor policies (policies/act.py,
      policies/diffusion.py) served through ChunkedPolicy; overrides go to their factories.
    - "package.module:factory": calls factory(**overrides); it returns a Policy, or a
      LeRobot-shaped module (.config and a pure .predict_action_chunk), which is wrapped in
      ChunkedPolicy after a purity probe (two calls on the same inputs must agree).
    - a path to a .pt2 file saved with torch.export: served through ExportedPolicy.

    `weights` goes to a factory as `weights=` when it takes that argument (or **kwargs), and is
    refused by one that does not and by a .pt2 file: a weights file is never silently unused.
    """
    if not isinstance(spec, str) or not spec:
        raise BadRequest(f"policy spec must be a non-empty string, got {spec!r}")
    if weights is not None and not isinstance(weights, str | Path):
        raise BadRequest(f"weights must be a path or None, got {weights!r}")
    if weights:  # "~/w.pt" as a shell would read it (a params file does not expand it)
        weights = os.path.expanduser(weights)
    if spec.startswith("~"):  # a program's path
        spec = os.path.expanduser(spec)
    if spec == "builtin:hybrid":
        cfg = _hybrid_config(overrides)
        torch.manual_seed(0)
        try:
            policy = HybridPolicy(cfg)
        except Exception as e:  # e.g. d_model not divisible by n_heads
            raise BadRequest(f"builtin:hybrid: overrides do not make a policy ({e})") from e
        shapes_fixed = {k: v for k, v in overrides.items() if k not in HYBRID_RUNTIME_ONLY}
        path = Path(weights) if weights else BUILTIN_WEIGHTS
        if weights or (not shapes_fixed and BUILTIN_WEIGHTS.exists()):
            # written by tools/train_hybrid.py; its config must be this one's, but for the
            # fields the weights do not depend on
            mine = dataclasses.asdict(cfg)
            load_weights(policy, path, policy.policy_id, mine, HYBRID_RUNTIME_ONLY)
        elif not shapes_fixed:
            log.warning("no trained weights at %s: builtin:hybrid runs with seeded init", path)
        return policy.eval()
    if spec in ("builtin:act", "builtin:diffusion"):
        return _chunked_builtin(spec, weights, overrides)
    if spec.startswith("builtin:"):
        raise BadRequest(
            f"unknown builtin policy {spec!r} (known: builtin:hybrid, builtin:act, "
            "builtin:diffusion)"
        )
    if spec.endswith(".pt2") or Path(spec).is_file():
        from flashrt_ros.policies.exported import ExportedPolicy

        if not Path(spec).is_file():
            raise BadRequest(f"policy file not found: {spec}")
        if weights:
            raise BadRequest(
                f"{spec}: an exported program carries its own weights; weights={str(weights)!r} "
                "would be ignored (export the policy with the weights you want)"
            )
        try:
            return ExportedPolicy(spec).eval()
        except BadRequest:
            raise
        except ValueError as e:  # its checks say what is wrong with the program: keep that
            raise BadRequest(str(e)) from e
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(mod_name)
        except ImportError as e:
            raise BadRequest(f"cannot load policy factory {spec!r}: {e}") from e
        except Exception as e:  # the module's own code failed as it was imported
            raise BadRequest(
                f"cannot load policy factory {spec!r}: importing {mod_name!r} raised "
                f"{_what_where(e)}"
            ) from e
        try:
            factory = getattr(module, attr)
        except AttributeError as e:
            raise BadRequest(f"cannot load policy factory {spec!r}: {e}") from e
        kw = _with_weights(factory, spec, weights, overrides)
        try:
            policy = factory(**kw)
        except Exception as e:
            raise BadRequest(f"policy factory {spec!r} failed: {_what_where(e)}") from e
        if (
            not isinstance(policy, Policy)
            and isinstance(policy, torch.nn.Module)
            and callable(getattr(policy, "predict_action_chunk", None))
        ):
            from flashrt_ros.policies.chunked import ChunkedPolicy

            policy = ChunkedPolicy(policy, policy_id=spec)
        if not isinstance(policy, Policy):
            raise BadRequest(
                f"{spec!r} returned {type(policy).__name__}, neither a flashrt Policy nor a "
                "LeRobot-shaped torch module (.config, .predict_action_chunk)"
            )
        return policy.eval()
    raise BadRequest(
        f"policy spec {spec!r} is neither 'builtin:hybrid', 'package.module:factory' "
        "nor a path to a .pt2 file"
    )


def _with_weights(factory, spec: str, weights, overrides: dict) -> dict:
    """The factory's keyword arguments: a weights file goes to it as `weights=` when it takes
    one, and is refused otherwise, rather than served with the factory's own weights unseen."""
    if not weights:
        return overrides
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: nothing says what it takes
        params = ()
    if not any(p.name == "weights" or p.kind is p.VAR_KEYWORD for p in params):
        raise BadRequest(
            f"policy factory {spec!r} takes no `weights` argument, so weights={str(weights)!r} "
            "would be ignored; give the factory a `weights` parameter or load them inside it"
        )
    return {**overrides, "weights": str(weights)}


def _what_where(e: BaseException) -> str:
    """An exception from a user's code as one line a log can carry: its type, its text and
    where it was raised (the node logs no traceback for a failed configure)."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{where}"
