"""Whether the first launches of a step's kernels (CUDA lazy loading) go faster from several
threads: the question behind the node's start-up gap.

An unfused node's start is the bare rclpy + torch floor plus ~0.45 s of first calls in the
step's warm-up, each op's kernel loaded on its first launch. If the driver loaded kernels in
parallel, threads could warm them beside the node's other start-up work. Each start is a new
process (cold kernels): 32 distinct ops, run in one thread or split over N threads, then again
(warm).

    python3 bench/kernel_load_probe.py --out DIR [--rounds 3] [--threads 0,2,4,8]

Writes DIR/kernel_load_probe.json; 0 threads means all ops in the calling thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, sys, threading, time
t0 = time.perf_counter()
import torch
t_imp = time.perf_counter() - t0
threads = int(sys.argv[1])
x = torch.zeros(64, 64, device="cuda"); torch.cuda.synchronize()
i = torch.zeros(64, dtype=torch.int64, device="cuda")
m = torch.zeros(64, 64, dtype=torch.bool, device="cuda")
ln = torch.nn.LayerNorm(64).cuda()
F = torch.nn.functional
ops = [
    lambda: x + 1, lambda: x * 2, lambda: x - x, lambda: x / 3, lambda: x.masked_fill(m, 0.0),
    lambda: x.remainder(2.0), lambda: torch.softmax(x, -1), lambda: ln(x), lambda: F.gelu(x),
    lambda: F.silu(x), lambda: torch.log(x + 1), lambda: torch.clamp(x, 0, 1),
    lambda: torch.cat([x, x]), lambda: x.clone().index_copy_(0, i, x), lambda: x.sum(-1),
    lambda: x < 1, lambda: i >> 1, lambda: i & 3, lambda: x @ x, lambda: torch.exp(x),
    lambda: torch.sqrt(x), lambda: torch.where(m, x, 1.0), lambda: x.cumsum(0),
    lambda: torch.sort(x, -1), lambda: torch.topk(x, 3), lambda: x.to(torch.float16),
    lambda: ~m, lambda: torch.sin(x), lambda: torch.tanh(x), lambda: x.max(-1),
    lambda: x.argmax(-1), lambda: torch.einsum("ij,jk->ik", x, x),
]
def run(part):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for f in part:
            f()
    s.synchronize()
t0 = time.perf_counter()
if threads == 0:
    run(ops)
else:
    ts = [threading.Thread(target=run, args=(ops[k::threads],)) for k in range(threads)]
    [t.start() for t in ts]
    [t.join() for t in ts]
first = time.perf_counter() - t0
t0 = time.perf_counter()
run(ops)
again = time.perf_counter() - t0
print(json.dumps({"threads": threads, "ops": len(ops), "import_torch_s": round(t_imp, 3),
                  "first_s": round(first, 4), "again_s": round(again, 4)}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for kernel_load_probe.json")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per thread count")
    ap.add_argument("--threads", default="0,2,4,8", help="thread counts, comma-separated")
    args = ap.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",")]
    if args.rounds < 1 or any(t < 0 for t in counts):
        ap.error("--rounds must be >= 1 and thread counts >= 0")
    runs = []
    for _ in range(args.rounds):
        for n in counts:
            cmd = [sys.executable, "-c", CHILD, str(n)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(r.stderr[-2000:], file=sys.stderr)
                return 1
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(json.dumps(runs[-1]), flush=True)
    summary = {
        str(n): statistics.median(r["first_s"] for r in runs if r["threads"] == n) for n in counts
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = {"runs": runs, "median_first_s_by_threads": summary}
    (args.out / "kernel_load_probe.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"median_first_s_by_threads": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
