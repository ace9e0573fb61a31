#!/usr/bin/env bash
# session-18 GPU call at 6879fa9 (the kernels' shared add_lanes): the CUDA tests only.
# Command: run(command="bash gpu_run.sh", timeout_s=330)
O=$OUT
(git rev-parse HEAD; git status --short) > $O/device-tree.txt
t0=$(date +%s)
FLASHRT_REQUIRE_CUDA=1 timeout 280 python3 -m pytest -q -p no:cacheprovider -m cuda test/test_cuda.py test/test_cuda_policies.py test/test_cuda_skinny.py test/test_precompiled.py test/test_cuda_latefuse.py test/test_prewarm.py test/test_capsules.py test/test_engine_errors.py test/test_flight.py test/test_policy_mistakes.py > $O/pytest-cuda.log 2>&1
echo "pytest rc $? $(( $(date +%s) - t0 ))s: $(tail -1 $O/pytest-cuda.log)"
