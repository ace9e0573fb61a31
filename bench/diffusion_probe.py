"""Where the lerobot-size builtin:diffusion tick spends its time on CUDA, and what a compiled
denoiser step (one UNet call, compiled once, called K times) gives inside our graph.

    python3 bench/diffusion_probe.py --out DIR [--steps 10] [--modes eager,base,unet]

Modes: eager (no graph), cublas (captured, cuBLAS for the products), base (captured, with
cuda/skinny.py), unet / unet_tf / unet_ma / unet_cublas (the UNet compiled: default, with TF32
matmuls, max-autotune, or without the kernel).

Writes DIR/diffusion_probe.json. An exploration tool, not part of the bench suite.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.policies_bench import observations  # noqa: E402
from flashrt_ros import Engine, load_policy  # noqa: E402
from flashrt_ros.cuda import skinny  # noqa: E402


def infer_ticks(eng: Engine, n: int, o: dict) -> tuple[list[float], np.ndarray]:
    """Host wall time (us) of the next `n` infer ticks (queue ticks run, untimed), and the
    last action."""
    out = []
    while len(out) < n:
        kind = eng.next_tick_kind()
        t0 = time.perf_counter()
        a = eng.step(o)
        if kind == "infer":
            out.append((time.perf_counter() - t0) * 1e6)
    return out, a


def graph_us(fn, calls: int = 20, replays: int = 10) -> float:
    """Device time per call of `fn`, captured `calls` times in one graph and replayed."""
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (calls * replays) * 1e6


def gemm_table() -> list[dict]:
    """The UNet's products (M = horizon rows, batch 1): cuBLAS (F.linear) and cuda/skinny.py."""
    rows = []
    for m, k, n in [
        (16, 512 * 5, 512),
        (8, 1024 * 5, 1024),
        (4, 2048 * 5, 2048),
        (8, 4096 * 5, 1024),
        (16, 2048 * 5, 512),
    ]:
        x = torch.randn(1, m, k, device="cuda")
        w = torch.randn(n, k, device="cuda")
        row = {"m": m, "k": k, "n": n}
        for name, fn in (("cublas", torch.nn.functional.linear), ("skinny", skinny.linear)):
            us = graph_us(lambda fn=fn, x=x, w=w: fn(x, w))
            row[f"{name}_us"] = round(us, 2)
            row[f"{name}_GBps"] = round(k * n * 4 / us / 1e3, 1)
        rows.append(row)
    return rows


def make_engine(policy, device: str, graph: bool) -> Engine:
    return Engine(
        policy, device=device, capsule_slots=2, use_graph=graph and device == "cuda", fuse=False
    )


def profile(eng: Engine, o: dict) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    infer_ticks(eng, 2, o)
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        infer_ticks(eng, 1, o)
        torch.cuda.synchronize()
    ev = p.key_averages()
    rows = sorted(
        ({"name": e.key[:90], "n": e.count, "us": round(e.device_time_total, 1)} for e in ev),
        key=lambda r: -r["us"],
    )
    return {
        "kernels": sum(r["n"] for r in rows),
        "total_us": round(sum(r["us"] for r in rows), 1),
        "top": rows[:25],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="eager,base,unet")
    ap.add_argument("--size", default="lerobot")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    save = lambda: (a.out / "diffusion_probe.json").write_text(json.dumps(res, indent=1))  # noqa: E731
    res["gemm"] = gemm_table() if a.device == "cuda" else []
    print(json.dumps(res["gemm"]), flush=True)
    save()
    ref = None
    for mode in a.modes.split(","):
        t0 = time.perf_counter()
        policy = load_policy("builtin:diffusion", size=a.size, num_inference_steps=a.steps)
        mod = policy.module
        if mode in ("unet", "unet_tf", "unet_ma", "unet_cublas"):
            kw = {"mode": "max-autotune-no-cudagraphs"} if mode == "unet_ma" else {}
            mod.unet = torch.compile(mod.unet, dynamic=False, **kw)
        torch.backends.cuda.matmul.allow_tf32 = mode == "unet_tf"
        skinny.MIN_K = 10**9 if mode in ("eager", "cublas", "unet_cublas") else 512
        graph = mode != "eager"
        eng = make_engine(policy, a.device, graph)
        o = observations(eng, 1)[0]
        build = time.perf_counter() - t0
        ts, _ = infer_ticks(eng, 30 if graph else 10, o)
        ts = np.array(ts[2:])
        r = {
            "build_s": round(build, 1),
            "infer_p50_us": round(float(np.median(ts)), 1),
            "infer_p99_us": round(float(np.percentile(ts, 99)), 1),
        }
        eng2 = make_engine(policy, a.device, graph)  # a fresh one: the same first action
        _, a0 = infer_ticks(eng2, 1, o)
        if ref is None:
            ref = a0
        r["max_abs_diff_vs_first"] = float(np.abs(np.asarray(a0) - np.asarray(ref)).max())
        if graph and a.device == "cuda":
            r["profile"] = profile(eng, o)
        res[mode] = r
        print(mode, json.dumps({k: v for k, v in r.items() if k != "profile"}), flush=True)
        if "profile" in r:
            print("  kernels", r["profile"]["kernels"], "gpu us", r["profile"]["total_us"])
            for row in r["profile"]["top"][:12]:
                print("   ", row, flush=True)
        save()
        del eng, eng2, policy, mod
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
