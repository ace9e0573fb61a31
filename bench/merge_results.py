"""Merge the dated result files of one day's GPU runs into bench/results/latest.json and .md.

    python bench/merge_results.py DATE

Reads bench/results/DATE-core.json (bench/run_all.py), DATE-ros.json (bench/ros_gpu.sh) and,
when present, DATE-ros-udp.json (the same with Fast DDS on UDPv4 only), and writes latest.json in
the schema of bench/README.md, with a "runs" list naming the command and code version behind
every part. The "ros" headline is recomputed from the scenario rows by ros_bench.headline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RES = Path(__file__).resolve().parent / "results"

RUNS = [
    {
        "part": "checks, d2d_GBps, copy_paths, step, variants, capsule, engine_capsule_ops, "
        "reprefill",
        "file": "{date}-core.json",
        "git": "5ac00cf",
        "command": "python3 bench/run_all.py --out $OUT",
    },
    {
        "part": "ros",
        "file": "{date}-ros.json",
        "git": "5ac00cf",
        "command": "bash bench/ros_gpu.sh $OUT (carry .whl312: cp312 ROS wheels)",
    },
    {
        "part": "ros_udp (Fast DDS UDPv4 transport, for comparison)",
        "file": "{date}-ros-udp.json",
        "git": "5ac00cf",
        "command": "FASTDDS_BUILTIN_TRANSPORTS=UDPv4 bash bench/ros_gpu.sh $OUT --rates 500 "
        "--obs-samples 300 --service-calls 40",
    },
]


def main(date: str) -> int:
    from bench.ros_bench import headline

    core = json.loads((RES / f"{date}-core.json").read_text())
    ros = json.loads((RES / f"{date}-ros.json").read_text())
    udp_file = RES / f"{date}-ros-udp.json"
    udp = json.loads(udp_file.read_text()) if udp_file.exists() else None
    head = headline(
        ros["rates"], ros.get("rates_publish_offset", []), ros["services"], ros["observation"]
    )
    ros.update(head)
    out = dict(core)
    out.update(
        git=RUNS[0]["git"],
        command="python3 bench/run_all.py --out bench/results; bash bench/ros_gpu.sh OUT; "
        "python3 bench/merge_results.py DATE",
        ros={
            k: head[k]
            for k in (
                "rate_hz",
                "period_jitter_p99_us",
                "obs_to_action_p50_us",
                "service_rtt_p50_us",
            )
        },
        ros_detail=ros,
        ros_udp=udp,
        runs=[
            dict(r, file=r["file"].format(date=date)) for r in RUNS if udp or "udp" not in r["part"]
        ],
    )
    (RES / "latest.json").write_text(json.dumps(out, indent=1) + "\n")
    (RES / "latest.md").write_text(markdown(out))
    print(markdown(out))
    return 0


def markdown(r: dict) -> str:
    from bench.run_all import markdown as core_md

    ros, det = r["ros"], r["ros_detail"]
    lines = [core_md(r).rstrip(), "", "| node on CUDA | value |", "|---|---|"]
    rows = [(row, "") for row in det["rates"]]
    rows += [(row, "") for row in det.get("rates_publish_offset", [])]
    rows += [(row, ", Fast DDS UDPv4") for row in (r.get("ros_udp") or {}).get("rates", [])]
    rows += [
        (row, ", Fast DDS UDPv4")
        for row in (r.get("ros_udp") or {}).get("rates_publish_offset", [])
    ]
    for row, note in rows:
        lines.append(
            f"| timer {row['target_hz']:.0f} Hz, publish_offset_s {row['publish_offset_s']}"
            f"{note} | achieved {row['achieved_hz']} Hz ({row['node'].get('overruns_in_window')} "
            f"overruns in {row['seconds']} s); period jitter p99 "
            f"{row['node_publish'].get('jitter_p99_us')} us at the node's writes, "
            f"{row['client_dds'].get('jitter_p99_us')} us at the client's reception, "
            f"{row['node']['jitter_p99_us']} us at the loop's wake-up; node step p50/p99 "
            f"{row['node']['step_p50_us']}/{row['node']['step_p99_us']} us |"
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
