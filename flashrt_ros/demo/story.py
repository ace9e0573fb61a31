"""The demo's script: goal A, checkpoint, branch and roll out B and C, goal B, a (simulated)
failure, restore, then a live branch to C. Times are fractions of ``--duration``; every step is
recorded as an event (for the summary and the plot) and said on stdout.

A policy that reads the goal from the camera (goal_dim 0, e.g. builtin:act) changes three
things: the goals are for the sim to draw (the planner waits for fresh frames, not for the
node's echo); after the restore and the live branch the planner publishes goal A, then C, again
so that the camera shows the goal the story pursues (the capsule holds no goal; the same for any
policy with cameras); the branches carry no goal. And the what-if part (branch to try_b / try_c
and ``~/rollout`` them) is skipped when the policy reads images: ~/rollout takes vector
observations only. With cameras, the story also snapshots the first camera at each of its
moments (checkpoint, failure, restored, plan_c, end) for the plot."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from flashrt_ros.demo.planner import Planner
from flashrt_ros.demo.policy_info import PolicyInfo
from flashrt_ros.sim.dynamics import ArmModel

GOALS = {
    "A": [0.8, -0.5, 0.6, -0.4, 0.5, 0.3],
    "B": [-0.6, 0.6, -0.7, 0.5, -0.4, -0.6],
    "C": [0.2, 0.9, 1.0, -0.8, -0.7, 0.6],
}
# the story, as fractions of --duration (after the start-up)
T_CHECKPOINT = 0.25
T_FAILURE = 0.45
T_PLAN_C = 0.58
ROLLOUT_HORIZON_S = 1.0
SIM_RATE_HZ = 100.0  # the arm model's dt (0.01 s), as the built-in policy was trained
CAMERA_RATE_HZ = 30.0  # the sim's camera rate, when the policy has cameras


class Story:
    """Runs the script against the node through `planner`; t = 0 is its construction."""

    def __init__(
        self,
        planner: Planner,
        duration: float,
        rate_hz: float,
        log: Callable = print,
        policy: PolicyInfo | None = None,
    ) -> None:
        self.p = planner
        # the built-in hybrid policy's shape when not told: goal in the node, no cameras
        self.takes_goal = policy.takes_goal if policy else True
        self.visual = policy.visual if policy else False
        self.policy_spec = policy.spec if policy else "builtin:hybrid"
        # the rollout's rows: the model's positions, then its velocities where the policy takes
        # them (a positions-only policy's node has state_fields [position])
        self.obs_dim = policy.obs_dim if policy else None
        # the goal the camera shows follows the story (restore, live branch) when the policy
        # sees it there, or has no goal input at all
        self.redraw_goals = self.visual or not self.takes_goal
        self.duration = duration
        self.rate_hz = rate_hz
        self.log = log
        self.t0 = time.monotonic()
        self.events: list[dict] = []
        self.goal_segments: list[dict] = []
        self.rollouts: list[dict] = []
        self.skipped: list[str] = []  # parts of the story left out for this policy, and why
        self.frames: list[np.ndarray] = []  # camera snapshots (H x W x 3 uint8)
        self.snapshots: list[dict] = []  # their time and label, one per frame
        self.end: float | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    def sleep_until(self, frac: float) -> None:
        left = frac * self.duration - self.now()
        if left > 0:
            time.sleep(left)

    def say(self, text: str) -> None:
        self.log(f"[t={self.now():6.2f} s] {text}")

    def _event(self, kind: str, label: str, **extra) -> dict:
        ev = {"t": round(self.now(), 4), "kind": kind, "label": label, **extra}
        self.events.append(ev)
        return ev

    def goal(self, name: str, segment_label: str | None = None) -> None:
        """Publish goal `name` and start a goal segment (the plot's dashed lines). A policy
        without a goal input sees it in the camera image: then wait for the sim's frames."""
        t = round(self.now(), 4)
        ok = self.p.publish_goal(GOALS[name], echo=self.takes_goal)
        label = segment_label or f"goal {name}"
        self.events.append(
            {"t": t, "kind": "goal", "label": f"goal {name}", "goal": name, "success": ok}
        )
        if not self.takes_goal:
            self.events[-1]["via"] = "camera"
        self.goal_segments.append({"t": t, "goal": GOALS[name], "label": label})
        if self.takes_goal:
            note = "" if ok else "  (not echoed by the node!)"
        else:
            note = " (drawn by the sim in the camera image" + ("" if ok else ": no frame!") + ")"
        self.say(f"goal {name} {GOALS[name]}{note}")

    def snap(self, label: str) -> None:
        """A fresh frame of the first camera, kept for the plot (no cameras: nothing)."""
        if not self.visual:
            return
        got = self.p.snapshot()
        if got is None:
            self.say(f"camera snapshot {label!r}: no frame within 2 s")
            return
        t_rx, frame = got
        self.frames.append(frame)
        self.snapshots.append({"t": round(t_rx - self.t0, 4), "label": label})

    def op(self, kind: str, label: str, service: str, plot: bool = True, **fields) -> object:
        """Call a capsule service and record it with its round trip and the step it took."""
        t = self.now()
        resp, rtt = self.p.call(service, **fields)
        step = None
        if service == "checkpoint" and resp.success:
            step = int(resp.capsule.step)
        elif service in ("restore", "branch") and resp.success:
            step = int(resp.step)
        ev = {
            "t": round(t, 4),
            "kind": kind,
            "label": label,
            "service": service,
            "success": bool(resp.success),
            "message": resp.message,
            "rtt_ms": round(rtt * 1e3, 3),
            "step": step,
            "plot": plot,
        }
        if service == "checkpoint" and resp.success:
            ev["capsule"] = {
                "id": resp.capsule.id,
                "name": resp.capsule.name,
                "nbytes": int(resp.capsule.nbytes),
                "tier": resp.capsule.tier,
                "checksum": resp.capsule.checksum,
            }
        self.events.append(ev)
        status = "ok" if resp.success else "FAILED"
        self.say(
            f"{label}: {status} in {rtt * 1e3:.2f} ms"
            + (f", step {step}" if step is not None else "")
            + f" ({resp.message})"
        )
        return resp

    def rollout(self, session: str, goal_name: str, horizon_s: float) -> dict:
        """Closed-loop what-if: step `session` (commit=True, never the live one) one policy step
        per call on observations that a copy of the arm model predicts from the actions."""
        q, dq = self.p.state()
        model = ArmModel(dt=1.0 / SIM_RATE_HZ)
        model.reset(np.clip(q, model.lower, model.upper), dq)  # from the measured velocity too
        # the model runs on the sim's clock and holds each action for the policy's period, as
        # the robot does, whatever the ratio of the two rates
        dt, sim_t = 1.0 / SIM_RATE_HZ, 0.0
        n_steps = max(1, round(horizon_s * self.rate_hz))
        t = self.now()
        rtts, actions = [], []
        for k in range(n_steps):
            obs = model.observation()[: self.obs_dim]  # positions come first
            resp, rtt = self.p.call(
                "rollout",
                session=session,
                capsule="",
                observations=obs.tolist(),
                n_steps=1,
                commit=True,
            )
            rtts.append(rtt)
            if not resp.success:
                break
            a = np.asarray(resp.actions, dtype=float)
            actions.append(a)
            policy_t = (k + 1) / self.rate_hz
            while sim_t + dt <= policy_t + 1e-9:
                model.step(a)
                sim_t += dt
        ok = len(actions) == n_steps
        goal = np.asarray(GOALS[goal_name])
        final_target = actions[-1] if actions else np.full(6, np.nan)
        res = {
            "session": session,
            "goal": goal_name,
            "n_steps": n_steps,
            "success": ok,
            "message": "" if ok else resp.message,
            "calls": len(rtts),
            "total_ms": round(sum(rtts) * 1e3, 2),
            "rtt_p50_ms": round(float(np.percentile(rtts, 50)) * 1e3, 3),
            "rtt_max_ms": round(float(np.max(rtts)) * 1e3, 3),
            "predicted_final_target": np.round(final_target, 4).tolist(),
            "predicted_final_q": np.round(model.q, 4).tolist(),
            "predicted_error_to_goal": round(float(np.linalg.norm(model.q - goal)), 4),
            "start_error_to_goal": round(float(np.linalg.norm(q - goal)), 4),
        }
        self.rollouts.append(res)
        self.events.append(
            {
                "t": round(t, 4),
                "kind": "rollout",
                "label": f"rollout {session}",
                "service": "rollout",
                "success": ok,
                "message": res["message"] or f"{n_steps} steps, closed loop on the arm model",
                "rtt_ms": res["rtt_p50_ms"],
                "step": None,
                "plot": True,
                "calls": len(rtts),
                "total_ms": res["total_ms"],
            }
        )
        self.say(
            f"rollout {session} (goal {goal_name}, started at t={t:.2f} s as in the summary): "
            f"{n_steps} steps in {len(rtts)} calls, "
            f"{res['total_ms']:.0f} ms total, p50 {res['rtt_p50_ms']:.2f} ms/call; predicted "
            f"final target {np.round(final_target, 2).tolist()}, predicted distance to "
            f"{goal_name} {res['start_error_to_goal']:.2f} -> "
            f"{res['predicted_error_to_goal']:.2f} rad"
        )
        return res

    def list_capsules(self) -> object:
        """The pool at the end (for the summary), recorded as an event the plot leaves out."""
        listing, rtt = self.p.call("list_capsules")
        self.events.append(
            {
                "t": round(self.now(), 4),
                "kind": "list",
                "label": "list_capsules",
                "service": "list_capsules",
                "success": True,
                "message": f"{len(listing.capsules)} capsules",
                "rtt_ms": round(rtt * 1e3, 3),
                "step": None,
                "plot": False,
            }
        )
        return listing

    def run(self) -> None:
        self.goal("A")
        self.sleep_until(T_CHECKPOINT)
        self.snap("checkpoint (goal A)")
        self.say("planner: about to change the goal; checkpoint first")
        self.op(
            "checkpoint",
            'checkpoint "before_goal_b"',
            "checkpoint",
            session="",
            name="before_goal_b",
            pin=True,
            persist=False,
        )
        if self.visual:
            why = (
                f"what-if (branch to try_b / try_c, ~/rollout each): skipped, ~/rollout takes "
                f"vector observations only and {self.policy_spec} also reads camera images"
            )
            self.skipped.append(why)
            self.say(why)
        else:
            self.whatif()
        self.goal("B")
        self.sleep_until(T_FAILURE)
        self._event("failure", "move to B FAILED (simulated)")
        self.say("simulated failure: the move to B is declared failed")
        self.snap("move to B failed")
        self.op(
            "restore",
            'restore "before_goal_b" (verify)',
            "restore",
            capsule="before_goal_b",
            session="",
            verify=True,
        )
        if self.redraw_goals:  # the camera still shows B: the sim must draw A again
            self.goal("A", "restored: goal A")
        else:
            self.goal_segments.append(
                {"t": self.events[-1]["t"], "goal": GOALS["A"], "label": "restored: goal A"}
            )
        self.snap("restored (goal A)")
        self.sleep_until(T_PLAN_C)
        goal_c = [float(x) for x in GOALS["C"]] if self.takes_goal else []
        self.op(
            "branch",
            "branch -> plan_c (goal C, live)" if self.takes_goal else "branch -> plan_c (live)",
            "branch",
            capsule="before_goal_b",
            session="plan_c",
            activate=True,
            goal=goal_c,
        )
        if self.redraw_goals:
            self.goal("C", "plan_c: goal C")
        else:
            self.goal_segments.append(
                {"t": self.events[-1]["t"], "goal": GOALS["C"], "label": "plan_c: goal C"}
            )
        self.snap("plan_c live (goal C)")
        self.sleep_until(1.0)
        self.snap("end")
        self.end = self.now()

    def whatif(self) -> None:
        """Branch the checkpoint into try_b and try_c with goals B and C, roll both out."""
        self.say("planner: compare the alternatives B and C on forks of the checkpoint")
        for g in ("B", "C"):
            self.op(
                "branch",
                f"branch -> try_{g.lower()} (goal {g})",
                "branch",
                capsule="before_goal_b",
                session=f"try_{g.lower()}",
                activate=False,
                goal=[float(x) for x in GOALS[g]],
            )
        for session, g in (("try_b", "B"), ("try_c", "C")):
            self.rollout(session, g, ROLLOUT_HORIZON_S)
