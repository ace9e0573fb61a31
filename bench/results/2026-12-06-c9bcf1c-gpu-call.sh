#!/usr/bin/env bash
# The twenty-eighth part's (2026-12-06) calls before the goals, each run(..., carry=[".whl312"]) on an
# H100 (NVIDIA H100 80GB HBM3); gate stops in 2026-12-06-slow-gates.json (part 28):
#   calls 1, 2 (0e5dae4): the command of 2026-12-06-3fa2188-gpu-call.sh; the gate stopped both
#   call 3 (call 2's machine, 0e5dae4): that command, then on the gate's exit 3 the setup through
#       `bash bench/ros_gpu.sh $O/ros --busy-wait --quick --only services` and
#       `python bench/service_profile.py --device cuda --busy-wait` (its parts came back empty:
#       the SIGUSR1 handler, replaced by a thread at 58785fc)
#   call 4 (another machine, 58785fc): the same, plus capsule_probe.py --gap-ms 2 --gap-spin;
#       the outputs were lost (more than 8 files under $OUT) but for the probe ("before" in
#       2026-12-06-c9bcf1c-capsule-probe-launch.json); call 5 found nothing left on the machine
#   call 6 (call 4's machine): the profile alone -> 2026-12-06-58785fc-slow-host-service-profile.json
#   call 7 (another machine, c9bcf1c): this script, run under the name 2026-12-06-28-gpu-call.sh
#       (slow host: CUDA tests -> 2026-12-06-c9bcf1c-pytest-cuda.log; probes -> "runs" of
#       2026-12-06-c9bcf1c-capsule-probe-launch.json; the rest lost to the 8-file limit)
#   call 8 (call 7's machine): the profile alone -> 2026-12-06-c9bcf1c-slow-host-service-profile.json
# Calls 9-10 are 2026-12-06-588e73a-gpu-goals.sh; call 11 the pinned probes ("pinned" in the
# capsule-probe-launch file, its command there).
# This script: the goals run when the host passes the gate; then, on any host, the CUDA
# tests, the checkpoint probe launched both ways (no ROS; --launch is gone since b8a2966)
# and the node's service profile.
O=$OUT; nvidia-smi --query-gpu=name --format=csv,noheader > $O/gpu.txt
(find flashrt_ros bench msg srv launch config -type f -not -path '*/results/*' -not -name '*.pyc' | sort | xargs md5sum) > $O/tree.md5
GATE_LOOP_S=0.85 GATE_SLEEP_P99_US=110 timeout ${GOALS_S:-420} bash bench/ros_gpu.sh $O/ros --busy-wait --goals > $O/ros.log 2>&1; rc=$?
if [ $rc = 3 ]; then  # a slow host: the setup (venv, build) through a quick services row
  timeout 150 bash bench/ros_gpu.sh $O/ros --busy-wait --quick --only services > $O/ros_slow.log 2>&1
  echo "slow-host services rc $?"; grep "services (" $O/ros_slow.log
fi
for f in host_gate.json ros.json ros_logs.tgz; do cp $O/ros/$f $O/ 2>/dev/null; done
rm -rf $O/ros; tail -45 $O/ros.log
FLASHRT_REQUIRE_CUDA=1 timeout 150 python3 -m pytest -q -m cuda test/test_cuda*.py > $O/pytest-cuda.log 2>&1; echo "cuda tests rc $?"; tail -2 $O/pytest-cuda.log
i=0; for l in graph direct graph direct; do i=$((i+1)); f=$O/probe-$i-$l.json; timeout 60 python3 bench/capsule_probe.py --gap-ms 2 --gap-spin --launch $l --out $f > /dev/null 2>&1; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[1], d['p50_us'])" $f; done
mkdir -p /tmp/sp && (. ./env.sh && timeout 100 python bench/service_profile.py --device cuda --busy-wait --out /tmp/sp/sp.json > $O/sp.log 2>&1; echo "profile rc $?")
cp /tmp/sp/sp.json /tmp/sp/sp.parts.json $O/ 2>/dev/null
exit $rc
