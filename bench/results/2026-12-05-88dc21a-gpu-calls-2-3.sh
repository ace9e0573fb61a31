#!/usr/bin/env bash
# session-22 GPU calls 2 and 3 (NVIDIA H100 80GB HBM3; the tree of 88dc21a; the device's git
# metadata is older: call2-device-tree.txt lists the files that differ from it). Call 1 is
# 2026-12-05-88dc21a-gpu-call1.sh (CUDA tests 50 passed; SCHED_FIFO refused: EPERM as root).
# Call 2, run(command=..., carry=[".whl312"]) after `make setup` and `bash bench/fetch_whl312.sh`:
O=$OUT; (git status --short; nvidia-smi -L) > $O/device-tree.txt 2>&1; t0=$(date +%s)
timeout 570 bash bench/ros_gpu.sh $O/ros --busy-wait --seconds-flight 0 > $O/ros-full.log 2>&1
echo "ros rc $? $(( $(date +%s) - t0 ))s"; cp $O/ros/ros.json $O/ros-full.json
cp $O/ros/ros_logs.tgz $O/ros-full-logs.tgz; rm -rf $O/ros
# Call 3 (a fresh H100 machine):
timeout 300 python3 bench/policies_bench.py --out $O/policies.json > $O/policies.log 2>&1
timeout 120 python3 bench/policies_bench.py --only builtin:diffusion/lerobot-100 --no-floor \
  --out $O/policies-lerobot-100.json > $O/policies-lerobot-100.log 2>&1
timeout 100 python3 bench/queue_probe.py --spec builtin:act --size lerobot \
  --pin-variants none,pin,pin+spin --rounds 4 --ticks 3000 --out $O/queue-pin.json > $O/queue-pin.log 2>&1
