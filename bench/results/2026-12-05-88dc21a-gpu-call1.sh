#!/usr/bin/env bash
# session-22 GPU call 1: the CUDA tests at the code sent, then the queue tick under the
# stepping thread's scheduling variants (SCHED_FIFO, a wait that never blocks), and the bare
# tick floor in the same process scheduling (normal, then chrt -f 50 on one core).
O=$OUT
(git log -1 --format=%H 2>/dev/null; git status --short; echo "uid $(id -u)"; nvidia-smi -L; nproc) > $O/device-tree.txt 2>&1
t0=$(date +%s)
FLASHRT_REQUIRE_CUDA=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -m cuda test/test_cuda.py test/test_cuda_policies.py test/test_cuda_skinny.py test/test_precompiled.py test/test_cuda_latefuse.py test/test_prewarm.py test/test_capsules.py test/test_engine_errors.py test/test_flight.py test/test_policy_mistakes.py test/test_capsule_store.py > $O/pytest-cuda.log 2>&1
echo "pytest rc $? $(( $(date +%s) - t0 ))s: $(tail -1 $O/pytest-cuda.log)"
timeout 150 python3 bench/queue_probe.py --spec builtin:act --size lerobot --pin-variants none,pin,pin+spin,fifo+pin,fifo+pin+spin --rounds 4 --ticks 3000 --out $O/queue-fifo.json > $O/queue-fifo.log 2>&1
echo "queue probe rc $? $(( $(date +%s) - t0 ))s"; tail -5 $O/queue-fifo.log
timeout 60 python3 bench/tick_floor.py --ticks 3000 --out $O/floor-normal.json > $O/floor.log 2>&1
echo "floor rc $? $(( $(date +%s) - t0 ))s"
timeout 60 chrt -f 50 taskset -c 3 python3 bench/tick_floor.py --ticks 3000 --out $O/floor-fifo.json >> $O/floor.log 2>&1
echo "floor fifo rc $? $(( $(date +%s) - t0 ))s"; grep -h -o '"steady"[^}]*}' $O/floor-*.json
