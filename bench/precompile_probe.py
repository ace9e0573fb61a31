"""Does torch's ahead-of-time precompile (`torch.compile(...).aot_compile`, loaded back with
`torch.compiler.load_compiled_function`) work for our fused step on this machine, and how much
of a warm start does it save? (Issue: warm start to the first command; AOTInductor crashed its
loader on the H200, bench/aot_probe.py.)

    python3 bench/precompile_probe.py --out DIR [--device cuda] [--spec builtin:hybrid]

Each phase is a fresh process over the same inductor/Triton cache folder (DIR/cache):
  compile: aot_compile of runtime/session.py's arena_step for the policy, saved to DIR/step.bin;
           one step on a fixed observation, its action and arena bytes saved as the reference;
  warm:    the path the engine takes today on a warm start: torch.compile, first call;
  load:    load_compiled_function from DIR/step.bin, one step (compared bit for bit with the
           reference), then the step captured in a CUDA graph and replayed (compared again).
Times per phase go to DIR/precompile_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
sys.path.insert(0, {root!r})
t_torch = time.perf_counter() - t0
from flashrt_ros import load_policy
from flashrt_ros.runtime import session as S
from flashrt_ros.runtime.engine import Engine
dev = {device!r}
eng = Engine(load_policy({spec!r}), device=dev, use_graph=False, fuse=False)
s = eng.session("main")
args = (eng.policy, s.arena.buf, s.obs, s.action, s.chunk, s.table, None, 0, None)
torch.manual_seed(0)
s.obs.copy_(torch.rand_like(s.obs))
start = s.arena.buf.clone()
sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
sync()
out = {{"import_torch_s": round(t_torch, 3)}}
t = time.perf_counter()
import torch._dynamo, torch._inductor.codecache  # noqa
out["import_compiler_s"] = round(time.perf_counter() - t, 3)
phase = {phase!r}
path = {path!r}
t = time.perf_counter()
if phase == "compile":
    if hasattr(torch._dynamo.config, "enable_aot_compile"):  # off by default in torch 2.11
        torch._dynamo.config.enable_aot_compile = True
    with torch.no_grad():
        fn = torch.compile(S.arena_step, fullgraph=True, dynamic=False).aot_compile((args, {{}}))
    out["aot_compile_s"] = round(time.perf_counter() - t, 3)
    t2 = time.perf_counter()
    fn.save_compiled_function(path)
    out["save_s"] = round(time.perf_counter() - t2, 3)
elif phase == "warm":
    fn = torch.compile(S.arena_step, fullgraph=True, dynamic=False)
else:
    with open(path, "rb") as f:
        fn = torch.compiler.load_compiled_function(f)
    out["load_s"] = round(time.perf_counter() - t, 3)
t = time.perf_counter()
with torch.no_grad():
    fn(*args)
sync()
out["first_call_s"] = round(time.perf_counter() - t, 3)
res = torch.cat([s.action.flatten().float(), s.arena.buf.float()]).cpu()
if phase == "compile":
    torch.save(res, path + ".ref")
else:
    ref = torch.load(path + ".ref")
    out["bitwise_equal_first"] = bool(torch.equal(res, ref))
if phase == "load" and dev.startswith("cuda"):
    s.arena.buf.copy_(start)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad(), torch.cuda.graph(g):
        fn(*args)
    s.arena.buf.copy_(start)
    g.replay()
    sync()
    res = torch.cat([s.action.flatten().float(), s.arena.buf.float()]).cpu()
    out["bitwise_equal_graph"] = bool(torch.equal(res, ref))
    ts = []
    for _ in range(200):
        t = time.perf_counter(); g.replay(); sync(); ts.append(time.perf_counter() - t)
    ts.sort()
    out["graph_replay_p50_us"] = round(ts[100] * 1e6, 1)
out["total_s"] = round(time.perf_counter() - t0, 3)
print("RESULT " + json.dumps(out), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--spec", default="builtin:hybrid")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(a.out / "cache" / "inductor")
    env["TRITON_CACHE_DIR"] = str(a.out / "cache" / "triton")
    path = str(a.out / "step.bin")
    report: dict = {"spec": a.spec, "device": a.device, "command": " ".join(sys.argv)}
    import torch

    report["torch"] = torch.__version__
    for phase in ("compile", "warm", "load", "load"):
        code = CHILD.format(root=str(ROOT), device=a.device, spec=a.spec, phase=phase, path=path)
        t = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
        )
        wall = round(time.perf_counter() - t, 3)
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        row = json.loads(got[-1][7:]) if got else {}
        row.update(rc=p.returncode, process_s=wall)
        if p.returncode or not got:
            row["tail"] = (p.stdout + p.stderr)[-3000:]
        key = phase if phase not in report else phase + "2"
        report[key] = row
        print(key, json.dumps(row)[:600], flush=True)
    (a.out / "precompile_probe.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
