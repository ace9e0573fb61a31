"""Where a node's start-up time goes, without ROS: each phase of a fresh process, from the
interpreter's start to the first step, cold (empty compile caches) and warm (the same caches).

    python3 bench/start_profile.py --out DIR [--policy builtin:hybrid] [--device cuda]

Each start is a new process (what a `ros2 launch` pays): the node's bytecode cache
(node/bytecode.py, in the temporary folder; FLASHRT_PYCACHE=0 turns it off), import torch,
CUDA init, import flashrt_ros, load the policy, build the Engine (its build_s phases:
compile and capture, the checksum kernel...), the first step. Writes DIR/start_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
t = {"spawn_to_main": time.time() - float(sys.argv[1])}
t0 = time.perf_counter()
if os.environ.get("FLASHRT_PYCACHE") != "0":
    from flashrt_ros.node import bytecode
    t["bytecode"] = bytecode.enable()  # as the node does, before torch is imported
import torch
t["import_torch"] = time.perf_counter() - t0; t0 = time.perf_counter()
dev = sys.argv[2]
if dev.startswith("cuda"):
    torch.zeros(1, device=dev); torch.cuda.synchronize()
t["cuda_init"] = time.perf_counter() - t0; t0 = time.perf_counter()
import numpy as np
from flashrt_ros import Engine, load_policy
t["import_flashrt"] = time.perf_counter() - t0; t0 = time.perf_counter()
policy = load_policy(sys.argv[3])
t["load_policy"] = time.perf_counter() - t0; t0 = time.perf_counter()
fuse = {"auto": None, "on": True, "off": False}[sys.argv[5]]
prof = sys.argv[6] if len(sys.argv) > 6 else ""
if prof:
    import cProfile
    pr = cProfile.Profile()
    pr.enable()
e = Engine(policy, device=dev, compile_cache_dir=sys.argv[4] or None, fuse=fuse)
t["engine"] = time.perf_counter() - t0
if prof:
    pr.disable()
    pr.dump_stats(prof)
t.update({"engine." + k: v for k, v in e.build_s.items()})
t0 = time.perf_counter()
spec = e.observation_spec()
def zeros(v):
    return np.zeros(v["shape"], dtype=np.float32 if v["kind"] == "vector" else np.uint8)
obs = {k: zeros(v) for k, v in spec.items()}
if len(obs) == 1:
    obs = next(iter(obs.values()))
e.step(obs)
t["first_step"] = time.perf_counter() - t0
t["total_from_spawn"] = time.time() - float(sys.argv[1])
t["fused"] = e.fuse
out = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in t.items()}
print("PROFILE " + json.dumps(out))
"""


def start(
    policy: str, device: str, cache: str, fuse: str, prof: str = "", env_extra: dict | None = None
) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    env.update(env_extra or {})
    t = time.time()
    r = subprocess.run(
        [sys.executable, "-c", CHILD, repr(t), device, policy, cache, fuse, prof],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    for line in r.stdout.splitlines():
        if line.startswith("PROFILE "):
            return json.loads(line[8:])
    return {"error": r.returncode, "stderr_tail": r.stderr[-2000:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--policy", default="builtin:hybrid")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--cprofile",
        action="store_true",
        help="also a third warm start with the Engine's build under cProfile: OUT/warm.prof and "
        "its 60 costliest calls (cumulative) and 30 (own time) in OUT/warm_profile.txt",
    )
    ap.add_argument(
        "--cprofile-unfused",
        action="store_true",
        help="also an unfused start (fuse off) with the Engine's build under cProfile: "
        "OUT/unfused.prof and OUT/unfused_profile.txt, as --cprofile",
    )
    ap.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one more warm start with these variables set (row warm_env); repeatable",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = {}
    with tempfile.TemporaryDirectory() as cache:
        if "FLASHRT_PYCACHE" not in os.environ:  # the node's bytecode cache, cold at first
            os.environ["FLASHRT_PYCACHE"] = str(Path(cache) / "pycache")
        rows["cold"] = start(args.policy, args.device, cache, "auto")
        rows["warm"] = start(args.policy, args.device, cache, "auto")
        rows["warm2"] = start(args.policy, args.device, cache, "auto")
        rows["unfused"] = start(args.policy, args.device, cache, "off")
        if args.env:
            extra = dict(e.split("=", 1) for e in args.env)
            rows["warm_env"] = {
                "env": extra,
                **start(args.policy, args.device, cache, "auto", env_extra=extra),
            }
        for on, name, fuse in (
            (args.cprofile, "warm", "auto"),
            (args.cprofile_unfused, "unfused", "off"),
        ):
            if not on:
                continue
            prof = out / f"{name}.prof"
            rows[f"{name}_cprofile"] = start(args.policy, args.device, cache, fuse, str(prof))
            import io
            import pstats

            text = io.StringIO()
            pstats.Stats(str(prof), stream=text).sort_stats("cumulative").print_stats(60)
            pstats.Stats(str(prof), stream=text).sort_stats("tottime").print_stats(30)
            (out / f"{name}_profile.txt").write_text(text.getvalue())
    for k, v in rows.items():
        print(k, v, flush=True)
    (out / "start_profile.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
