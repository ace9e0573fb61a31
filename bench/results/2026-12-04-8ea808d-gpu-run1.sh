#!/usr/bin/env bash
# session-17 GPU call 1 (not committed): CUDA tests, capsule probe A/B, tick floor split,
# services-only ROS row and the in-node service profile
O=$OUT
(git rev-parse HEAD; git status --short) > $O/device-tree.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv > $O/gpu.txt 2>&1
t0=$(date +%s)
FLASHRT_REQUIRE_CUDA=1 timeout 240 python3 -m pytest -q -p no:cacheprovider -m cuda test/test_cuda.py test/test_cuda_policies.py test/test_cuda_skinny.py test/test_precompiled.py test/test_cuda_latefuse.py test/test_prewarm.py test/test_capsules.py test/test_engine_errors.py test/test_flight.py test/test_policy_mistakes.py > $O/pytest-cuda.log 2>&1
echo "pytest rc $? $(( $(date +%s) - t0 ))s: $(tail -1 $O/pytest-cuda.log)"
mkdir -p $O/cp
for g in "hot:" "spin:--gap-ms 2 --gap-spin" "sleep:--gap-ms 2"; do n=${g%%:*}; a=${g#*:}
  for k in one six; do x=""; [ $k = six ] && x=--six-nodes
    timeout 60 python3 bench/capsule_probe.py --n 300 $a $x --out $O/cp/$n-$k.json > /dev/null 2>&1 || echo "cp $n $k failed"
  done; done
echo "capsule_probe done $(( $(date +%s) - t0 ))s"
timeout 150 python3 bench/tick_floor.py --split --out $O/tfs.json > $O/tfs.log 2>&1; echo "tick_floor rc $? $(( $(date +%s) - t0 ))s"
bash bench/ros_gpu.sh $O/ros --busy-wait --only services --seconds-flight 0 > $O/ros-services.log 2>&1; echo "ros rc $? $(( $(date +%s) - t0 ))s"
. ./env.sh
timeout 120 python bench/service_profile.py --busy-wait --out $O/sp.json > $O/sp.log 2>&1; echo "sp rc $? $(( $(date +%s) - t0 ))s"
rm -rf $O/service_profile_logs/compile_cache
tar czf $O/logs.tgz -C $O ros service_profile_logs sp.log tfs.log 2>/dev/null; rm -rf $O/ros/ros_logs.tgz $O/service_profile_logs $O/sp.log
cp $O/ros/ros.json $O/ros-services.json 2>/dev/null; rm -rf $O/ros
