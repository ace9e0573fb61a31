"""The run's summary: the dict written as summary.json, and its printed form."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from flashrt_ros.demo.planner import Diag
from flashrt_ros.demo.policy_info import PolicyInfo
from flashrt_ros.demo.story import CAMERA_RATE_HZ, GOALS, Story
from flashrt_ros.demo.trajectory import Trajectory


def _f(d: dict | None, key: str, default=float("nan")) -> float:
    """A diagnostics value as a float (they arrive as strings); `default` when absent or bad."""
    try:
        return float((d or {}).get(key, default))
    except (TypeError, ValueError):
        return default


def build_summary(
    args: argparse.Namespace,
    story: Story,
    trajectory: Trajectory,
    startup_s: float,
    wall_s: float,
    diag0: Diag,
    diag1: Diag,
    listing,
    policy: PolicyInfo | None = None,
) -> dict:
    """Everything summary.json holds: plain JSON data (the trajectory goes to its own CSV and
    the camera frames, when the policy has cameras, to camera_frames.npz)."""
    q = trajectory.q
    goal = np.asarray(story.goal_segments[-1]["goal"]) if story.goal_segments else np.zeros(6)
    final_q = q[-1] if len(q) else np.full(6, np.nan)
    (t_d0, d0), (t_d1, d1) = diag0, diag1
    steps0, steps1 = _f(d0, "steps", 0.0), _f(d1, "steps", 0.0)
    achieved = (steps1 - steps0) / (t_d1 - t_d0) if d0 and d1 and t_d1 > t_d0 else float("nan")
    ops = [e for e in story.events if e.get("service")]
    capsules = []
    if listing is not None:
        capsules = [
            {
                "id": c.id,
                "name": c.name,
                "session": c.session,
                "parent_id": c.parent_id,
                "step": int(c.step),
                "nbytes": int(c.nbytes),
                "tier": c.tier,
                "pinned": bool(c.pinned),
            }
            for c in listing.capsules
        ]
    return {
        "duration_s": story.duration,
        "story_s": round(story.end if story.end is not None else story.now(), 3),
        "startup_s": round(startup_s, 3),
        "wall_s": round(wall_s, 3),
        "rate_hz": args.rate,
        "domain_id": args.domain_id,
        "joint_names": list(trajectory.joint_names),
        "goals": GOALS,
        "active_goal": story.goal_segments[-1]["label"] if story.goal_segments else None,
        "final_q": np.round(final_q, 4).tolist(),
        "final_error_rad": {
            "norm": round(float(np.linalg.norm(final_q - goal)), 4),
            "max_abs": round(float(np.max(np.abs(final_q - goal))), 4),
        },
        "steps": int(steps1),
        "story_steps": int(steps1 - steps0),
        # counters over the story alone (the totals include the start-up)
        "story_overruns": int(_f(d1, "overruns", 0.0) - _f(d0, "overruns", 0.0)),
        "story_stale_ticks": int(_f(d1, "stale_ticks", 0.0) - _f(d0, "stale_ticks", 0.0)),
        "achieved_rate_hz": round(achieved, 2) if math.isfinite(achieved) else None,
        "diagnostics_end": d1 or {},
        "events": story.events,
        "capsule_ops": ops,
        "all_ops_ok": all(e["success"] for e in ops),
        "rollouts": story.rollouts,
        "goal_segments": story.goal_segments,
        "capsules_end": capsules,
        "sessions_end": list(listing.sessions) if listing is not None else [],
        "live_session_end": listing.live_session if listing is not None else None,
        "pool_bytes_used": int(listing.pool_bytes_used) if listing is not None else None,
        "pool_bytes_total": int(listing.pool_bytes_total) if listing is not None else None,
        "policy": policy.as_dict() if policy is not None else None,
        "skipped": list(story.skipped),
        "story_refused_inputs": int(_f(d1, "refused_inputs", 0.0) - _f(d0, "refused_inputs", 0.0)),
        "camera_frames": _frames(story, policy),
    }


def _frames(story: Story, policy: PolicyInfo | None) -> dict | None:
    """The camera snapshots: which camera, when, what moment (the pixels are in
    camera_frames.npz; `drawn` is set by the plot)."""
    if policy is None or not policy.visual:
        return None
    h, w = policy.image_hw
    return {
        "camera": policy.cameras[0],
        "topic": f"camera/{policy.cameras[0]}/image_raw",
        "height": h,
        "width": w,
        "rate_hz": CAMERA_RATE_HZ,
        "count": len(story.frames),
        "drawn": 0,
        "file": "camera_frames.npz",
        "snapshots": list(story.snapshots),
    }


def print_summary(s: dict, out: Path) -> None:
    """The human-readable end of the demo: timings, capsule operations, what-ifs, the pool."""
    d = s["diagnostics_end"]
    p = print
    p("")
    p("=" * 78)
    p("flashrt demo summary")
    p("=" * 78)
    p(
        f"duration        {s['story_s']:.1f} s of story (+ {s['startup_s']:.1f} s node start-up), "
        f"{s['wall_s']:.1f} s wall in all"
    )
    p(
        f"policy loop     {s['steps']} steps ({s['story_steps']} during the story) at "
        f"{s['rate_hz']:g} Hz target; achieved "
        f"{s['achieved_rate_hz']} Hz (diagnostics: {d.get('rate_hz', '?')} Hz), device "
        f"{d.get('device', '?')}"
    )
    p(
        f"step time       p50 {d.get('step_p50_us', '?')} us, p99 {d.get('step_p99_us', '?')} us; "
        f"period jitter p99 {d.get('jitter_p99_us', '?')} us"
    )
    p(
        f"counters        overruns {d.get('overruns', '?')} ({s['story_overruns']} during the "
        f"story), stale ticks {d.get('stale_ticks', '?')} ({s['story_stale_ticks']} during the "
        f"story), refused inputs {d.get('refused_inputs', '?')}"
    )
    p("")
    p("capsule operations (round trip measured by the planner; step = the session step the")
    p("operation took effect at, on the commit boundary between two steps):")
    p(f"  {'t (s)':>7}  {'operation':<36} {'ok':<4} {'rtt (ms)':>9}  {'step':>6}")
    for e in s["capsule_ops"]:
        rtt = f"{e['rtt_ms']:.2f}" + ("*" if e["kind"] == "rollout" else "")
        step = "" if e["step"] is None else str(e["step"])
        p(
            f"  {e['t']:7.2f}  {e['label']:<36} {'yes' if e['success'] else 'NO':<4} {rtt:>9}  "
            f"{step:>6}"
        )
        if not e["success"]:
            p(f"           -> {e['message']}")
    if s["rollouts"]:
        foot = "one call per predicted policy step (commit=True into the fork)"
        p(f"  * rollout: p50 per call; {foot}")
    p("")
    p("what-if rollouts from the checkpoint (closed loop on the arm model, the robot untouched):")
    for why in s.get("skipped", []):
        p(f"  {why}")
    for r in s["rollouts"]:
        p(
            f"  {r['session']} (goal {r['goal']}): predicted final target "
            f"{[round(x, 2) for x in r['predicted_final_target']]}, distance to goal "
            f"{r['start_error_to_goal']:.2f} -> {r['predicted_error_to_goal']:.2f} rad "
            f"in {r['n_steps']} steps"
        )
    p("")
    p(
        f"capsules in the pool at the end ({len(s['capsules_end'])}; pool "
        f"{s['pool_bytes_used']} / {s['pool_bytes_total']} bytes; sessions "
        f"{', '.join(s['sessions_end'])}; live session {s['live_session_end']!r}):"
    )
    for c in s["capsules_end"]:
        p(
            f"  {c['id']:<14} name={c['name'] or '-':<16} session={c['session']:<8} "
            f"step={c['step']:<6} {c['nbytes']} B on {c['tier']}{', pinned' if c['pinned'] else ''}"
        )
    p("")
    fe = s["final_error_rad"]
    p(
        f"final joint error to the active goal ({s['active_goal']}): norm {fe['norm']:.3f} rad, "
        f"max {fe['max_abs']:.3f} rad"
    )
    cam = s.get("camera_frames")
    if cam:
        p("")
        p(
            f"camera frames   {cam['count']} snapshots of {cam['topic']} ({cam['height']}x"
            f"{cam['width']} rgb8, {cam['rate_hz']:g} Hz), {cam['drawn']} drawn in demo.png: "
            + ", ".join(f"{x['t']:.1f} s {x['label']}" for x in cam["snapshots"])
        )
    p("")
    pol = s.get("policy") or {}
    if pol.get("cameras") or (pol and not pol.get("goal_dim")):
        _note_visual(s, pol)
    else:
        _note_hybrid()
    p("")
    p(
        f"files: {out / 'demo.png'}, {out / 'summary.json'}, {out / 'joint_states.csv'}, "
        + (f"{out / cam['file']}, " if cam else "")
        + f"node logs in {out}"
    )


def _note_hybrid() -> None:
    p = print
    p("note: restore rewinds the policy's execution state (observation history / KV ring,")
    p("recurrent and convolution state, action queue, goal, step counter) to the checkpoint, byte")
    p("for byte. It does not move the robot: the arm stayed where the failed move to B left it,")
    p("and the restored policy, pursuing goal A again, steered it from there. The branch into")
    p("plan_c then forked the same capsule with goal C and made that session live.")


def _note_visual(s: dict, pol: dict) -> None:
    """What the story means for a policy that sees the goal in its camera (builtin:act)."""
    p = print
    regions = [c for c in pol.get("capsule_state", []) if c["nbytes"]]
    held = ", ".join(f"{c['name']} {tuple(c['shape'])} ({c['role']})" for c in regions)
    roles = {c["role"] for c in regions}
    p(f"note: {pol['spec']} ({pol['policy_id']}): its capsule holds {held}.")
    if "queue" in roles:
        p("The queue regions are the temporal-ensembling state (ACT's running sums of the")
        p("overlapping chunks) or the action queue: a restore brings back the blended plan too.")
    if "history" not in roles:
        p("No observation history: the policy observes one step (n_obs_steps 1).")
    p("restore (verify) checked the live arena's bytes against the capsule's checksum after the")
    p("copy, so the policy continued from the checkpoint's state byte for byte. It does not move")
    p("the robot: the arm stayed where the failed move to B left it.")
    if not pol.get("goal_dim"):
        p("The policy reads the goal from the camera image (goal_dim 0): goals go to the sim,")
        p("which draws them; the capsule holds none, so the planner published goal A again after")
        p("the restore and goal C after the live branch to plan_c. The node refuses `goal` for")
        p(f"this policy ({s.get('story_refused_inputs', '?')} refused inputs during the story).")
