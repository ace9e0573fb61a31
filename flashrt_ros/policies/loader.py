"""load_policy: turn a policy spec string into a Policy."""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import torch

from flashrt_ros.policies.base import Policy
from flashrt_ros.policies.hybrid import HybridConfig, HybridPolicy

log = logging.getLogger(__name__)

WEIGHTS_DIR = Path(__file__).parent / "weights"
BUILTIN_WEIGHTS = WEIGHTS_DIR / "hybrid.pt"


def load_hybrid_weights(policy: HybridPolicy, path: str | Path) -> None:
    """Load a weights file written by tools/train_hybrid.py (config + state_dict)."""
    path = Path(path)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        sd = blob["state_dict"]
    except FileNotFoundError:
        raise ValueError(f"weights file not found: {path}") from None
    except Exception as e:
        raise ValueError(f"{path}: not a flashrt hybrid weights file ({e})") from e
    try:
        policy.load_state_dict(sd)
    except RuntimeError as e:
        raise ValueError(f"{path}: weights do not fit {policy.policy_id}: {e}") from e


def load_policy(spec: str = "builtin:hybrid", weights: str | None = None, **overrides) -> Policy:
    """Build a policy from a spec.

    - "builtin:hybrid": the shipped hybrid policy with its trained weights; keyword overrides of
      HybridConfig (e.g. kv_len=2048, d_model=256) make variants. Weight shapes do not depend on
      kv_len, so a longer ring keeps the trained weights; other changes start from seeded init.
    - "package.module:factory": calls factory(**overrides) and checks it returns a Policy.
    - a path to a .pt2 file saved with torch.export: served through ExportedPolicy.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError("policy spec must be a non-empty string")
    if spec == "builtin:hybrid":
        try:
            cfg = HybridConfig(**overrides)
        except TypeError as e:
            raise ValueError(f"builtin:hybrid: bad override ({e})") from e
        torch.manual_seed(0)
        policy = HybridPolicy(cfg)
        shapes_fixed = {k: v for k, v in overrides.items() if k not in ("kv_len", "noise_std")}
        path = Path(weights) if weights else BUILTIN_WEIGHTS
        if weights or (not shapes_fixed and BUILTIN_WEIGHTS.exists()):
            load_hybrid_weights(policy, path)
        elif not shapes_fixed:
            log.warning("no trained weights at %s: builtin:hybrid runs with seeded init", path)
        return policy.eval()
    if spec.startswith("builtin:"):
        raise ValueError(f"unknown builtin policy {spec!r} (known: builtin:hybrid)")
    if spec.endswith(".pt2") or Path(spec).is_file():
        from flashrt_ros.policies.exported import ExportedPolicy

        if not Path(spec).is_file():
            raise ValueError(f"policy file not found: {spec}")
        return ExportedPolicy(spec).eval()
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load policy factory {spec!r}: {e}") from e
        try:
            policy = factory(**overrides)
        except Exception as e:
            raise ValueError(f"policy factory {spec!r} failed: {e}") from e
        if not isinstance(policy, Policy):
            raise ValueError(f"{spec!r} returned {type(policy).__name__}, not a flashrt Policy")
        return policy.eval()
    raise ValueError(
        f"policy spec {spec!r} is neither 'builtin:hybrid', 'package.module:factory' "
        "nor a path to a .pt2 file"
    )
