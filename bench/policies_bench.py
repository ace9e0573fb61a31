"""Chunked visuomotor policies (builtin:act, builtin:diffusion) served by the Engine: tick
latency per kind of tick ("infer": a new chunk; "queue": pop the next action), eager vs
torch.compile vs our captured graph, and the state's size and capsule costs. No ROS.

    python bench/policies_bench.py [--quick] [--device cuda|cpu] [--out FILE]

`policies_rows(device, quick)` returns the rows ("policies" in the results JSON):
{"policy", "size", "tick", "state_bytes", "eager_p50_us", "compile_p50_us", "graph_p50_us",
"graph_p99_us", "graph_fused", "snapshot_p50_us", "restore_p50_us"}; a column is None where a
mode was not run. The graph is always the one the node serves (compiled unless the policy says
otherwise or the build's check refused it: "graph_fused" says which); past COMPILE_UNTIL_S of the
run only the "compile" comparison is skipped (a full run once left lerobot-100's graph unfused
there: 105.6 instead of 66.2 ms an infer tick, 1c0d1d8).
builtin:diffusion compiles its UNet alone (Policy.compile_parts: the whole step's unrolled
denoising loop would take inductor minutes at the lerobot size), so "compile" and "graph" there
mean the step around a compiled UNet. Each
(policy, mode) runs for a bounded number of ticks and seconds, so the whole GPU run stays in a
few minutes. "eager": the Engine without graph or compile; "compile": the tick compiled by
inductor (default mode: the tick mutates the arena in place, which inductor's own cudagraphs
skip), not captured; "graph": compiled and captured into our graph (what the node serves). On
the CPU (--quick) "compile" is the same compiled step run eagerly, and there is no graph.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashrt_ros import Engine, load_policy  # noqa: E402
from flashrt_ros.runtime.session import Session  # noqa: E402

# (spec, size label, load overrides, compile it?)
FULL = [
    ("builtin:act", "sim", {"size": "sim"}, True),
    ("builtin:act", "lerobot", {"size": "lerobot"}, True),
    ("builtin:diffusion", "sim", {"size": "sim", "num_inference_steps": 10}, True),
    ("builtin:diffusion", "lerobot-10", {"size": "lerobot", "num_inference_steps": 10}, True),
    ("builtin:diffusion", "lerobot-100", {"size": "lerobot", "num_inference_steps": 100}, True),
]
QUICK = [
    (
        "builtin:act",
        "tiny",
        {"size": "sim", "image_hw": (32, 32), "n_action_steps": 4, "temporal_ensemble_coeff": None},
        True,
    ),
    (
        "builtin:diffusion",
        "tiny",
        {"size": "sim", "image_hw": (32, 32), "num_inference_steps": 2},
        True,
    ),
]


COMPILE_UNTIL_S = 100.0  # past this much of the run, no more compiles (graph of eager kernels)


def observations(eng: Engine, n: int, seed: int = 0) -> list[dict]:
    """n random observations in the engine's wire layout (a few distinct ones, reused)."""
    rng = np.random.default_rng(seed)
    spec = eng.observation_spec()
    pool = [
        {
            k: rng.normal(size=v["shape"]).astype(np.float32) * 0.1
            if v["kind"] == "vector"
            else rng.integers(0, 256, v["shape"], dtype=np.uint8)
            for k, v in spec.items()
        }
        for _ in range(4)
    ]
    return [pool[i % 4] for i in range(n)]


def tick_times(eng: Engine, ticks: int, budget_s: float) -> dict[str, np.ndarray]:
    """Host wall time of each tick (step() waits for the device), in us, by tick kind; stops
    after `ticks` ticks or `budget_s` seconds. The first 2 ticks of each kind are warm-up."""
    obs = observations(eng, 64)
    out: dict[str, list[float]] = {}
    gc.collect()  # the node freezes after configure (flashrt_node.py): the collector's full
    gc.freeze()  # passes over torch's and inductor's objects are not ticks' time
    t_end = time.perf_counter() + budget_s
    try:
        for i in range(ticks):
            kind = eng.next_tick_kind()
            t0 = time.perf_counter()
            eng.step(obs[i % len(obs)])
            out.setdefault(kind, []).append((time.perf_counter() - t0) * 1e6)
            if time.perf_counter() > t_end and all(len(v) > 4 for v in out.values()):
                break
    finally:
        gc.unfreeze()
    return {k: np.array(v[2:] if len(v) > 4 else v) for k, v in out.items()}


def capsule_times(eng: Engine, n: int = 30) -> tuple[float, float]:
    """p50 us of checkpoint (copy + device checksum + finite check) and restore (verify off)."""
    snap, rest = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        cap = eng.checkpoint()
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        eng.restore(cap.id, verify=False)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        eng.drop(cap.id)
        snap.append((t1 - t0) * 1e6)
        rest.append((t2 - t1) * 1e6)
    return float(np.median(snap[2:])), float(np.median(rest[2:]))


def _compiled_cpu(eng: Engine) -> Engine:
    """On the CPU the Engine never compiles: swap in a session whose step is the compiled one
    (the same function the CUDA graph captures), so the compile path is exercised."""
    s = eng.session("main")
    eng._sessions["main"] = Session(
        "main", eng.policy, eng.spec, eng.device, eng.seed, False, True, 0, eng.encodings
    )
    del s
    return eng


def bench_policy(spec, size, overrides, do_compile, device, ticks, budget_s, log) -> list[dict]:
    """The rows of one policy: one per tick kind."""
    policy = load_policy(spec, **overrides)
    cuda = torch.device(device).type == "cuda"
    p = {}
    torch._dynamo.reset()  # one compiled step per policy: stay under dynamo's recompile limit
    modes = [("eager", dict(use_graph=False, fuse=False))]
    if do_compile:
        modes.append(("compile", dict(use_graph=False, fuse=True)))
    if cuda:  # as the node serves it (the Engine's default: compiled unless the policy says
        # otherwise or the build's check refused it), even past COMPILE_UNTIL_S
        modes.append(("graph", dict(use_graph=True)))
    state_bytes, capsule, graph_fused = None, (None, None), None
    for mode, kw in modes:
        t0 = time.perf_counter()
        eng = Engine(policy, device=device, capsule_slots=4, **kw)
        if mode == "compile" and not cuda:
            eng = _compiled_cpu(eng)
        state_bytes = eng.state_nbytes
        if mode == "graph":
            graph_fused = eng.fuse and not eng.fused_mismatch
        times = tick_times(eng, ticks, budget_s)
        log(
            f"  {spec} {size} {mode}: built+ran in {time.perf_counter() - t0:.1f}s, "
            + ", ".join(f"{k} p50 {np.median(v):.0f}us (n={len(v)})" for k, v in times.items())
        )
        p[mode] = times
        if mode == ("graph" if cuda else "eager"):
            capsule = capsule_times(eng)
        del eng
    rows = []
    for kind in policy.tick_kinds:

        def p50(mode, kind=kind):
            t = p.get(mode, {}).get(kind)
            return None if t is None or not len(t) else round(float(np.median(t)), 1)

        g = p.get("graph", {}).get(kind)
        rows.append(
            {
                "policy": spec,
                "size": size,
                "tick": kind,
                "state_bytes": state_bytes,
                "eager_p50_us": p50("eager"),
                "compile_p50_us": p50("compile"),
                "graph_p50_us": p50("graph"),
                "graph_p99_us": None if g is None else round(float(np.percentile(g, 99)), 1),
                "graph_fused": graph_fused,
                "snapshot_p50_us": round(capsule[0], 1),
                "restore_p50_us": round(capsule[1], 1),
            }
        )
    return rows


def policies_rows(
    device: str = "cuda", quick: bool = False, log=print, on_rows=None, only: str = ""
) -> list[dict]:
    """Every configured policy's rows; a policy that fails is logged and left out (its error
    in the row list as {"policy", "size", "error"}), so one failure does not lose the rest.
    `on_rows(rows)` is called after each policy, so a run cut short still leaves its rows.
    `only` (comma-separated "spec/size", e.g. "builtin:diffusion/lerobot-10") keeps those."""
    configs = QUICK if quick else FULL
    if only:
        keep = set(only.split(","))
        unknown = keep - {f"{c[0]}/{c[1]}" for c in configs}
        if unknown:
            raise SystemExit(f"--only: unknown {sorted(unknown)}")
        configs = [c for c in configs if f"{c[0]}/{c[1]}" in keep]
    ticks, budget = (40, 5.0) if quick else (1000, 6.0)
    rows = []
    t_start = time.perf_counter()
    for spec, size, overrides, do_compile in configs:
        if time.perf_counter() - t_start > COMPILE_UNTIL_S:
            do_compile = False  # torch.compile's comparison takes tens of seconds: skip it
        try:
            rows += bench_policy(spec, size, overrides, do_compile, device, ticks, budget, log)
        except Exception as e:  # noqa: BLE001 - reported in the results
            log(f"  {spec} {size}: FAILED {type(e).__name__}: {e}")
            rows.append({"policy": spec, "size": size, "error": f"{type(e).__name__}: {e}"})
        if on_rows is not None:
            on_rows(rows)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--out", type=Path, help="write {'policies': rows, 'tick_floor': ...} as JSON here"
    )
    ap.add_argument(
        "--no-floor",
        action="store_true",
        help="skip the tick floor (bench/tick_floor.py, CUDA only: the smallest graph tick "
        "timed the same way, for the queue rows' p99/p50)",
    )
    ap.add_argument(
        "--only",
        default="",
        help="comma-separated spec/size rows to run, e.g. "
        "builtin:diffusion/lerobot-10 (default: all)",
    )
    a = ap.parse_args()

    out: dict = {"policies": []}

    def save(rows: list[dict]) -> None:
        out["policies"] = rows
        if a.out:
            a.out.write_text(json.dumps(out, indent=1))

    rows = policies_rows(
        a.device, a.quick, log=lambda *x: print(*x, flush=True), on_rows=save, only=a.only
    )
    for r in rows:
        print(json.dumps(r))
    if torch.device(a.device).type == "cuda" and not a.no_floor:
        from bench.tick_floor import measure

        out["tick_floor"] = measure(ticks=2000, busy_ms=8.0, after=7)
        print("tick_floor", json.dumps(out["tick_floor"]), flush=True)
        save(rows)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
