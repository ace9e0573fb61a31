#!/usr/bin/env bash
# The twenty-eighth part's goals calls (2026-12-06), on one H100 (NVIDIA H100 80GB HBM3), the
# tree of 588e73a (checked: 2026-12-06-588e73a-device-tree.md5):
#   call 9: run(command="bash bench/results/2026-12-06-28-gpu-goals.sh", carry=[".whl312"])
#       (this script, under its name then) -> -588e73a-goals-1.*, -host-gate-1.json,
#       -pytest-cuda.log, -service-profile.json
#   call 10 (the machine held warm): the goals run alone, `GATE_LOOP_S=0.85
#       GATE_SLEEP_P99_US=110 timeout 440 bash bench/ros_gpu.sh $R/ros --busy-wait --goals`
#       -> -588e73a-goals-2.*, -host-gate-2.json
# This script: the #12 goals run when the host passes the gate (exit 3 in ~6 s when not);
# then the CUDA tests and the node's service profile on the same tree. At most 8 files come
# back from $OUT.
O=$OUT; R=/tmp/r; rm -rf $R; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader > $O/gpu.txt
(find flashrt_ros bench msg srv launch config -type f -not -path '*/results/*' -not -name '*.pyc' | sort | xargs md5sum) > $O/tree.md5
GATE_LOOP_S=0.85 GATE_SLEEP_P99_US=110 timeout ${GOALS_S:-420} bash bench/ros_gpu.sh $R/ros --busy-wait --goals > $O/ros.log 2>&1; rc=$?
for f in host_gate.json ros.json ros_logs.tgz; do cp $R/ros/$f $O/ 2>/dev/null; done
tail -45 $O/ros.log
[ $rc = 3 ] && exit 3
FLASHRT_REQUIRE_CUDA=1 timeout 150 python3 -m pytest -q -m cuda test/test_cuda*.py > $O/pytest-cuda.log 2>&1; echo "cuda tests rc $?"; tail -1 $O/pytest-cuda.log
mkdir -p /tmp/sp && (. ./env.sh && timeout 90 python bench/service_profile.py --device cuda --busy-wait --out /tmp/sp/sp.json > /tmp/sp/sp.log 2>&1; echo "profile rc $?")
tar czf $O/sp.tgz -C /tmp/sp sp.json sp.parts.json sp.log 2>/dev/null
exit $rc
