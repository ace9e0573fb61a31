#!/usr/bin/env bash
# session-18 GPU calls at the final code. A: the full ROS run; B: the CUDA tests.
# Commands: run(command="bash gpu_run.sh A", carry=[".whl312"]) (after `make setup` and
# `bash bench/fetch_whl312.sh` here), then run(command="bash gpu_run.sh B"). The device's git
# metadata was that of 4635bfc; the tree sent was a427abb's (device-tree.txt lists the changes).
O=$OUT
(git rev-parse HEAD; git status --short) > $O/device-tree.txt
t0=$(date +%s)
if [ "$1" = A ]; then
  timeout 575 bash bench/ros_gpu.sh $O/ros --busy-wait --seconds-flight 0 > $O/ros-full.log 2>&1; echo "ros rc $? $(( $(date +%s) - t0 ))s"
  cp $O/ros/ros.json $O/ros-full.json; cp $O/ros/ros_logs.tgz $O/ros-full-logs.tgz; rm -rf $O/ros
  grep -E "^ros:" $O/ros-full.log | tail -1
else
  FLASHRT_REQUIRE_CUDA=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda test/test_cuda.py test/test_cuda_policies.py test/test_cuda_skinny.py test/test_precompiled.py test/test_cuda_latefuse.py test/test_prewarm.py test/test_capsules.py test/test_engine_errors.py test/test_flight.py test/test_policy_mistakes.py test/test_capsule_store.py > $O/pytest-cuda.log 2>&1
  echo "pytest rc $? $(( $(date +%s) - t0 ))s: $(tail -1 $O/pytest-cuda.log)"
fi
