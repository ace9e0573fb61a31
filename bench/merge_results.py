"""Merge the dated result files of one day's GPU runs into bench/results/latest.json and .md.

    python bench/merge_results.py DATE

Reads bench/results/DATE-core.json (bench/run_all.py), DATE-capsule-burst.json (the 1 and
16 MB capsule rows re-measured with bench.run_all.capsule_bench, burst timing) and DATE-ros.json
(bench/ros_gpu.sh) and writes latest.json in the schema of DESIGN.md section 8, with a "runs"
list naming the command and code version behind every part.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RES = Path(__file__).resolve().parent / "results"

RUNS = [
    {
        "part": "checks, d2d_GBps, step, variants, capsule (256, 1024 MB), engine_capsule_ops, "
        "reprefill",
        "file": "{date}-core.json",
        "git": "b0ccc38",
        "command": "python3 bench/run_all.py --out $OUT",
    },
    {
        "part": "capsule (1, 16 MB)",
        "file": "{date}-capsule-burst.json",
        "git": "40ecf9a",
        "command": "python3 -c 'import bench.run_all as r; r.capsule_bench(4247.4, [1, 16], 300)' "
        "(after a matmul warm-up, so the clocks are up)",
    },
    {
        "part": "ros",
        "file": "{date}-ros.json",
        "git": "40ecf9a",
        "command": "bash bench/ros_gpu.sh $OUT (carry .whl312: cp312 ROS wheels)",
    },
]


def main(date: str) -> int:
    core = json.loads((RES / f"{date}-core.json").read_text())
    burst = json.loads((RES / f"{date}-capsule-burst.json").read_text())
    ros = json.loads((RES / f"{date}-ros.json").read_text())
    sizes = {r["mb"] for r in burst}
    capsule = sorted(
        burst + [r for r in core["capsule"] if r["mb"] not in sizes], key=lambda r: r["mb"]
    )
    out = dict(core)
    out.update(
        git=RUNS[0]["git"],
        command="python3 bench/run_all.py --out bench/results; bash bench/ros_gpu.sh OUT; "
        "python3 bench/merge_results.py DATE",
        capsule=capsule,
        ros={
            k: ros[k]
            for k in (
                "rate_hz",
                "period_jitter_p99_us",
                "obs_to_action_p50_us",
                "service_rtt_p50_us",
            )
        },
        ros_detail=ros,
        runs=[dict(r, file=r["file"].format(date=date)) for r in RUNS],
    )
    (RES / "latest.json").write_text(json.dumps(out, indent=1) + "\n")
    (RES / "latest.md").write_text(markdown(out))
    print(markdown(out))
    return 0


def markdown(r: dict) -> str:
    from bench.run_all import markdown as core_md

    ros, det = r["ros"], r["ros_detail"]
    lines = [core_md(r).rstrip(), "", "| node on CUDA | value |", "|---|---|"]
    for row in det["rates"]:
        lines.append(
            f"| timer {row['target_hz']:.0f} Hz | achieved {row['achieved_hz']} Hz, period "
            f"jitter p99 {row['period_jitter_p99_us']} us at the client, "
            f"{row['node']['jitter_p99_us']} us in the node's loop, node step p50 "
            f"{row['node']['step_p50_us']} us |"
        )
    s = det["services"]
    lines += [
        f"| observation -> action | p50 {ros['obs_to_action_p50_us']} us, "
        f"p99 {det['obs_to_action_p99_us']} us |",
        f"| service round trip (p50/p99, node at 500 Hz) | checkpoint {s['checkpoint_p50_us']} / "
        f"{s['checkpoint_p99_us']} us, restore {s['restore_p50_us']} / {s['restore_p99_us']} us,"
        f" list {s['list_p50_us']} / {s['list_p99_us']} us |",
        "",
        "Runs: " + "; ".join(f"{x['part']}: `{x['command']}` (git {x['git']})" for x in r["runs"]),
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "2026-11-29"))
