"""Every GPU benchmark and CUDA-path check in one run (no ROS needed).

    python3 bench/run_all.py --out DIR [--quick] [--checks-only]

Writes DIR/latest.json (the schema in bench/README.md) and DIR/latest.md, rewriting the JSON
after each part so that a crash still leaves what was measured. The CUDA-path checks
(bench/checks.py, also test/test_cuda.py) are recorded under "checks"; any failed check, or a
part that raised (the check "<part>_ran"), makes the exit status 1 and is named in the last line
printed. Exit status 2: no CUDA device. Run on the GPU machine; the CPU has no CUDA graphs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import checks as ck  # noqa: E402
from bench.checks import Check, check, core_plan, obs_stream  # noqa: E402
from bench.timing import burst_timed, event_timed, host_timed, p  # noqa: E402
from flashrt_ros import Engine, load_policy  # noqa: E402
from flashrt_ros.capsules.checksum import device_checksum  # noqa: E402
from flashrt_ros.cuda.copy import copy_bytes, copy_now  # noqa: E402
from flashrt_ros.cuda.driver import drv  # noqa: E402
from flashrt_ros.runtime.arena import Arena  # noqa: E402
from flashrt_ros.runtime.session import engine_entries  # noqa: E402

MB = 1 << 20

# The CUDA-path checks of this run, in order (the driver paths first: if they are off, the
# copy and checksum checks below only test the torch fallbacks).
CHECK_GROUPS: list[tuple[str, Callable[[], list[Check]]]] = [
    ("driver_paths", ck.driver_paths),
    ("checksum", ck.checksum_kernel),
    ("copies", ck.copies_exact),
    ("graph_vs_eager", ck.graph_vs_eager),
    ("replay", ck.replay_stable),
    ("capsules", ck.capsules_continue),
    ("exported_policy", ck.exported_policy),
]


def log(*a) -> None:
    print(*a, flush=True)


def d2d_bandwidth() -> float:
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    t = event_timed(lambda: b.copy_(a), iters=20)
    return round(2 * n / (np.median(t) * 1e-6) / 1e9, 1)


# -- step latency ----------------------------------------------------------------------------
def step_bench(spec_kw: dict, iters: int) -> dict:
    policy = load_policy("builtin:hybrid", **spec_kw).cuda().eval()
    eng = Engine(policy, device="cuda", seed=0)
    s = eng.session("main")
    np.copyto(s.obs_np, obs_stream(1)[0])
    graph = host_timed(s.plan.replay, iters)  # a whole tick: upload, step, download
    unfused = Engine(policy, device="cuda", seed=0, fuse=False).session("main")
    np.copyto(unfused.obs_np, s.obs_np)
    graph_unfused = host_timed(unfused.plan.replay, iters)

    state = {k: v.clone() for k, v in s.views.items()}
    obs, act, chunk = s.obs.clone(), s.action.clone(), s.chunk.clone()

    def eager() -> None:
        with torch.no_grad():
            policy.step(obs, state, act, chunk)
            state["step"].add_(1)

    eager_t = host_timed(eager, iters)
    row = {
        "policy": "builtin:hybrid"
        + ("" if not spec_kw else "?" + ",".join(f"{k}={v}" for k, v in spec_kw.items())),
        "state_bytes": eng.state_nbytes,
        "eager_p50_us": p(eager_t, 50),
        "eager_p99_us": p(eager_t, 99),
        "graph_p50_us": p(graph, 50),
        "graph_p99_us": p(graph, 99),
        "graph_unfused_p50_us": p(graph_unfused, 50),
        "graph_unfused_p99_us": p(graph_unfused, 99),
    }
    try:
        torch._dynamo.reset()
        compiled = torch.compile(eager, mode="reduce-overhead")
        for _ in range(5):
            compiled()
        comp = host_timed(compiled, iters)
        row.update(compile_p50_us=p(comp, 50), compile_p99_us=p(comp, 99))
    except Exception as ex:  # report, don't hide
        row.update(compile_p50_us=None, compile_error=f"{type(ex).__name__}: {ex}"[:300])
    return row


# -- capsules --------------------------------------------------------------------------------
def capsule_bench(d2d: float, sizes_mb: list[int], iters: int) -> list[dict]:
    rows = []
    for mb in sizes_mb:
        rows.append(capsule_row(d2d, mb, iters))
        log("capsule", rows[-1])
        torch.cuda.empty_cache()
    return rows


def capsule_row(d2d: float, mb: int, iters: int) -> dict:
    """One state size: a hybrid layout scaled by its KV ring (realistic tensor count)."""
    kv = max(16, mb * MB // (2 * 4 * 256 * 4))
    pol = load_policy("builtin:hybrid", d_model=256, n_layers=4, n_heads=8, kv_len=kv)
    arena = Arena(pol.state_spec() + engine_entries(pol), torch.device("cuda"))
    arena.buf.random_()
    slot = torch.empty_like(arena.buf)
    host = torch.empty(arena.nbytes, dtype=torch.uint8, pin_memory=True)
    views = list(arena.views.values())

    def via_host() -> None:
        host.copy_(arena.buf, non_blocking=True)
        arena.buf.copy_(host, non_blocking=True)

    snap = burst_timed(lambda: copy_bytes(slot, arena.buf), iters)
    rest = burst_timed(lambda: copy_bytes(arena.buf, slot), iters)
    clone = burst_timed(lambda: [v.clone() for v in views], iters)
    single = event_timed(lambda: copy_bytes(slot, arena.buf), iters)
    hostrt = event_timed(via_host, max(5, iters // 5))
    csum = event_timed(lambda: device_checksum(slot), max(5, iters // 5))
    floor = 2 * arena.nbytes / (d2d * 1e9) * 1e6
    return {
        "mb": mb,
        "bytes": arena.nbytes,
        "tensors": len(views),
        "snapshot_p50_us": p(snap, 50),
        "restore_p50_us": p(rest, 50),
        "snapshot_p99_us": p(snap, 99),
        "restore_p99_us": p(rest, 99),
        "snapshot_single_p50_us": p(single, 50),
        "floor_us": round(floor, 2),
        "clone_p50_us": p(clone, 50),
        "host_p50_us": p(hostrt, 50),
        "checksum_p50_us": p(csum, 50),
    }


def copy_paths(iters: int) -> dict:
    """Ways to issue one 1 MB device copy, in bursts (host issue cost dominates at this size),
    against cloning the same state tensor by tensor. Informs cuda/copy.py."""
    import ctypes

    pol = load_policy("builtin:hybrid", d_model=256, n_layers=4, n_heads=8, kv_len=128)
    arena = Arena(pol.state_spec() + engine_entries(pol), torch.device("cuda"))
    arena.buf.random_()
    dst = torch.empty_like(arena.buf)
    views = list(arena.views.values())
    n, sp, dp = arena.nbytes, arena.buf.data_ptr(), dst.data_ptr()
    raw = torch.cuda.current_stream().cuda_stream
    res: dict = {"bytes": n, "tensors": len(views)}
    ways = {
        "copy_bytes": lambda: copy_bytes(dst, arena.buf),  # what capsules use: graph replay
        "driver_memcpy": lambda: copy_now(dst, arena.buf),
        "torch_copy_": lambda: dst.copy_(arena.buf),
        "clone_per_tensor": lambda: [v.clone() for v in views],
    }
    if drv is not None:
        cd, cs, st = drv.CUdeviceptr(dp), drv.CUdeviceptr(sp), drv.CUstream(raw)
        ways["cuda_python_preconverted"] = lambda: drv.cuMemcpyDtoDAsync(cd, cs, n, st)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            copy_now(dst, arena.buf)
        ways["torch_graph_replay"] = g.replay
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        f = lib.cuMemcpyDtoDAsync_v2
        f.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        f.restype = ctypes.c_int
        ways["ctypes_libcuda"] = lambda: f(dp, sp, n, raw)
    except OSError as e:
        res["ctypes_error"] = str(e)
    warm = time.perf_counter() + 1.0  # let the clocks come up before the first row
    while time.perf_counter() < warm:
        copy_bytes(dst, arena.buf)
        torch.cuda.synchronize()
    for name, fn in ways.items():
        t = burst_timed(fn, iters)
        res[f"{name}_p50_us"] = p(t, 50)
        h0 = time.perf_counter()
        for _ in range(200):
            fn()
        res[f"{name}_host_issue_us"] = round((time.perf_counter() - h0) / 200 * 1e6, 2)
        torch.cuda.synchronize()
    res["exact"] = bool(torch.equal(dst, arena.buf))  # checked in main()
    return res


def engine_capsule_ops(iters: int) -> dict:
    """Engine-level cost for the shipped policy: what a service call pays on the device."""
    eng = Engine(load_policy("builtin:hybrid"), device="cuda", capsule_slots=4)
    for o in obs_stream(50):
        eng.step(o)
    cp = host_timed(lambda: eng.checkpoint(), iters, warmup=5)
    eng.checkpoint(name="r")
    rs = host_timed(lambda: eng.restore("r", verify=False), iters)
    rv = host_timed(lambda: eng.restore("r", verify=True), iters)
    return {
        "state_bytes": eng.state_nbytes,
        "checkpoint_with_checksum_p50_us": p(cp, 50),
        "restore_p50_us": p(rs, 50),
        "restore_verify_p50_us": p(rv, 50),
    }


# -- restore vs recomputing the history ------------------------------------------------------
def reprefill_bench(histories: list[int], reps: int) -> list[dict]:
    rows = []
    for h in histories:
        rows.append(reprefill_row(h, reps))
        log("reprefill", rows[-1])
    return rows


def reprefill_row(h: int, reps: int) -> dict:
    """Restore vs rebuilding the same state by stepping the history through the graph."""
    eng = Engine(load_policy("builtin:hybrid", kv_len=h), device="cuda", seed=0)
    s = eng.session("main")
    x = torch.from_numpy(obs_stream(h, seed=2)).cuda()
    core = core_plan(s)

    def recompute() -> None:
        for i in range(h):  # the recurrence forces one step per observation
            s.obs.copy_(x[i : i + 1])
            core.replay()

    recompute()
    cap = eng.checkpoint(name="hist")
    full = eng.state_checksum()
    rec = host_timed(recompute, reps, warmup=1)
    slot = eng.pool.source(eng.pool.get(cap.id))
    rest = host_timed(lambda: copy_bytes(s.arena.buf, slot), 50)
    eng.restore("hist")
    return {
        "history": h,
        "state_bytes": eng.state_nbytes,
        "restore_p50_us": p(rest, 50),
        "reprefill_p50_us": p(rec, 50),
        "speedup": round(float(np.median(rec) / np.median(rest)), 1),
        "restored_checksum_ok": eng.state_checksum() == full,
    }


def markdown(r: dict) -> str:
    """latest.md from latest.json (parts that are missing or failed are left out)."""
    L = [
        f"# flashrt_ros GPU benchmarks — {r['gpu']}, torch {r['torch']}, {r['date']}",
        "",
        f"Command: `{r['command']}` (git {r['git']})",
        "",
    ]
    if "failed_checks" in r:  # files of this version (older ones have no verdict)
        bad = r["failed_checks"]
        L += [
            f"CUDA-path checks: {len(r['checks']) - len(bad)} of {len(r['checks'])} passed"
            + (f"; FAILED: {', '.join(bad)}" if bad else ""),
            "",
        ]
    if r.get("d2d_GBps") is not None:
        L += [f"Device copy bandwidth (read+write): {r['d2d_GBps']} GB/s", ""]
    steps = [s for s in [r.get("step"), *(r.get("variants") or [])] if s]
    if steps:
        L += [
            "| policy | state | eager p50/p99 us | torch.compile p50 us | graph (unfused) p50 us "
            "| graph p50/p99 us | eager/graph |",
            "|---|---|---|---|---|---|---|",
        ]
    for s in steps:
        L.append(
            f"| {s['policy']} | {s['state_bytes']} B | {s['eager_p50_us']} / "
            f"{s['eager_p99_us']} | {s.get('compile_p50_us')} | {s['graph_unfused_p50_us']} | "
            f"{s['graph_p50_us']} / "
            f"{s['graph_p99_us']} | {s['eager_p50_us'] / s['graph_p50_us']:.1f}x |"
        )
    if r.get("capsule"):
        L += [
            "",
            "| state MB | snapshot p50 us | restore p50 us | floor us | per-tensor clone us | "
            "host round trip us | device checksum us |",
            "|---|---|---|---|---|---|---|",
        ]
    for c in r.get("capsule") or []:
        L.append(
            f"| {c['mb']} | {c['snapshot_p50_us']} | {c['restore_p50_us']} | "
            f"{c['floor_us']} | {c['clone_p50_us']} | {c['host_p50_us']} | "
            f"{c['checksum_p50_us']} |"
        )
    if r.get("reprefill"):
        L += ["", "| history | restore p50 us | recompute p50 us | speedup |", "|---|---|---|---|"]
    for c in r.get("reprefill") or []:
        L.append(
            f"| {c['history']} | {c['restore_p50_us']} | {c['reprefill_p50_us']} | "
            f"{c['speedup']}x |"
        )
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for latest.json and latest.md")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    ap.add_argument(
        "--checks-only", action="store_true", help="only the CUDA-path checks, no timings"
    )
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/run_all.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    iters = 300 if a.quick else 2000
    r: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "git": os.environ.get("FLASHRT_GIT", "unknown"),
        "command": " ".join(["python3 bench/run_all.py", *sys.argv[1:]]),
    }
    results: list[Check] = []
    t_start = time.perf_counter()

    def save() -> None:
        r["checks"] = ck.as_json(results)
        r["failed_checks"] = ck.failed(results)
        r["all_ok"] = not r["failed_checks"]
        r["seconds"] = round(time.perf_counter() - t_start, 1)
        (out / "latest.json").write_text(json.dumps(r, indent=1, default=str) + "\n")

    def part(key: str, fn: Callable[[], object]) -> None:
        """r[key] = fn(); one that raises leaves None and the failed check `<key>_ran`."""
        t0 = time.perf_counter()
        try:
            r[key] = fn()
        except Exception as ex:  # report, don't hide; the other parts still run
            traceback.print_exc()
            r[key] = None
            results.append(check(f"{key}_ran", False, error=f"{type(ex).__name__}: {ex}"[:500]))
        log(key, r[key], f"({time.perf_counter() - t0:.1f} s)")
        save()

    results += ck.run_groups(CHECK_GROUPS, log)
    save()
    if not a.checks_only:
        part("copy_paths", lambda: copy_paths(200))
        if r["copy_paths"] is not None:
            results.append(check("copy_paths_exact", r["copy_paths"]["exact"]))
        part("d2d_GBps", d2d_bandwidth)
        part("step", lambda: step_bench({}, iters))
        variant = dict(d_model=256, n_layers=4, n_heads=8, kv_len=256)
        part("variants", lambda: [step_bench(variant, iters)])
        part(
            "capsule",
            lambda: capsule_bench(r["d2d_GBps"], [1, 16, 256, 1024], 50 if a.quick else 200),
        )
        part("engine_capsule_ops", lambda: engine_capsule_ops(100))
        part("reprefill", lambda: reprefill_bench([2048, 4096, 8192, 16384], 3 if a.quick else 5))
        for row in r["reprefill"] or []:
            results.append(
                check(
                    f"reprefill_{row['history']}_restored_checksum",
                    row["restored_checksum_ok"],
                )
            )
    r["ros"] = None  # filled by bench/ros_bench.py where ROS runs on the GPU machine
    save()
    (out / "latest.md").write_text(markdown(r))
    print(markdown(r))
    log(f"total {time.perf_counter() - t_start:.0f} s; JSON in {out / 'latest.json'}")
    log(ck.verdict(results, "bench/run_all.py"))
    return 0 if r["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
