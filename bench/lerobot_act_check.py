"""LeRobot's own ACTPolicy served by the Engine, checked against LeRobot's own loop.

    python3 bench/lerobot_act_check.py [--device cpu|cuda] [--ticks 230] [--out FILE]

Needs the `lerobot` package (not a dependency of flashrt_ros: bench/README.md says how we ran
it). The policy is LeRobot's real ACTPolicy at its default size (ResNet-18 backbone, chunk 100,
n_action_steps 100) with two 480x640 cameras and 14 joints, seeded weights (no download), and
made-up dataset statistics; flashrt_ros serves it as `with_stats(policy, stats)`
(flashrt_ros/policies/lerobot_stats.py) through `load_policy("bench.lerobot_act_check:make")`.

For the same observations, LeRobot's loop (its pre-processor, `select_action` with its action
queue or temporal ensembler, its post-processor) and the Engine's ticks must give the same
actions: across re-inference boundaries, with and without temporal ensembling; on CUDA both
with the eager kernels captured and with the compiled step (the Engine's default there, "_fused"
keys, which say whether the build's check let it be served). Then a capsule:
checkpoint, ticks across an inference, restore, the same ticks again give the same actions.
On CUDA it also times both, per tick kind: LeRobot's loop (eager, as LeRobot runs it) against
the Engine's captured graph. Exit status 1 when an action differs beyond --atol.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashrt_ros import Engine, load_policy  # noqa: E402
from flashrt_ros.policies.lerobot_stats import with_stats  # noqa: E402

CAMS = ("top", "wrist")
H, W, J = 480, 640, 14


def stats() -> dict:
    """Made-up dataset statistics of the shapes LeRobot keeps (images per channel)."""
    g = np.random.default_rng(7)
    return {
        "observation.state": {
            "mean": g.normal(0, 0.3, J).astype(np.float32),
            "std": g.uniform(0.2, 1.0, J).astype(np.float32),
        },
        **{
            f"observation.images.{c}": {
                "mean": np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1),
                "std": np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1),
            }
            for c in CAMS
        },
        "action": {
            "mean": g.normal(0, 0.5, J).astype(np.float32),
            "std": g.uniform(0.1, 0.8, J).astype(np.float32),
        },
    }


def act_policy(ensemble: bool):
    """LeRobot's ACTPolicy at its default size, seeded."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.act.configuration_act import ACTConfig
    from lerobot.policies.act.modeling_act import ACTPolicy

    cfg = ACTConfig(
        input_features={
            "observation.state": PolicyFeature(type=FeatureType.STATE, shape=(J,)),
            **{
                f"observation.images.{c}": PolicyFeature(type=FeatureType.VISUAL, shape=(3, H, W))
                for c in CAMS
            },
        },
        output_features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(J,))},
        pretrained_backbone_weights=None,  # no download; seeded like the rest
        device="cpu",
        **({"temporal_ensemble_coeff": 0.01, "n_action_steps": 1} if ensemble else {}),
    )
    torch.manual_seed(0)
    return ACTPolicy(cfg).eval()


def make(ensemble: bool = False):
    """The factory flashrt_ros loads: LeRobot's ACTPolicy with its statistics around it."""
    return with_stats(act_policy(ensemble), stats())


def observations(n: int, seed: int = 1) -> list[dict]:
    """A slowly moving state and two camera images (a few distinct ones, reused)."""
    g = np.random.default_rng(seed)
    imgs = [{c: g.integers(0, 256, (H, W, 3), dtype=np.uint8) for c in CAMS} for _ in range(3)]
    out = []
    q = g.normal(0, 0.3, J).astype(np.float32)
    for i in range(n):
        q = (q + g.normal(0, 0.02, J)).astype(np.float32)
        out.append(
            {"observation.state": q.copy()}
            | {f"observation.images.{c}": imgs[i % 3][c] for c in CAMS}
        )
    return out


class LeRobotLoop:
    """LeRobot's own way: its processors around select_action, images as LeRobot's env
    preprocessing hands them over (float CHW in [0, 1])."""

    def __init__(self, policy, device: str):
        from lerobot.policies.act.processor_act import make_act_pre_post_processors

        self.policy = policy.to(device)
        self.policy.config.device = device
        self.pre, self.post = make_act_pre_post_processors(policy.config, dataset_stats=stats())
        self.policy.reset()
        self.device = device

    def step(self, obs: dict) -> np.ndarray:
        batch = {}
        for k, v in obs.items():
            t = torch.from_numpy(np.ascontiguousarray(v))
            batch[k] = t.permute(2, 0, 1).float() / 255.0 if t.dtype == torch.uint8 else t
        with torch.no_grad():
            action = self.post(self.policy.select_action(self.pre(batch)))
        return action.reshape(-1).double().cpu().numpy()


def compare(ensemble: bool, device: str, ticks: int, atol: float, fuse: bool | None) -> dict:
    """`fuse`: False captures the eager kernels, None the Engine's default (on CUDA the
    compiled step, checked against the eager one at build)."""
    obs = observations(ticks)
    ours = Engine(
        load_policy("bench.lerobot_act_check:make", ensemble=ensemble),
        device=device,
        capsule_slots=4,
        **({} if fuse is None else {"fuse": fuse}),
    )
    ref = LeRobotLoop(copy.deepcopy(ours.policy.module.policy), device)
    a = np.stack([ours.step(o) for o in obs])
    b = np.stack([ref.step(o) for o in obs])
    diff = np.abs(a - b).max(axis=1)
    bad = np.flatnonzero(diff > atol)
    return {
        "ticks": ticks,
        "max_abs_diff": float(diff.max()),
        "first_over_atol": int(bad[0]) if bad.size else None,
        "action_scale": float(np.abs(b).max()),
        "n_action_steps": ours.policy.n_action,
        "tick_kinds": list(ours.policy.tick_kinds),
        "fused": ours.fuse and not ours.fused_mismatch,
        "fused_mismatch": ours.fused_mismatch,
    }


def capsule(ensemble: bool, device: str, at: int, n: int) -> dict:
    """Checkpoint at `at`, n ticks (across an inference), restore, the same n again (the
    Engine's default: fused on CUDA)."""
    obs = observations(at + n, seed=2)
    eng = Engine(
        load_policy("bench.lerobot_act_check:make", ensemble=ensemble),
        device=device,
        capsule_slots=4,
    )
    for o in obs[:at]:
        eng.step(o)
    cap = eng.checkpoint()
    first = np.stack([eng.step(o) for o in obs[at:]])
    eng.restore(cap.id)
    again = np.stack([eng.step(o) for o in obs[at:]])
    return {"at": at, "ticks": n, "identical": bool(np.array_equal(first, again))}


def timing(device: str, ticks: int) -> dict:
    """Per tick kind, p50/p99 us: LeRobot's loop (eager, as LeRobot runs it) and the Engine's
    graph, unfused (eager kernels captured) and fused (inductor's step captured)."""
    obs = observations(ticks)
    out: dict[str, dict] = {}
    runs = [("lerobot", None), ("flashrt_graph", False), ("flashrt_graph_fused", True)]
    for who, fuse in runs:
        try:
            eng = Engine(
                load_policy("bench.lerobot_act_check:make"),
                device=device,
                **({} if fuse is None else {"fuse": fuse}),
            )
            if fuse is None:
                step = LeRobotLoop(copy.deepcopy(eng.policy.module.policy), device).step
            else:
                step = eng.step
            t: dict[str, list[float]] = {}
            for i, o in enumerate(obs):
                kind = eng.policy.tick_kinds[eng.policy.tick_kind(i)]
                t0 = time.perf_counter()
                step(o)
                if device == "cuda":
                    torch.cuda.synchronize()
                t.setdefault(kind, []).append((time.perf_counter() - t0) * 1e6)
            out[who] = {
                k: {
                    "n": len(v[1:]),
                    "p50_us": round(float(np.percentile(v[1:], 50)), 1),
                    "p99_us": round(float(np.percentile(v[1:], 99)), 1),
                }
                for k, v in t.items()
            }
            if fuse is not None:
                out[who]["fused"] = eng.fuse and not eng.fused_mismatch
        except Exception as e:  # noqa: BLE001 - reported in the results
            out[who] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(who, out[who], flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ticks", type=int, default=230, help="ticks compared (2+ inferences)")
    ap.add_argument("--atol", type=float, default=1e-4)
    ap.add_argument("--timing-ticks", type=int, default=1000, help="CUDA timing (0: skip)")
    ap.add_argument(
        "--hide",
        default="transformers",
        help="comma-separated modules to hide from LeRobot ('' = none): LeRobot 0.4.4's "
        "package imports its GR00T policy, which fails beside transformers 5 (the GPU "
        "machine's); ACT does not use transformers",
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    for name in filter(None, a.hide.split(",")):
        sys.modules[name] = None  # find_spec() says absent, import raises ImportError
    try:
        import lerobot
    except ImportError:
        print("lerobot_act_check: needs the lerobot package (pip install lerobot)", file=sys.stderr)
        return 2
    r: dict = {"lerobot": getattr(lerobot, "__version__", "?"), "torch": torch.__version__}
    r["hidden_modules"] = a.hide
    r["device"] = a.device
    checks = []
    for fuse, tag in [(False, "")] + ([(None, "_fused")] if a.device == "cuda" else []):
        for name, ensemble, ticks in (("queue", False, a.ticks), ("ensemble", True, 25)):
            key = name + tag
            r[key] = compare(ensemble, a.device, min(a.ticks, ticks), a.atol, fuse)
            checks.append(key)
            print(key, r[key], flush=True)
    r["capsule_queue"] = capsule(False, a.device, at=60, n=80)
    r["capsule_ensemble"] = capsule(True, a.device, at=5, n=8)
    print("capsules", r["capsule_queue"], r["capsule_ensemble"], flush=True)
    if a.device == "cuda" and a.timing_ticks:
        r["timing"] = timing(a.device, a.timing_ticks)
        print("timing", r["timing"], flush=True)
    if a.out:
        a.out.write_text(json.dumps(r, indent=1))
    ok = all(r[k]["first_over_atol"] is None for k in checks) and all(
        r[k]["identical"] for k in ("capsule_queue", "capsule_ensemble")
    )
    print("OK" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
