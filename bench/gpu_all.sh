#!/usr/bin/env bash
# Every core GPU check and benchmark in one call (no ROS), for the GPU machine:
#   bash bench/gpu_all.sh OUT_DIR [--quick] [--run-all]
# 1. the CUDA tests (pytest -m cuda: test_cuda.py, test_cuda_policies.py)
# 2. bench/cuda_check.py           -> OUT/cuda_check.json
# 3. bench/flight_bench.py         -> OUT/flight.json
# 4. bench/policies_bench.py       -> OUT/policies.json
# 5. with --run-all: bench/run_all.py -> OUT/latest.json, OUT/latest.md (step, capsules,
#    re-prefill; about 3 minutes more, so it does not fit one 10-minute device call with the rest)
# Each part has its own time limit so a slow one cannot eat the others; the script's exit status
# is non-zero when any part failed (a failed check, a failed test, a crash or a timeout), and its
# last line names them. Logs: OUT/gpu_all.log.
set -uo pipefail
OUT="${1:?usage: bash bench/gpu_all.sh OUT_DIR [--quick]}"
QUICK="" RUN_ALL=""
for a in "${@:2}"; do
  case "$a" in --quick) QUICK=--quick ;; --run-all) RUN_ALL=1 ;; *) echo "unknown option $a" >&2; exit 2 ;; esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHRT_REQUIRE_CUDA=1
PY="${PYTHON:-python3}"
LOG="$OUT/gpu_all.log"
failed=()

part() {  # part NAME LIMIT_S CMD...
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS rc=0
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1 || rc=$?
  echo "=== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || failed+=("$name(rc $rc)")
}

"$PY" -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' | tee -a "$LOG"
part pytest_cuda 180 "$PY" -m pytest -q -p no:cacheprovider -m cuda test/test_cuda.py test/test_cuda_policies.py
part cuda_check 60 "$PY" bench/cuda_check.py --out "$OUT"
part flight_bench 90 "$PY" bench/flight_bench.py --out "$OUT" $QUICK
part policies_bench 180 "$PY" bench/policies_bench.py --out "$OUT/policies.json" $QUICK
[ -z "$RUN_ALL" ] || part run_all 300 "$PY" bench/run_all.py --out "$OUT" $QUICK

if [ ${#failed[@]} -gt 0 ]; then
  echo "bench/gpu_all.sh: FAILED: ${failed[*]}" | tee -a "$LOG"
  exit 1
fi
echo "bench/gpu_all.sh: every part passed" | tee -a "$LOG"
