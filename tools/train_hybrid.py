#!/usr/bin/env python3
"""Train the built-in hybrid policy by imitating the ArmModel expert (behaviour cloning + DAgger).

    python tools/train_hybrid.py [--out flashrt_ros/policies/weights/hybrid.pt]
                                 [--steps 500] [--seed 0]

Data: B parallel episodes of the simulated arm (the ArmModel dynamics, batched in numpy and
checked against ArmModel at start-up) from random start positions and velocities toward random
goals; 80% of the rows start at a log-uniform distance (0.01-3 rad per joint) from their goal,
the rest anywhere; 40% of the rows switch to a new random goal at a random step mid-episode.
Every visited state is labelled with ``expert_action`` (the expert the policy imitates).

DAgger: early on every row is driven by the expert; then a growing fraction of rows (up to
``--policy-frac``) is driven by the policy's own (detached) action, so the policy also sees, and is
labelled on, the states it visits itself.

Loss (truncated BPTT over windows of ``--window`` steps, state carried across windows): the action
chunk ``new_chunk[:, k]`` predicted at step t vs the expert's target at step t+k along the recorded
trajectory (entries past the window end or across a goal change are masked), plus the returned
(temporally ensembled) action vs the expert's target at t. Errors are measured in units of the
policy's ``delta_scale`` (0.05 rad), smooth-L1 (beta 0.01, close to L1). Adam with cosine
learning-rate decay.

Writes ``{"config", "state_dict", "meta"}`` (loadable with torch.load(weights_only=True)).
One optimizer step = one window of B x window steps; the default run (500 steps) takes about
4 minutes on 2 idle CPU cores (on a loaded machine ``--threads 1`` can be faster). Results are
deterministic for a seed (checked: torch 2.11 and 2.13 on different CPUs gave the same numbers).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashrt_ros.policies.hybrid import HybridConfig, HybridPolicy  # noqa: E402
from flashrt_ros.sim.dynamics import (  # noqa: E402
    DEFAULT_LOWER,
    DEFAULT_UPPER,
    ArmModel,
    expert_action,
)

DEFAULT_OUT = ROOT / "flashrt_ros" / "policies" / "weights" / "hybrid.pt"
N = 6
LO, HI = DEFAULT_LOWER, DEFAULT_UPPER
GOAL_MARGIN = 0.2


# -- batched arm (same equations as ArmModel with its defaults) -----------------------------------
class BatchArm:
    def __init__(self, q: np.ndarray, dq: np.ndarray):
        ref = ArmModel()
        self.dt, self.k, self.d = ref.dt, ref.stiffness, ref.damping
        self.max_vel, self.max_acc = ref.max_vel, ref.max_acc
        self.q, self.dq = q.astype(np.float64).copy(), dq.astype(np.float64).copy()

    def obs(self) -> np.ndarray:
        return np.concatenate([self.q, self.dq], 1)

    def step(self, target: np.ndarray) -> None:
        tgt = np.clip(target, LO, HI)
        acc = np.clip(self.k * (tgt - self.q) - self.d * self.dq, -self.max_acc, self.max_acc)
        dq = np.clip(self.dq + acc * self.dt, -self.max_vel, self.max_vel)
        q = self.q + dq * self.dt
        below, above = q <= LO, q >= HI
        q = np.clip(q, LO, HI)
        self.dq = np.where((below & (dq < 0)) | (above & (dq > 0)), 0.0, dq)
        self.q = q


def batch_expert(q: np.ndarray, dq: np.ndarray, goal: np.ndarray) -> np.ndarray:
    """expert_action for every row (same formula and defaults)."""
    from flashrt_ros.sim.dynamics import EXPERT_DAMPING, EXPERT_GAIN

    step = np.clip(EXPERT_GAIN * (goal - q) - EXPERT_DAMPING * dq, -0.05, 0.05)
    return np.clip(q + step, LO, HI)


def self_check(rng: np.random.Generator) -> None:
    """The batched arm and expert agree with ArmModel / expert_action."""
    arms = [ArmModel() for _ in range(4)]
    q0 = rng.uniform(LO, HI, (4, N))
    for a, q in zip(arms, q0, strict=True):
        a.reset(q)
    ba = BatchArm(q0, np.zeros((4, N)))
    goal = rng.uniform(LO + GOAL_MARGIN, HI - GOAL_MARGIN, (4, N))
    for _ in range(300):
        tb = batch_expert(ba.q, ba.dq, goal)
        for i, a in enumerate(arms):
            t = a.expert_action(goal[i])
            assert np.allclose(t, expert_action(a.q, a.dq, goal[i]))
            assert np.allclose(t, tb[i], atol=1e-12), "batched expert disagrees with ArmModel"
            a.step(t)
        ba.step(tb)
    assert np.allclose(np.stack([a.q for a in arms]), ba.q, atol=1e-9)
    assert np.allclose(np.stack([a.dq for a in arms]), ba.dq, atol=1e-9)


# -- episodes --------------------------------------------------------------------------------------
def random_goals(rng, b):
    return rng.uniform(LO + GOAL_MARGIN, HI - GOAL_MARGIN, (b, N))


def new_episode(rng, b, T, near_frac=0.8):
    """Start states, goals, per-row goal-change step (T = none) and second goal.

    A fraction of the rows starts at a log-uniform distance (0.01 .. 3 rad per joint) from its
    goal, so the approach and the hold near the goal (where precision matters) are well covered.
    """
    g0 = random_goals(rng, b)
    far = rng.uniform(LO, HI, (b, N))
    scale = np.exp(rng.uniform(np.log(0.01), np.log(3.0), (b, 1)))
    near = np.clip(g0 + rng.uniform(-1, 1, (b, N)) * scale, LO, HI)
    q0 = np.where((rng.random(b) < near_frac)[:, None], near, far)
    moving = rng.random(b) < 0.5
    dq0 = np.where(moving[:, None], rng.uniform(-0.6, 0.6, (b, N)), 0.0)
    change = np.where(rng.random(b) < 0.4, rng.integers(T // 5, T, b), T)
    g1 = random_goals(rng, b)
    return q0, dq0, g0, change, g1


def fresh_state(policy: HybridPolicy, b: int, seed: int) -> dict:
    st = {}
    for e in policy.state_spec():
        st[e.name] = torch.zeros((b,) + tuple(e.shape[1:]), dtype=e.dtype)
    st["goal"] = torch.zeros(b, policy.goal_dim)
    st["step"] = torch.zeros(b, dtype=torch.int64)
    policy.init_state(st, seed)
    return st


@torch.no_grad()
def obs_statistics(rng, b=64, T=600):
    q0, dq0, g0, change, g1 = new_episode(rng, b, T)
    arm = BatchArm(q0, dq0)
    obs = []
    for t in range(T):
        g = np.where((t >= change)[:, None], g1, g0)
        obs.append(arm.obs())
        arm.step(batch_expert(arm.q, arm.dq, g))
    o = np.concatenate(obs, 0)
    return o.mean(0), np.maximum(o.std(0), 1e-3)


@torch.no_grad()
def closed_loop_eval(policy, seed, b=64, T=800):
    """Policy and expert from rest at random starts toward random goals (batched ArmModel)."""
    rng = np.random.default_rng(seed)
    q0 = rng.uniform(LO + GOAL_MARGIN, HI - GOAL_MARGIN, (b, N))
    goal = random_goals(rng, b)
    res = {}
    for who in ("policy", "expert"):
        arm = BatchArm(q0, np.zeros((b, N)))
        st = fresh_state(policy, b, seed)
        st["goal"] = torch.tensor(goal, dtype=torch.float32)
        for _ in range(T):
            if who == "policy":
                obs = torch.tensor(arm.obs(), dtype=torch.float32)
                act, _ = policy.forward_state(obs, st, inplace=False)
                st["step"] = st["step"] + 1
                arm.step(act.double().numpy())
            else:
                arm.step(batch_expert(arm.q, arm.dq, goal))
        e0 = np.linalg.norm(goal - q0, axis=1)
        e1 = np.linalg.norm(goal - arm.q, axis=1)
        res[who] = e1 / e0
    return res


# -- training --------------------------------------------------------------------------------------
def train(args) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    self_check(np.random.default_rng(args.seed + 1))

    cfg = HybridConfig()
    policy = HybridPolicy(cfg)
    mean, std = obs_statistics(np.random.default_rng(args.seed + 2))
    policy.obs_mean.copy_(torch.tensor(mean, dtype=torch.float32))
    policy.obs_std.copy_(torch.tensor(std, dtype=torch.float32))
    scale = float(policy.delta_scale)
    with torch.no_grad():
        policy.head.weight.mul_(0.1)
        policy.head.bias.zero_()
    policy.train()

    opt = torch.optim.Adam(policy.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            min(1.0, (i + 1) / 50)
            * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * min(i, args.steps) / args.steps)))
        ),
    )
    B, W, T, C = args.batch, args.window, args.episode, cfg.chunk_len
    wins = T // W
    decay = torch.exp(-cfg.ensemble_decay * torch.arange(C, dtype=torch.float32))
    k_idx = torch.arange(C)
    t0 = time.time()
    it = 0
    ep = 0
    hist = []
    while it < args.steps:
        # DAgger: fraction of policy-driven rows ramps up after the first 20% of training
        frac = args.policy_frac * min(1.0, max(0.0, (it / args.steps - args.dagger_start) / 0.4))
        q0, dq0, g0, change, g1 = new_episode(rng, B, T, args.near_frac)
        driven = torch.tensor(rng.random(B) < frac)
        arm = BatchArm(q0, dq0)
        st = fresh_state(policy, B, args.seed + ep)
        ep += 1
        gid = np.zeros(B, dtype=np.int64)
        for w in range(wins):
            if it >= args.steps:
                break
            st = {k: v.detach() for k, v in st.items()}
            chunks, acts, labels, gids = [], [], [], []
            for t in range(w * W, (w + 1) * W):
                g = np.where((t >= change)[:, None], g1, g0)
                gid = (t >= change).astype(np.int64)
                st["goal"] = torch.tensor(g, dtype=torch.float32)
                obs_np = arm.obs()
                act, chunk = policy.forward_state(
                    torch.tensor(obs_np, dtype=torch.float32), st, inplace=False
                )
                st["step"] = st["step"] + 1
                lab = batch_expert(arm.q, arm.dq, g)
                drive = np.where(driven.numpy()[:, None], act.detach().double().numpy(), lab)
                arm.step(drive)
                chunks.append(chunk)
                acts.append(act)
                labels.append(torch.tensor(lab, dtype=torch.float32))
                gids.append(torch.tensor(gid))
            ch = torch.stack(chunks, 1)  # (B, W, C, A)
            ac = torch.stack(acts, 1)  # (B, W, A)
            lb = torch.stack(labels, 1)  # (B, W, A)
            gi = torch.stack(gids, 1)  # (B, W)
            # future labels: lb[:, t + k]
            tt = torch.arange(W)[:, None] + k_idx[None]  # (W, C)
            valid = tt < W
            ttc = tt.clamp(max=W - 1)
            fut = lb[:, ttc]  # (B, W, C, A)
            same_goal = gi[:, ttc] == gi[:, :, None]  # (B, W, C)
            m = (valid[None] & same_goal).float()
            err_c = torch.nn.functional.smooth_l1_loss(
                ch / scale, fut / scale, reduction="none", beta=args.beta
            ).mean(-1)
            wk = decay.sqrt()[None, None]  # nearer entries matter more
            loss_chunk = (err_c * m * wk).sum() / (m * wk).sum()
            loss_act = torch.nn.functional.smooth_l1_loss(ac / scale, lb / scale, beta=args.beta)
            loss = loss_chunk + loss_act
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                rmse = ((ac - lb) ** 2).mean().sqrt().item()
            hist.append((loss.item(), loss_chunk.item(), loss_act.item(), rmse))
            it += 1
            if it % args.log_every == 0 or it == args.steps:
                h = np.mean(hist[-args.log_every :], 0)
                print(
                    f"step {it:5d}/{args.steps}  loss {h[0]:.4f}  chunk {h[1]:.4f}  "
                    f"act {h[2]:.4f}  act_rmse {h[3] * 1000:.2f} mrad  dagger {frac:.2f}  "
                    f"lr {sched.get_last_lr()[0]:.1e}  {time.time() - t0:.0f}s",
                    flush=True,
                )
    train_s = time.time() - t0
    policy.eval()
    ev = closed_loop_eval(policy, seed=10_000 + args.seed)
    final = np.mean(hist[-args.log_every :], 0)
    summary = {
        "train_seconds": round(train_s, 1),
        "final_loss": float(final[0]),
        "final_chunk_loss": float(final[1]),
        "final_action_loss": float(final[2]),
        "final_action_rmse_rad": float(final[3]),
        "eval_policy_median_ratio": float(np.median(ev["policy"])),
        "eval_policy_frac_reached_80pct": float(np.mean(ev["policy"] < 0.2)),
        "eval_expert_median_ratio": float(np.median(ev["expert"])),
        "eval_expert_frac_reached_80pct": float(np.mean(ev["expert"] < 0.2)),
    }
    print(
        f"closed loop, 64 random goals, 800 steps: final/initial error median "
        f"policy {summary['eval_policy_median_ratio']:.4f} "
        f"(reached 80%: {summary['eval_policy_frac_reached_80pct']:.2f}), expert "
        f"{summary['eval_expert_median_ratio']:.4f} "
        f"(reached 80%: {summary['eval_expert_frac_reached_80pct']:.2f})",
        flush=True,
    )
    return policy, summary


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace, counts: tuple) -> None:
    """Before any training: the counts are >= 1 (0 divided by zero, minutes in), and --out can
    be written (a folder that cannot be made failed only at the save, the run lost)."""
    for name in counts:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = Path(args.out)
    if out.is_dir():
        p.error(f"--out {out} is a folder: give the weights file's path")
    if out.exists() and not args.force:  # a trial run must not replace them unseen
        p.error(f"{out} exists: pass --force to replace it")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {out}: cannot make its folder ({e.strerror or e})")


def run_meta(trainer: str, method: str, args: argparse.Namespace, **fields) -> dict:
    """The start of a weights file's meta: the trainer, the method, the command that reproduces
    the run (all but --out), ``fields``, the torch version and the date."""
    command = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out")
    return {
        "trainer": trainer,
        "method": method,
        "command": f"python {trainer} {command}",
        **fields,
        "torch": str(torch.__version__),
        "date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def write_weights(out: Path, policy: torch.nn.Module, config: dict, meta: dict) -> None:
    """Write ``{"config", "state_dict", "meta"}`` (what the policy loaders read) to ``out``
    through a temporary file, so that a crash never leaves half a file."""
    out.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().clone().contiguous() for k, v in policy.state_dict().items()}
    tmp = out.with_suffix(out.suffix + ".tmp")
    torch.save({"config": config, "state_dict": sd, "meta": meta}, tmp)
    tmp.replace(out)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description="Train builtin:hybrid by imitating the ArmModel expert (BC + DAgger, TBPTT)."
    )
    p.add_argument("--out", default=str(DEFAULT_OUT), help="weights file to write (%(default)s)")
    p.add_argument(
        "--force", action="store_true", help="replace --out when it exists (the shipped weights)"
    )
    p.add_argument("--steps", type=int, default=500, help="optimizer steps (%(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of everything (%(default)s)")
    p.add_argument("--batch", type=int, default=64, help="parallel episodes (%(default)s)")
    p.add_argument("--episode", type=int, default=200, help="steps per episode (%(default)s)")
    p.add_argument("--window", type=int, default=50, help="TBPTT window (%(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak Adam learning rate (%(default)s)")
    p.add_argument(
        "--policy-frac",
        type=float,
        default=0.75,
        help="final fraction of policy-driven (DAgger) rows (%(default)s)",
    )
    p.add_argument(
        "--dagger-start",
        type=float,
        default=0.05,
        help="fraction of training after which DAgger rows ramp in (%(default)s)",
    )
    p.add_argument(
        "--near-frac",
        type=float,
        default=0.8,
        help="fraction of episodes starting near their goal (%(default)s)",
    )
    p.add_argument(
        "--beta", type=float, default=0.01, help="smooth-L1 beta in delta_scale units (%(default)s)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (%(default)s)")
    p.add_argument("--log-every", type=int, default=50, help="print every N steps (%(default)s)")
    args = p.parse_args(argv)
    check_args(p, args, ("steps", "batch", "episode", "window", "threads", "log_every"))
    if args.episode % args.window:
        p.error("--episode must be a multiple of --window")

    policy, summary = train(args)
    cfg = policy.config
    meta = run_meta(
        "tools/train_hybrid.py",
        "behaviour cloning of sim.dynamics.expert_action on ArmModel + DAgger, TBPTT",
        args,
        seed=int(args.seed),
        steps=int(args.steps),
        batch=int(args.batch),
        episode=int(args.episode),
        window=int(args.window),
        lr=float(args.lr),
        policy_frac=float(args.policy_frac),
        dagger_start=float(args.dagger_start),
        near_frac=float(args.near_frac),
        beta=float(args.beta),
    )
    write_weights(Path(args.out), policy, asdict(cfg), {**meta, **summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
