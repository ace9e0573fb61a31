#!/usr/bin/env bash
# The node's service path, this tree's package against another one, on one GPU machine:
#   bash bench/ros_ab.sh OUT_DIR OTHER_PKG [ROUNDS] [ros_bench.py args...]
# OTHER_PKG is a flashrt_ros/ folder of another commit, made on the development machine with
#   mkdir -p .ab && git archive REV flashrt_ros | tar -x -C .ab      (.ab ignored, then carried)
# Each of ROUNDS (2) rounds runs `bench/ros_gpu.sh --busy-wait --only services --no-startup`
# with this tree's package (A), then with OTHER_PKG's (B). The install links each file of
# flashrt_ros/ (colcon --symlink-install), so a swap takes effect at once; ros_gpu.sh rebuilds
# only when the list of files differs. Alternating puts the machine's drift on both sides.
# This tree's package is put back after each B run, on failure and on Ctrl-C (which ends the
# script). Each run writes OUT_DIR/{A,B}<round>/ros.json and OUT_DIR/{A,B}<round>.log; the last
# lines compare their round trips, the node's handler time per service, the queue and reply
# times, and the bare service floor of the same run. Exit status 1 when a run failed.
# About 70 s a run after the first (wheels); two rounds fit one 600 s device call. ROS_RUN
# replaces bench/ros_gpu.sh (a command, split on spaces, given OUT_DIR, then ros_bench args).
set -eo pipefail

USAGE="usage: bash bench/ros_ab.sh OUT_DIR OTHER_PKG [ROUNDS] [ros_bench args]"
OUT="${1:?$USAGE}"
OTHER="${2:?$USAGE}"
shift 2
ROUNDS=2
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then ROUNDS=$((10#$1)); shift; fi
EXTRA=("$@")
read -ra RUN <<<"${ROS_RUN:-bash bench/ros_gpu.sh}"  # the runner: OUT_DIR, then ros_bench args
[ -f "$OTHER/__init__.py" ] && [ -d "$OTHER/node" ] || {
  echo "ros_ab: $OTHER is not a flashrt_ros package folder (no __init__.py and node/)" >&2; exit 2; }
[ "$ROUNDS" -ge 1 ] || { echo "ros_ab: ROUNDS must be at least 1" >&2; exit 2; }
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"  # both resolved before the cd below
OTHER="$(cd "$OTHER" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# beside the package, on the same file system, so that moving it away and back are renames
mkdir -p build
SPARE="$(mktemp -d "$ROOT/build/ab_keep.XXXXXX")"
KEEP="$SPARE/flashrt_ros"

put_back() {  # this tree's package in place again
  if [ -d "$KEEP" ]; then
    rm -rf flashrt_ros
    mv "$KEEP" flashrt_ros
  fi
}
trap 'put_back; rm -rf "$SPARE"' EXIT
trap 'echo "[ros_ab] interrupted" >&2; exit 130' INT TERM

failed=0
run() {  # run SIDE ROUND
  local dir="$OUT/$1$2"
  echo "[ros_ab] round $2, side $1 ($([ "$1" = A ] && echo "this tree" || echo "$OTHER"))"
  if ! "${RUN[@]}" "$dir" --busy-wait --only services --no-startup "${EXTRA[@]}" >"$dir.log" 2>&1; then
    echo "[ros_ab] side $1 round $2 failed: see $dir.log"
    failed=$((failed + 1))
  fi
  grep -h "services @\|floor service" "$dir.log" || true
}

for ((i = 1; i <= ROUNDS; i++)); do
  run A "$i"
  mv flashrt_ros "$KEEP"
  cp -r "$OTHER" flashrt_ros
  run B "$i"
  put_back
done

python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, sys
from pathlib import Path
out, rounds = Path(sys.argv[1]), int(sys.argv[2])
cols = ("checkpoint", "restore", "list_capsules", "drop_capsule")
print("| run | round trip p50: checkpoint / restore / list | floor | handler p50: " + " / ".join(cols) + " | queue | reply | step |")
print("|---|---|---|---|---|---|---|")
for i in range(1, rounds + 1):
    for side in "AB":
        f = out / f"{side}{i}" / "ros.json"
        if not f.exists():
            print(f"| {side}{i} | (no ros.json) | | | | | |")
            continue
        d = json.loads(f.read_text())
        s = d.get("services") or {}
        h = s.get("node_handler_by_service_p50_us", {})
        rtt = " / ".join(str(s.get(f"{k}_p50_us")) for k in ("checkpoint", "restore", "list"))
        print(f"| {side}{i} | {rtt} | {d.get('floor_service_p50_us')} | "
              + " / ".join(str(h.get(k)) for k in cols)
              + f" | {s.get('node_queue_p50_us')} | {s.get('node_reply_p50_us')} | {d.get('node_step_p50_us')} |")
EOF
[ "$failed" -eq 0 ] || { echo "[ros_ab] $failed run(s) failed" >&2; exit 1; }
