#!/usr/bin/env python3
"""Train builtin:act (size "sim") to reach goals it sees in the sim camera, by imitating the
ArmModel expert (behaviour cloning of expert action chunks + DAgger).

    python tools/train_act.py [--out flashrt_ros/policies/weights/act.pt] [--steps 1000]

Data, generated on the fly: ``--arms`` simulated arms (the batched ArmModel of train_hybrid.py)
run episodes toward random goals; each optimizer step advances every arm by one step and trains
on ``--batch`` of them. An arm's input is what the runtime will give the policy: the joint state
(6 positions, 6 velocities) and the 64x64 rgb8 image of flashrt_ros.sim.camera (arm + ghost goal)
scaled to [0, 1]; the goal itself is never an input, it must be read from the image. The label
is the expert's chunk: the ``chunk_size`` targets ``expert_action`` gives when it drives the arm
from this state (deterministic, so it is the chunk an ideal policy would predict).
Episodes start near (log-uniform 0.01-3 rad) or far from their goal, half of them moving; arms
restart (p = 1/300 per step) and switch goals (p = 1/400) at random times.

DAgger: after 15% of training a growing share of the arms (up to ``--policy-frac`` at 50%) is
driven by the policy: each time such an arm is in a training batch its predicted chunk becomes
its plan, executed open loop until the next one (the expert drives when no plan is left).

Half of each batch is drawn i.i.d. instead (state, velocity and goal independent): along
trajectories the motion gives the goal direction away, and a model that copies it never learns
to read the image.

Loss: L1 between predicted and expert chunks, relative to the current joint positions and
divided by the per-step spread of the expert's chunks (the module's ``action_std`` buffer), plus
the module's goal read-back: L1 of its keypoints against the ghost chain's joint pixels
(``ArmCamera.joints_xy``) and wrapped L1 of the read-back joint angles against the goal.
Curriculum: for the first ``--teacher-frac`` of training a decreasing share of the rows (1 -> 0)
feeds the decoder the true goal (plus 0.03 rad noise) instead of the read-back, so the control
law is learned while the keypoints are still poor; the read-back is trained throughout.
Adam, cosine learning rate, gradient clip 1.0. Then a closed-loop check on held-out goals: the
model drives the arm from rendered images + joint state with LeRobot-style temporal ensembling
(coefficient 0.01, every step), compared with the expert and with doing nothing.
Writes ``{"config", "state_dict", "meta"}`` (torch.load(weights_only=True)).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from train_hybrid import (  # noqa: E402
    GOAL_MARGIN,
    HI,
    LO,
    BatchArm,
    N,
    batch_expert,
    check_args,
    new_episode,
    run_meta,
    write_weights,
)

from flashrt_ros.policies.act import ACT_WEIGHTS, ACTConfig, ACTPolicy  # noqa: E402
from flashrt_ros.policies.visuomotor_common import count_parameters  # noqa: E402
from flashrt_ros.sim.camera import ArmCamera  # noqa: E402


def expert_chunks(q: np.ndarray, dq: np.ndarray, goal: np.ndarray, c: int) -> np.ndarray:
    """(B, c, N) targets the expert gives over c steps when it drives the arm from (q, dq)."""
    arm = BatchArm(q, dq)
    out = np.empty((q.shape[0], c, q.shape[1]))
    for k in range(c):
        out[:, k] = batch_expert(arm.q, arm.dq, goal)
        arm.step(out[:, k])
    return out


def make_batch(cam: ArmCamera, q, dq, goal) -> dict[str, torch.Tensor]:
    """The batch the runtime adapter passes: state (B, 12) and the image in [0, 1]."""
    img = cam.render_batch(q, goal)
    return {
        "observation.state": torch.tensor(np.concatenate([q, dq], 1), dtype=torch.float32),
        "observation.images.top": torch.from_numpy(img).permute(0, 3, 1, 2).float() / 255.0,
    }


class Arms:
    """P arms in episodes toward random goals, each with an optional plan (a chunk) to follow."""

    def __init__(self, rng: np.random.Generator, p: int, chunk: int, near_frac: float):
        self.rng, self.p, self.c, self.near_frac = rng, p, chunk, near_frac
        q0, dq0, g0, _, _ = new_episode(rng, p, 10**9, near_frac)
        self.arm = BatchArm(q0, dq0)
        self.goal = g0
        self.plan = np.zeros((p, chunk, N))
        self.plan_age = np.full(p, chunk)  # >= chunk: no plan left
        self.driven = np.zeros(p, dtype=bool)

    def step(self, dagger_frac: float) -> None:
        lab = batch_expert(self.arm.q, self.arm.dq, self.goal)
        k = np.minimum(self.plan_age, self.c - 1)
        plan = self.plan[np.arange(self.p), k]
        use_plan = self.driven & (self.plan_age < self.c)
        self.arm.step(np.where(use_plan[:, None], plan, lab))
        self.plan_age += 1
        restart = self.rng.random(self.p) < 1 / 300
        if restart.any():
            q0, dq0, g0, _, _ = new_episode(self.rng, int(restart.sum()), 10**9, self.near_frac)
            self.arm.q[restart], self.arm.dq[restart], self.goal[restart] = q0, dq0, g0
            self.plan_age[restart] = self.c
            self.driven[restart] = self.rng.random(int(restart.sum())) < dagger_frac
        switch = self.rng.random(self.p) < 1 / 400
        if switch.any():
            n = int(switch.sum())
            self.goal[switch] = self.rng.uniform(LO + GOAL_MARGIN, HI - GOAL_MARGIN, (n, N))


def iid_states(rng: np.random.Generator, b: int, near_frac: float):
    """(q, dq, goal) drawn independently: the velocity says nothing about where the goal is, so
    the goal must be read from the image (trajectory states alone let a model copy the motion)."""
    goal = rng.uniform(LO + GOAL_MARGIN, HI - GOAL_MARGIN, (b, N))
    scale = np.exp(rng.uniform(np.log(0.01), np.log(3.0), (b, 1)))
    near = goal + rng.uniform(-1, 1, (b, N)) * scale
    far = rng.uniform(LO, HI, (b, N))
    q = np.clip(np.where((rng.random(b) < near_frac)[:, None], near, far), LO, HI)
    dq = rng.uniform(-1.5, 1.5, (b, N)) * (rng.random((b, 1)) < 0.7)
    return q, dq, goal


def statistics(rng: np.random.Generator, chunk: int, b: int = 256, t: int = 300):
    """state mean/std and the per-step spread of expert chunks (relative to q) along rollouts."""
    q0, dq0, g0, change, g1 = new_episode(rng, b, t)
    arm = BatchArm(q0, dq0)
    obs, rel = [], []
    for i in range(t):
        g = np.where((i >= change)[:, None], g1, g0)
        if i % 10 == 0:
            obs.append(np.concatenate([arm.q, arm.dq], 1))
            rel.append(expert_chunks(arm.q, arm.dq, g, chunk) - arm.q[:, None])
        arm.step(batch_expert(arm.q, arm.dq, g))
    o, r = np.concatenate(obs), np.concatenate(rel)
    spread = np.sqrt((r**2).mean((0, 2)))  # (chunk,), the same for every joint
    return o.mean(0), np.maximum(o.std(0), 1e-3), spread


@torch.no_grad()
def closed_loop(policy: ACTPolicy, seed: int, b: int = 32, t: int = 500, mode: str = "ensemble"):
    """Final goal error (L2 over joints) of the policy, the expert and doing nothing, from rest
    at random starts toward held-out random goals. ``mode``: "ensemble" (LeRobot temporal
    ensembling, coefficient from the config, every step) or "first" (first action of each
    chunk)."""
    cfg = policy.config
    rng = np.random.default_rng(seed)
    q0 = rng.uniform(LO + GOAL_MARGIN, HI - GOAL_MARGIN, (b, N))
    goal = rng.uniform(LO + GOAL_MARGIN, HI - GOAL_MARGIN, (b, N))
    cam = ArmCamera(*cfg.image_hw)
    arm = BatchArm(q0, np.zeros((b, N)))
    coeff = cfg.temporal_ensemble_coeff or 0.0
    chunks: list[np.ndarray] = []  # the last chunk_size chunks, newest last
    for _ in range(t):
        chunk = policy.predict_action_chunk(make_batch(cam, arm.q, arm.dq, goal)).double().numpy()
        if mode == "first":
            act = chunk[:, 0]
        else:
            chunks = (chunks + [chunk])[-cfg.chunk_size :]
            n = len(chunks)
            preds = np.stack([chunks[j][:, n - 1 - j] for j in range(n)])  # oldest first
            w = np.exp(-coeff * np.arange(n))[:, None, None]
            act = (preds * w).sum(0) / w.sum()
        arm.step(act)
    pol = np.linalg.norm(goal - arm.q, axis=1)
    ex = BatchArm(q0, np.zeros((b, N)))
    for _ in range(t):
        ex.step(batch_expert(ex.q, ex.dq, goal))
    return {
        "policy": pol,
        "expert": np.linalg.norm(goal - ex.q, axis=1),
        "nothing": np.linalg.norm(goal - q0, axis=1),
    }


def train(args) -> tuple[ACTPolicy, dict]:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    policy = ACTPolicy(ACTConfig())  # the "sim" size, seeded init
    c = policy.config
    mean, std, spread = statistics(np.random.default_rng(args.seed + 1), c.chunk_size)
    policy.state_mean.copy_(torch.tensor(mean, dtype=torch.float32))
    policy.state_std.copy_(torch.tensor(std, dtype=torch.float32))
    policy.action_std.copy_(torch.tensor(spread, dtype=torch.float32)[:, None].expand(-1, N))
    policy.train()
    cam = ArmCamera(*c.image_hw)
    arms = Arms(rng, args.arms, c.chunk_size, args.near_frac)
    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            min(1.0, (i + 1) / 50)
            * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * min(i, args.steps) / args.steps)))
        ),
    )
    scale = policy.action_std
    hist, t0 = [], time.time()
    for it in range(args.steps):
        frac = args.policy_frac * min(1.0, max(0.0, (it / args.steps - 0.15) / 0.35))
        arms.step(frac)
        n_pool = args.batch - int(args.batch * args.iid_frac)
        idx = rng.choice(args.arms, n_pool, replace=False)
        iq, idq, ig = iid_states(rng, args.batch - n_pool, args.near_frac)
        q = np.concatenate([arms.arm.q[idx], iq])
        dq = np.concatenate([arms.arm.dq[idx], idq])
        g = np.concatenate([arms.goal[idx], ig])
        target = torch.tensor(expert_chunks(q, dq, g, c.chunk_size), dtype=torch.float32)
        batch = make_batch(cam, q, dq, g)
        # the goal read back from the image: keypoints supervised with the ghost's joints
        kp, goal_hat = policy.read_goal(batch)
        kp_true = torch.tensor(cam.joints_xy(g), dtype=torch.float32)
        kp_loss = (kp - kp_true).abs().mean()  # pixels
        g_t = torch.tensor(g, dtype=torch.float32)
        err = goal_hat - g_t
        goal_loss = torch.atan2(err.sin(), err.cos()).abs().mean()  # rad per joint
        # curriculum: early on the decoder is often given the true goal (slightly noised)
        p_tf = max(0.0, 1.0 - it / max(1.0, args.teacher_frac * args.steps))
        tf = torch.tensor(rng.random(args.batch) < p_tf)[:, None]
        noisy = g_t + torch.tensor(rng.normal(0.0, 0.03, g.shape), dtype=torch.float32)
        mem, pos = policy.encode(batch, goal=torch.where(tf, noisy, goal_hat))
        pred = policy.decode(mem, pos, batch["observation.state"])
        loss = (
            ((pred - target) / scale).abs().mean()
            + args.kp_weight * kp_loss
            + args.aux_weight * goal_loss
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        sched.step()
        drive = arms.driven[idx]
        arms.plan[idx[drive]] = pred.detach().double().numpy()[:n_pool][drive]
        arms.plan_age[idx[drive]] = 0
        with torch.no_grad():
            rmse0 = ((pred[:, 0] - target[:, 0]) ** 2).mean().sqrt().item()
        hist.append((loss.item(), rmse0, goal_loss.item(), kp_loss.item()))
        if (it + 1) % args.log_every == 0 or it + 1 == args.steps:
            h = np.mean(hist[-args.log_every :], 0)
            print(
                f"step {it + 1:5d}/{args.steps}  loss {h[0]:.4f}  first-action rmse "
                f"{h[1] * 1000:.1f} mrad  goal read-back {h[2]:.3f} rad ({h[3]:.2f} px)  "
                f"teacher {p_tf:.2f}  dagger {frac:.2f}  "
                f"lr {sched.get_last_lr()[0]:.1e}  {time.time() - t0:.0f}s",
                flush=True,
            )
    train_s = time.time() - t0
    policy.eval()
    t1 = time.time()
    ev = closed_loop(policy, seed=10_000 + args.seed, b=args.eval_arms, t=args.eval_steps)
    ev_first = closed_loop(
        policy, seed=10_000 + args.seed, b=args.eval_arms, t=args.eval_steps, mode="first"
    )
    final = np.mean(hist[-args.log_every :], 0)
    summary = {
        "train_seconds": round(train_s, 1),
        "samples": int(args.steps * args.batch),
        "parameters": count_parameters(policy),
        "final_loss": float(final[0]),
        "final_first_action_rmse_rad": float(final[1]),
        "final_goal_readback_error_rad": float(final[2]),
        "final_keypoint_error_px": float(final[3]),
        "eval_goals": int(args.eval_arms),
        "eval_steps": int(args.eval_steps),
        **{f"eval_{k}_median_error_rad": float(np.median(v)) for k, v in ev.items()},
        **{f"eval_{k}_mean_error_rad": float(np.mean(v)) for k, v in ev.items()},
        "eval_policy_frac_reduced_80pct": float(np.mean(ev["policy"] < 0.2 * ev["nothing"])),
        "eval_first_action_policy_median_error_rad": float(np.median(ev_first["policy"])),
        "eval_first_action_policy_mean_error_rad": float(np.mean(ev_first["policy"])),
    }
    print(
        f"closed loop ({args.eval_arms} held-out goals, {args.eval_steps} steps, temporal "
        f"ensembling, {time.time() - t1:.0f}s): final error median / mean rad: policy "
        f"{np.median(ev['policy']):.3f} / {np.mean(ev['policy']):.3f}, expert "
        f"{np.median(ev['expert']):.3f} / {np.mean(ev['expert']):.3f}, nothing "
        f"{np.median(ev['nothing']):.3f} / {np.mean(ev['nothing']):.3f}; reduced >= 80%: "
        f"{summary['eval_policy_frac_reduced_80pct']:.2f}; first action of each chunk: "
        f"policy {np.median(ev_first['policy']):.3f} / {np.mean(ev_first['policy']):.3f}",
        flush=True,
    )
    return policy, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Train builtin:act (size sim) on the sim camera.")
    p.add_argument("--out", default=str(ACT_WEIGHTS), help="weights file (%(default)s)")
    p.add_argument(
        "--force", action="store_true", help="replace --out when it exists (the shipped weights)"
    )
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (%(default)s)")
    p.add_argument("--batch", type=int, default=128, help="rows per step (%(default)s)")
    p.add_argument("--arms", type=int, default=512, help="simulated arms (%(default)s)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak Adam lr (%(default)s)")
    p.add_argument("--policy-frac", type=float, default=0.3, help="final DAgger share")
    p.add_argument("--iid-frac", type=float, default=0.5, help="batch share of i.i.d. states")
    p.add_argument("--aux-weight", type=float, default=1.0, help="goal read-back loss weight")
    p.add_argument("--kp-weight", type=float, default=1.0, help="keypoint loss weight (px)")
    p.add_argument(
        "--teacher-frac", type=float, default=0.3, help="true-goal curriculum length (share)"
    )
    p.add_argument("--near-frac", type=float, default=0.6, help="episodes starting near goal")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-arms", type=int, default=32)
    p.add_argument("--eval-steps", type=int, default=1000)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    counts = ("steps", "batch", "arms", "threads", "eval_arms", "eval_steps", "log_every")
    check_args(p, args, counts)
    policy, summary = train(args)
    meta = run_meta(
        "tools/train_act.py",
        "behaviour cloning of expert chunks from sim camera images + state, DAgger",
        args,
    )
    write_weights(Path(args.out), policy, policy.config.to_dict(), {**meta, **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
