"""Two fused engines in one process, on cold caches: does the second one's capture survive a
change of the compile cache folder between them? (A node reconfigured with another policy after
a cleanup builds its second engine in the same process, under another fingerprint's folder.)

    python3 bench/cache_switch_probe.py --out DIR [--scenarios a,b,...]

Each scenario is a fresh process whose torch-default caches (TORCHINDUCTOR_CACHE_DIR,
TRITON_CACHE_DIR) and compile_cache_dir root are new empty folders under DIR; it builds the
engines in order, steps each 24 times and records what failed (build, capture or step).
Results: DIR/cache_switch_probe.json.
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

# name -> [(policy spec, cache folder: "root" (compile_cache_dir=ROOT/cc), "none"), ...]
SCENARIOS = {
    "same_policy_twice": [("builtin:hybrid", "root"), ("builtin:hybrid", "root")],
    "two_policies_two_folders": [("builtin:hybrid", "root"), ("builtin:act", "root")],
    "folder_then_default": [("builtin:hybrid", "root"), ("builtin:act", "none")],
    "default_then_folder": [("builtin:act", "none"), ("builtin:hybrid", "root")],
    "act_then_hybrid_folders": [("builtin:act", "root"), ("builtin:hybrid", "root")],
    "late_fuse_two_policies": [("builtin:hybrid", "root+late"), ("builtin:act", "root+late")],
}

CHILD = r"""
import json, sys, time, traceback
sys.path.insert(0, {root!r})
sys.path.insert(0, {bench!r})
import torch
from flashrt_ros import Engine, load_policy
from policies_bench import observations
out = []
for spec, where in {engines!r}:
    row = {{"policy": spec, "cache": where}}
    t0 = time.perf_counter()
    try:
        kw = {{"compile_cache_dir": {cc!r} if where.startswith("root") else None}}
        eng = Engine(load_policy(spec), device="cuda", seed=0, late_fuse="late" in where, **kw)
        row["built_s"] = round(time.perf_counter() - t0, 2)
        row["folder"] = str(eng.compile_cache)
        obs = observations(eng, 24)
        for o in obs:
            eng.step(o)
        if eng.fusing:
            eng.finish_fusing()
            for o in obs:
                eng.step(o)
        torch.cuda.synchronize()
        row["fused_served"] = not eng.fused_mismatch and bool(eng.fuse)
        row["mismatch"] = eng.fused_mismatch
        row["late_fuse"] = eng.late_fuse
        row["ok"] = True
    except Exception as e:
        row["ok"] = False
        row["error"] = f"{{type(e).__name__}}: {{str(e)[:600]}}"
        row["trace"] = traceback.format_exc()[-3000:]
    row["total_s"] = round(time.perf_counter() - t0, 2)
    out.append(row)
    print("ROW " + json.dumps(row), flush=True)
"""


def run(name: str, engines: list, base: Path) -> dict:
    d = base / name
    d.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(d / "default_inductor")
    env["TRITON_CACHE_DIR"] = str(d / "default_triton")
    code = CHILD.format(
        root=str(ROOT), bench=str(ROOT / "bench"), engines=engines, cc=str(d / "cc")
    )
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env
    )
    rows = [json.loads(ln[4:]) for ln in p.stdout.splitlines() if ln.startswith("ROW ")]
    (d / "stderr.txt").write_text(p.stderr)
    return {
        "scenario": name,
        "engines": engines,
        "rc": p.returncode,
        "seconds": round(time.perf_counter() - t0, 1),
        "rows": rows,
        "ok": p.returncode == 0 and len(rows) == len(engines) and all(r["ok"] for r in rows),
        "stderr_tail": p.stderr[-1500:],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for caches and results")
    ap.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help=f"comma list of {', '.join(SCENARIOS)}"
    )
    a = ap.parse_args()
    names = [s for s in a.scenarios.split(",") if s]
    unknown = [s for s in names if s not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for n in names:
        r = run(n, SCENARIOS[n], a.out / "runs")
        results.append(r)
        print(f"{n}: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']} s", flush=True)
        for row in r["rows"]:
            print(f"  {row['policy']} ({row['cache']}): {row.get('error', 'ok')}", flush=True)
    (a.out / "cache_switch_probe.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
