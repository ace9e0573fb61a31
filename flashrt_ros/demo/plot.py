"""The PNG plot of the flashrt demo (`python -m flashrt_ros.demo`); plain data in, no ROS.

``plot_demo(summary, trajectory, path)`` draws two panels sharing the time axis:

- top: the 6 joint positions (solid) and the goal the live policy was pursuing (dashed, same
  colour per joint), with a vertical line and a label for each capsule operation and goal change;
- bottom: the distance of the arm to that goal, with the phases of the story shaded;
- with ``frames`` (a policy with cameras): a row of what the camera saw at the story's moments
  (numbered like the markers on the time axis), under both.

``summary`` is the dict the demo writes as summary.json, ``trajectory`` the joint positions it
recorded (written as joint_states.csv), ``frames`` the camera snapshots (N, H, W, 3) uint8
(written as camera_frames.npz), described by ``summary["camera_frames"]["snapshots"]``.
Re-plot a finished run: ``python -m flashrt_ros.demo.plot OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from flashrt_ros.demo.trajectory import Trajectory

# colour of the vertical line of each event kind
EVENT_COLORS = {
    "goal": "0.35",
    "checkpoint": "tab:green",
    "branch": "tab:purple",
    "rollout": "tab:orange",
    "failure": "black",
    "restore": "tab:red",
}
PHASE_COLORS = ["#dbe9f6", "#fde3c8", "#f6d5d5", "#e3d9f1", "#d9f0d3", "#eeeeee"]
FRAMES_FILE = "camera_frames.npz"


def _clusters(events: list[dict], gap: float) -> list[list[dict]]:
    """Group events closer than `gap` seconds, so their labels do not overlap."""
    groups: list[list[dict]] = []
    for ev in sorted(events, key=lambda e: e["t"]):
        if groups and ev["t"] - groups[-1][-1]["t"] < gap:
            groups[-1].append(ev)
        else:
            groups.append([ev])
    return groups


def _goal_at(segments: list[dict], t: np.ndarray, n: int) -> np.ndarray:
    """The active goal (n values) at each time in `t`; NaN before the first segment."""
    out = np.full((len(t), n), np.nan)
    for seg in segments:
        mask = t >= seg["t"]
        out[mask] = np.asarray(seg["goal"], dtype=float)
    return out


def plot_demo(
    summary: dict, trajectory: Trajectory, path: str | Path, frames: np.ndarray | None = None
) -> Path:
    """Write the figure to `path` (PNG); matplotlib is imported here, so importing is cheap.
    With `frames`, the number of camera frames drawn goes to summary["camera_frames"]["drawn"]
    (when the summary has that entry)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    t = np.asarray(trajectory.t, dtype=float)
    q = np.asarray(trajectory.q, dtype=float)
    names = trajectory.joint_names or [f"joint{i + 1}" for i in range(q.shape[1])]
    n = len(names)
    t_end = float(summary.get("story_s") or (t[-1] if len(t) else 1.0))
    segments = summary["goal_segments"]
    events = [e for e in summary["events"] if e.get("plot", True)]

    cam = summary.get("camera_frames") or {}
    snaps = cam.get("snapshots") or []
    n_frames = 0 if frames is None else min(len(frames), len(snaps))
    if n_frames:
        fig = plt.figure(figsize=(15, 11.0), constrained_layout=True)
        gs = fig.add_gridspec(3, 2, width_ratios=[3.3, 1.25], height_ratios=[3, 1.2, 1.6])
    else:
        fig = plt.figure(figsize=(15, 8.2), constrained_layout=True)
        gs = fig.add_gridspec(2, 2, width_ratios=[3.3, 1.25], height_ratios=[3, 1.2])
    ax = fig.add_subplot(gs[0, 0])
    ax2 = fig.add_subplot(gs[1, 0], sharex=ax)
    axt = fig.add_subplot(gs[:, 1])
    axt.axis("off")
    colors = [plt.get_cmap("tab10")(i) for i in range(n)]

    # joints and the goal the live policy pursued
    for j in range(n):
        ax.plot(t, q[:, j], color=colors[j], lw=1.6, label=names[j])
    tg = np.concatenate([[s["t"] for s in segments], [t_end]])
    for k, seg in enumerate(segments):
        for j in range(n):
            ax.hlines(
                seg["goal"][j],
                tg[k],
                tg[k + 1],
                colors=[colors[j]],
                linestyles="--",
                lw=1.1,
                alpha=0.85,
            )
    ax.plot([], [], "k--", lw=1.1, label="active goal")

    # events: one line each; a numbered badge per cluster, explained in the table on the right
    lo, hi = ax.get_ylim()
    span = hi - lo
    ax.set_ylim(lo, hi + 0.12 * span)  # headroom for the badges
    for ev in events:
        for a in (ax, ax2):
            a.axvline(
                ev["t"],
                color=EVENT_COLORS.get(ev["kind"], "0.5"),
                lw=1.2,
                ls=":" if ev["kind"] == "goal" else "-",
                alpha=0.9,
            )
    rows = []
    for k, group in enumerate(_clusters(events, gap=0.02 * t_end), start=1):
        ax.annotate(
            str(k),
            (group[0]["t"], hi + 0.06 * span),
            ha="center",
            va="center",
            fontsize=9,
            fontweight="bold",
            color="white",
            bbox=dict(
                boxstyle="circle,pad=0.25", fc=EVENT_COLORS.get(group[0]["kind"], "0.4"), ec="none"
            ),
        )
        for i, e in enumerate(group):
            rows.append((str(k) if i == 0 else "", e))
    ax.set_ylabel("joint position (rad)")
    ax.legend(loc="lower left", ncol=4, fontsize=8, framealpha=0.9)
    ax.grid(alpha=0.3)
    plt.setp(ax.get_xticklabels(), visible=False)
    d = summary.get("diagnostics_end", {})
    pol = summary.get("policy") or {}
    if pol.get("cameras"):
        title = (
            f"flashrt demo: {pol['spec']} drives the simulated arm from its camera at "
            f"{summary.get('rate_hz', 0):g} Hz; a planner checkpoints, branches and restores"
        )
    else:
        title = (
            f"flashrt demo: the built-in policy drives the simulated arm at "
            f"{summary.get('rate_hz', 0):g} Hz; a planner checkpoints, branches, rolls out and "
            "restores"
        )
    ax.set_title(title, fontsize=11, loc="left")

    # the table of events, colour-coded like the lines
    y = 1.0
    head = "events (t s; round trip; step it took effect at)"
    axt.text(0.0, y, head, fontsize=9.5, fontweight="bold", va="top", transform=axt.transAxes)
    y -= 0.045
    for num, e in rows:
        c = EVENT_COLORS.get(e["kind"], "0.3")
        extra = ""
        if e.get("rtt_ms") is not None:
            extra = f"  {e['rtt_ms']:.1f} ms" + ("/call" if e["kind"] == "rollout" else "")
        if e.get("step") is not None:
            extra += f"  step {e['step']}"
        if e.get("success") is False:
            extra += "  FAILED"
        axt.text(
            0.0, y, num, fontsize=8.5, fontweight="bold", color=c, va="top", transform=axt.transAxes
        )
        axt.text(
            0.07,
            y,
            f"{e['t']:5.2f}  {e['label']}",
            fontsize=8,
            color=c,
            va="top",
            family="monospace",
            transform=axt.transAxes,
        )
        if extra:
            y -= 0.032
            axt.text(
                0.07,
                y,
                "       " + extra.strip(),
                fontsize=8,
                color="0.3",
                va="top",
                family="monospace",
                transform=axt.transAxes,
            )
        y -= 0.04
    y -= 0.02
    stats = [
        f"steps {d.get('steps', '?')}, {d.get('rate_hz', '?')} Hz on {d.get('device', '?')}",
        f"step p50 {d.get('step_p50_us', '?')} us, p99 {d.get('step_p99_us', '?')} us",
        f"jitter p99 {d.get('jitter_p99_us', '?')} us, overruns {d.get('overruns', '?')}",
    ]
    for r in summary.get("rollouts", []):
        stats.append(
            f"what-if {r['session']}: distance to {r['goal']} "
            f"{r['start_error_to_goal']:.2f} -> {r['predicted_error_to_goal']:.2f} rad"
        )
    if summary.get("skipped"):
        stats.append("what-if rollouts skipped: ~/rollout takes")
        stats.append("vector observations only (this policy reads images)")
    fe = summary.get("final_error_rad")
    if fe:
        stats.append(f"final distance to goal: {fe['norm']:.3f} rad")
    axt.text(0.0, y, "run", fontsize=9.5, fontweight="bold", va="top", transform=axt.transAxes)
    y -= 0.045
    for line in stats:
        axt.text(0.0, y, line, fontsize=8, va="top", transform=axt.transAxes)
        y -= 0.035
    axt.text(
        0.0,
        max(y - 0.02, 0.0),
        "restore rewinds the policy's execution state;\nthe arm itself does not teleport.",
        fontsize=8,
        style="italic",
        va="top",
        color="0.3",
        transform=axt.transAxes,
    )

    # distance to the active goal, with the phases shaded
    err = np.linalg.norm(q - _goal_at(segments, t, n), axis=1) if len(t) else np.zeros(0)
    for k, seg in enumerate(segments):
        ax2.axvspan(tg[k], tg[k + 1], color=PHASE_COLORS[k % len(PHASE_COLORS)], alpha=0.8, lw=0)
        ax2.text(
            (tg[k] + tg[k + 1]) / 2,
            0.93,
            seg["label"],
            transform=ax2.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=8,
        )
    ax2.plot(t, err, color="k", lw=1.3, label="|q - active goal|")
    ax2.set_ylabel("distance to goal (rad)")
    ax2.set_xlabel("time since the first goal (s)")
    ax2.set_xlim(0, t_end)
    top = float(np.nanmax(err)) if len(err) and np.isfinite(err).any() else 1.0
    ax2.set_ylim(0, 1.3 * top + 1e-6)
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right", fontsize=8)

    if n_frames:
        _draw_frames(fig, gs[2, 0], frames[:n_frames], snaps[:n_frames], cam, ax2)
        cam["drawn"] = n_frames

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw_frames(fig, cell, frames: np.ndarray, snaps: list[dict], cam: dict, ax_time) -> None:
    """One image per snapshot, left to right, each numbered like its marker on the time axis."""
    sub = cell.subgridspec(1, len(frames), wspace=0.04)
    prev_t, level = None, 0
    t_end = ax_time.get_xlim()[1]
    for k, (img, snap) in enumerate(zip(frames, snaps, strict=True), start=1):
        a = fig.add_subplot(sub[0, k - 1])
        a.imshow(img, interpolation="nearest")
        a.set_xticks([])
        a.set_yticks([])
        a.set_title(f"[{k}] {snap['t']:.1f} s\n{snap['label']}", fontsize=8.5)
        if k == (len(frames) + 1) // 2:
            a.set_xlabel(
                f"what {cam.get('topic', 'the camera')} showed ({cam.get('height', '?')}x"
                f"{cam.get('width', '?')} rgb8, enlarged): the arm in grey, the goal as a "
                "coloured ghost",
                fontsize=8.5,
                color="0.3",
            )
        # a marker on the time axis; labels of close snapshots stacked, not overlapping
        close = prev_t is not None and snap["t"] - prev_t < 0.04 * t_end
        level = level + 1 if close else 0
        prev_t = snap["t"]
        ax_time.annotate(
            f"[{k}]",
            (snap["t"], 0.0),
            xycoords=("data", "axes fraction"),
            xytext=(0, 5 + 9 * level),
            textcoords="offset points",
            ha="center",
            va="bottom",
            fontsize=7.5,
            color="tab:blue",
        )
        ax_time.plot(
            [snap["t"]],
            [0.0],
            marker="^",
            color="tab:blue",
            ms=6,
            transform=ax_time.get_xaxis_transform(),
            clip_on=False,
        )


def load_frames(out_dir: str | Path) -> np.ndarray | None:
    """camera_frames.npz of a demo run (N, H, W, 3) uint8, None when the run had no camera."""
    f = Path(out_dir) / FRAMES_FILE
    if not f.is_file():
        return None
    with np.load(f) as z:
        return z["frames"]


def load_run(out_dir: str | Path) -> tuple[dict, Trajectory]:
    """summary.json and joint_states.csv of a demo run, as plot_demo takes them."""
    out_dir = Path(out_dir)
    summary = json.loads((out_dir / "summary.json").read_text())
    return summary, Trajectory.read_csv(out_dir / "joint_states.csv")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print("usage: python -m flashrt_ros.demo.plot OUT_DIR   (re-plots OUT_DIR/demo.png)")
        sys.exit(0 if len(sys.argv) == 2 else 2)
    out_dir = Path(sys.argv[1])
    print(plot_demo(*load_run(out_dir), out_dir / "demo.png", frames=load_frames(out_dir)))
