"""Where a late-fusing build stalls the stepping thread: the long C calls of the build thread.

    python3 bench/gil_gap_probe.py --out DIR [--policy builtin:hybrid] [--call-ms 5]

A fresh process fills a compile cache and the node's bytecode cache (a fused Engine, as a
node's first start does); a second fresh process builds an Engine with late_fuse on those caches
and steps it at 500 Hz, busy-waiting, until the fused step is swapped in and 2 s more. A
profile function in the build thread records each C call of at least `--call-ms` that ran no
Python inside (a C function that holds the GIL that long stalls every other Python thread; pure
Python hands the GIL over at the switch interval). Writes DIR/gil_gap_probe.json: the step
intervals, and for each gap over 10 periods the build thread's long C calls and the cyclic
garbage collector's passes (gc.callbacks) overlapping it.
No ROS: the stalls are between two threads of one process. (faulthandler's watchdog, which
dumps stacks without the GIL, crashed the process.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, threading, time
from flashrt_ros.node import bytecode
os.environ["FLASHRT_PYCACHE"] = os.path.join(sys.argv[2], "pycache")
bytecode.enable()  # as the node does: the fill run writes it, the late run reads it
import numpy as np
from flashrt_ros import Engine, load_policy
from flashrt_ros.runtime import latefuse
policy, cache, mode, dev = sys.argv[1:5]
min_s = float(sys.argv[5])
if mode == "fill":
    e = Engine(load_policy(policy), device=dev, fuse=True, compile_cache_dir=cache)
    print("RESULT " + json.dumps({"fused": e.fused, "events": e.precompiled.events}))
    sys.exit(0)
# the build thread's leaf C calls (no Python ran inside) of at least min_s: (start, end, what)
calls, open_calls = [], []  # open: [start, has_python] per C call in flight, innermost last
def prof(frame, event, arg):
    if event == "c_call":
        open_calls.append([time.perf_counter(), False])
    elif event in ("c_return", "c_exception"):
        if not open_calls:
            return
        t0, nested = open_calls.pop()
        t1 = time.perf_counter()
        if not nested and t1 - t0 >= min_s:
            where = f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
            if frame.f_code.co_name == "_compile_bytecode":  # which module's bytecode
                loc = frame.f_locals
                where += f" {loc.get('name')} {loc.get('bytecode_path') or loc.get('source_path')}"
            calls.append((t0, t1, getattr(arg, "__qualname__", str(arg)), where))
    elif event == "call":
        for c in open_calls:
            c[1] = True
import gc
gcs, gc_t0 = [], [0.0]  # the collector's passes: (start, end, generation, thread)
def on_gc(phase, info):
    if phase == "start":
        gc_t0[0] = time.perf_counter()
    else:
        name = threading.current_thread().name
        gcs.append((gc_t0[0], time.perf_counter(), info["generation"], name))
gc.callbacks.append(on_gc)
real_run = latefuse.LateFuse._run
def run(self):
    sys.setprofile(prof)
    try:
        real_run(self)
    finally:
        sys.setprofile(None)
latefuse.LateFuse._run = run
e = Engine(load_policy(policy), device=dev, fuse=True, compile_cache_dir=cache, late_fuse=True)
obs = np.zeros(e.obs_dim, np.float32)
period, stamps, end = 0.002, [], None
t_next = time.perf_counter()
while len(stamps) < 60 * 500:
    while time.perf_counter() < t_next:
        pass
    stamps.append(time.perf_counter())
    e.step(obs)
    t_next = max(t_next + period, time.perf_counter())
    if end is None and not e.fusing:
        end = time.perf_counter() + 2.0
    if end is not None and time.perf_counter() > end:
        break
st = np.array(stamps)
dt = np.diff(st)
gaps = [(float(st[i]), float(st[i + 1])) for i in np.nonzero(dt > 10 * period)[0]]
def row(c0, c1, n, w):
    return dict(ms=round((c1 - c0) * 1e3, 1), call=n, at=w)
def during(a, b):  # the long C calls that overlap a gap
    return [row(*c) for c in calls if c[0] < b and c[1] > a]
def gc_row(g0, g1, gen, name):
    return dict(ms=round((g1 - g0) * 1e3, 1), generation=gen, thread=name)
def gc_during(a, b):  # the collector's passes over 1 ms that overlap a gap
    return [gc_row(*g) for g in gcs if g[0] < b and g[1] > a and g[1] - g[0] > 1e-3]
print("RESULT " + json.dumps({
    "late_fuse": e.late_fuse, "steps": len(stamps),
    "intervals_over_2_periods": int((dt > 2 * period).sum()),
    "longest_ms": sorted(round(float(x) * 1e3, 2) for x in dt)[-10:],
    "gaps_over_10_periods": [
        dict(ms=round((b - a) * 1e3, 1), c_calls=during(a, b), gc=gc_during(a, b))
        for a, b in gaps
    ],
    "gc_passes_over_1ms": [gc_row(*g) for g in gcs if g[1] - g[0] > 1e-3],
    "long_c_calls": [row(*c) for c in calls],
}))
"""


def child(args, mode: str, cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    min_s = str(args.call_ms / 1e3)
    cmd = [sys.executable, "-c", CHILD, args.policy, cache, mode, args.device, min_s]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": r.returncode, "stderr_tail": r.stderr[-3000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--policy", default="builtin:hybrid")
    ap.add_argument("--call-ms", type=float, default=5.0, help="C calls this long are listed")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as cache:
        fill = child(args, "fill", cache)
        late = child(args, "late", cache)
    res = {"fill": fill, "late": late, "call_ms": args.call_ms}
    (out / "gil_gap_probe.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=1)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
