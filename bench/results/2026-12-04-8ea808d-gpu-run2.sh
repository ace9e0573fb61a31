#!/usr/bin/env bash
# session-17 GPU call 2 (not committed): capsule probe A/B (summaries on stdout), then the full ROS run
O=$OUT
(git rev-parse HEAD; git status --short) > $O/device-tree.txt
mkdir -p $O/cp
for g in "hot:" "spin:--gap-ms 2 --gap-spin" "sleep:--gap-ms 2"; do n=${g%%:*}; a=${g#*:}
  for k in one six; do x=""; [ $k = six ] && x=--six-nodes
    timeout 60 python3 bench/capsule_probe.py --n 300 $a $x --out $O/cp/$n-$k.json > /dev/null 2>&1 || echo "cp $n $k failed"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], sys.argv[3], d['pass'], 'p50', d['p50_us'], 'p99', d['p99_us'])" $O/cp/$n-$k.json $n $k
  done; done
(cd $O && tar czf capsule_probe.tgz cp && rm -rf cp)
bash bench/ros_gpu.sh $O/ros --busy-wait --seconds-flight 0 > $O/ros-full.log 2>&1; echo "ros rc $?"
cp $O/ros/ros.json $O/ros-full.json; cp $O/ros/ros_logs.tgz $O/ros-full-logs.tgz; rm -rf $O/ros
tail -3 $O/ros-full.log
