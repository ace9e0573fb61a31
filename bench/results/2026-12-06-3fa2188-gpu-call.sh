#!/usr/bin/env bash
# session-27 GPU calls, each run(command=..., carry=[".whl312"]) after `make setup` and
# `bash bench/fetch_whl312.sh`. Each call's tree is the md5 of every file of flashrt_ros, bench,
# msg, srv, launch, config (results/ left out), checked against the commit named:
#   calls 1, 2, 3, 5 (four H100s, a3d80ea): the sleep gate stopped them before the setup
#       (p99 251.9, 119.2, 246.3, 271.6 us against 110) -> 2026-12-06-slow-gates.json
#   call 4 (call 3's machine): `python3 bench/host_gate.py --max-loop-s 0.85
#       --max-sleep-p99-us 110` three times: p99 309.3, 296.2, 316.1 us (no file)
#   call 6 (call 5's machine, a3d80ea, GATE_LOOP_S=0.85 only, with --ab-prebuild, an option
#       of ros_bench at a3d80ea taken out at 3fa2188): the engine made beside the imports on
#       and off, three rounds each -> -a3d80ea-slow-host-ab-prebuild.*, -a3d80ea-host-gate.json
#   calls 7, 8, 9 (three more H100s, 3fa2188; call 8 asked for kind nvidia-h200 and got an
#       H100): stopped by the gate (p99 221.0, 204.6, 138.3 us) -> 2026-12-06-slow-gates.json
#   calls 10, 11 (one H100 held warm, 3fa2188, -3fa2188-device-tree.md5): the command below,
#       each met every #12 goal but the checkpoint against the trivial service alone
#       -> -3fa2188-goals-{1,2}.*, -3fa2188-host-gate-{1,2}.json
O=$OUT; nvidia-smi --query-gpu=name --format=csv,noheader > $O/gpu.txt
(find flashrt_ros bench msg srv launch config -type f -not -path '*/results/*' -not -name '*.pyc' | sort | xargs md5sum) > $O/tree.md5
GATE_LOOP_S=0.85 GATE_SLEEP_P99_US=110 timeout 560 bash bench/ros_gpu.sh $O/ros --busy-wait --goals > $O/ros.log 2>&1; rc=$?
for f in host_gate.json ros.json ros_logs.tgz; do cp $O/ros/$f $O/ 2>/dev/null; done
rm -rf $O/ros; tail -45 $O/ros.log; exit $rc

# call 6 differed in two words: no GATE_SLEEP_P99_US=110, and `--goals --ab-prebuild`.
# call 11 ran `timeout 420` (the budget left), not 560.
