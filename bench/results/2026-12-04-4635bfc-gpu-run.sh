#!/usr/bin/env bash
# session-18 GPU call 1 (at 4635bfc, the seventeenth part's last commit): CUDA tests, then the
# full ROS run. The ROS run was cut by its 420 s timeout during the camera phases (a slower
# machine than the next call's: cold start 27.2 s against 23.5 s), so it left no ros.json;
# its log is 2026-12-04-4635bfc-ros-full-cut.log.
# Command: run(command="bash gpu_run.sh", carry=[".whl312"]).
O=$OUT
(git rev-parse HEAD; git status --short) > $O/device-tree.txt
t0=$(date +%s)
FLASHRT_REQUIRE_CUDA=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m cuda test/test_cuda.py test/test_cuda_policies.py test/test_cuda_skinny.py test/test_precompiled.py test/test_cuda_latefuse.py test/test_prewarm.py test/test_capsules.py test/test_engine_errors.py test/test_flight.py test/test_policy_mistakes.py > $O/pytest-cuda.log 2>&1
echo "pytest rc $? $(( $(date +%s) - t0 ))s: $(tail -1 $O/pytest-cuda.log)"
timeout 420 bash bench/ros_gpu.sh $O/ros --busy-wait --seconds-flight 0 > $O/ros-full.log 2>&1; echo "ros rc $? $(( $(date +%s) - t0 ))s"
cp $O/ros/ros.json $O/ros-full.json; cp $O/ros/ros_logs.tgz $O/ros-full-logs.tgz; rm -rf $O/ros
grep -E "^ros:" $O/ros-full.log | tail -1
