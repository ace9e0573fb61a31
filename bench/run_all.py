"""Every GPU benchmark and CUDA-path check in one run (no ROS needed).

    python bench/run_all.py --out DIR [--quick]

Writes DIR/latest.json (the schema of DESIGN.md section 8, plus "checks" and "variants") and
DIR/latest.md. Run on the GPU machine; the CPU has no CUDA graphs to measure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import burst_timed, event_timed, host_timed, p  # noqa: E402
from flashrt_ros import Engine, load_policy  # noqa: E402
from flashrt_ros.capsules.checksum import device_checksum, reference_digest  # noqa: E402
from flashrt_ros.cuda.copy import copy_bytes, copy_now, driver_copies  # noqa: E402
from flashrt_ros.cuda.driver import drv  # noqa: E402
from flashrt_ros.cuda.kernels import compiled as checksum_kernel  # noqa: E402
from flashrt_ros.runtime.arena import Arena  # noqa: E402
from flashrt_ros.runtime.graph import StepPlan  # noqa: E402
from flashrt_ros.runtime.recipes import restore_regions  # noqa: E402
from flashrt_ros.runtime.session import engine_entries  # noqa: E402

MB = 1 << 20


def log(*a) -> None:
    print(*a, flush=True)


def d2d_bandwidth() -> float:
    n = 4 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    t = event_timed(lambda: b.copy_(a), iters=20)
    return round(2 * n / (np.median(t) * 1e-6) / 1e9, 1)


def obs_stream(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n)[:, None] * 0.01
    f = rng.uniform(0.2, 1.0, 6)
    q = 0.8 * np.sin(2 * np.pi * f * t)
    dq = 0.8 * 2 * np.pi * f * np.cos(2 * np.pi * f * t)
    return np.concatenate([q, dq], 1).astype(np.float32)


# -- CUDA-path checks --------------------------------------------------------------------------
def core_plan(s) -> StepPlan:
    """The session's step captured without its IO nodes, to drive it from device-resident
    observations (a whole history uploaded once) without a host round trip per step."""
    plan = StepPlan(s.step_fn, s.obs.device)
    plan.capture([s.arena.buf, s.obs, s.action, s.chunk])
    return plan


def checks() -> dict:
    res = {}
    obs = obs_stream(500)
    g = Engine(load_policy("builtin:hybrid"), device="cuda", seed=0)  # fused + captured
    u = Engine(load_policy("builtin:hybrid"), device="cuda", seed=0, fuse=False)
    e = Engine(load_policy("builtin:hybrid"), device="cuda", seed=0, use_graph=False)
    c = Engine(load_policy("builtin:hybrid"), device="cpu", seed=0)
    assert g.session("main").captured and not e.session("main").captured
    ga = np.array([g.step(o) for o in obs])
    ea = np.array([e.step(o) for o in obs])
    ca = np.array([c.step(o) for o in obs])
    res["graph_vs_eager_cuda_max_abs"] = float(np.abs(ga - ea).max())
    res["graph_vs_cpu_max_abs"] = float(np.abs(ga - ca).max())
    res["graph_vs_eager_cuda_rel"] = float(np.linalg.norm(ga - ea) / np.linalg.norm(ea))
    ua = np.array([u.step(o) for o in obs])
    res["unfused_graph_equals_eager_cuda_bitwise"] = bool(np.array_equal(ua, ea))
    # 10,000 replays: stable (finite, bounded, no allocation growth), still agrees with eager
    s = g.session("main")
    core = core_plan(s)
    long = obs_stream(10_000, seed=1)
    x = torch.from_numpy(long).cuda()
    torch.cuda.synchronize()
    allocs0 = torch.cuda.memory_stats()["allocation.all.allocated"]
    t0 = time.perf_counter()
    for i in range(10_000):
        s.obs.copy_(x[i : i + 1])
        core.replay()
    torch.cuda.synchronize()
    res["replay_10k_s"] = round(time.perf_counter() - t0, 3)
    res["replay_10k_allocations"] = torch.cuda.memory_stats()["allocation.all.allocated"] - allocs0
    res["replay_10k_finite"] = bool(torch.isfinite(s.action).all().item())
    res["replay_10k_step_counter"] = int(s.views["step"][0])
    # capsules on CUDA: checksum and continuation identical after restore
    cap = g.checkpoint(name="cuda_cap")
    first = np.array([g.step(o) for o in obs[:200]])
    g.restore("cuda_cap", verify=True)
    res["restore_checksum_equal"] = g.state_checksum() == cap.checksum
    second = np.array([g.step(o) for o in obs[:200]])
    res["restore_continuation_bitwise"] = bool(np.array_equal(first, second))
    g.branch("cuda_cap", "alt")
    third = np.array([g.step(o, session="alt") for o in obs[:200]])
    res["branch_continuation_bitwise"] = bool(np.array_equal(first, third))
    restore_regions(g, "cuda_cap", "main", ("kv",))  # paper ablation: main is 200 steps on
    res["kv_only_diverges"] = not np.array_equal(first, np.array([g.step(o) for o in obs[:200]]))
    res["cuda_python_copies"] = driver_copies()
    try:
        res["exported_policy"] = exported_check()
    except Exception as ex:  # report, don't hide
        res["exported_policy"] = f"{type(ex).__name__}: {ex}"[:300]
    res["tier"] = cap.tier
    return res


def exported_check() -> dict:
    """A user's torch.export policy captured on CUDA gives the module's actions."""
    import tempfile

    torch.manual_seed(5)
    cell, out = torch.nn.GRUCell(18, 16), torch.nn.Linear(16, 6)

    class User(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell, self.out = cell, out

        def forward(self, obs, goal, h):
            h2 = self.cell(torch.cat([obs, goal])[None], h[None])[0]
            return obs[:6] + 0.1 * torch.tanh(self.out(h2)), h2

    m = User().eval()
    args = (torch.zeros(12), torch.zeros(6), torch.zeros(16))
    path = Path(tempfile.mkdtemp()) / "user.pt2"
    torch.export.save(torch.export.export(m, args), str(path))
    eng = Engine(load_policy(str(path)), device="cuda")
    h, worst = torch.zeros(16), 0.0
    with torch.no_grad():
        for o in obs_stream(200, seed=3):
            a, h = m(torch.from_numpy(o), torch.zeros(6), h)
            worst = max(worst, float(np.abs(eng.step(o) - a.numpy()).max()))
    return {"captured": eng.session("main").captured, "max_abs_vs_module": worst}


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


def checksum_check() -> dict:
    """The checksum kernel against the torch definition on random bytes of awkward sizes."""
    sizes = [4, 1020, 4096 + 12, (1 << 20) + 36, 67_108_864 + 4]
    ok = []
    for n in sizes:
        buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        ok.append(torch.equal(device_checksum(buf), reference_digest(buf)))
        ok.append(torch.equal(device_checksum(buf.cpu()), reference_digest(buf).cpu()))
    before = device_checksum(buf).clone()
    buf[n // 2] ^= 1  # one flipped bit changes the digest
    return {
        "kernel": checksum_kernel(0),
        "equals_reference": all(ok),
        "sizes": sizes,
        "bitflip_detected": not torch.equal(device_checksum(buf), before),
    }


def copy_paths(iters: int) -> dict:
    """Ways to issue one 1 MB device copy, in bursts (host issue cost dominates at this size),
    against cloning the same state tensor by tensor. Informs capsules/copy.py."""
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
    assert torch.equal(dst, arena.buf)
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
    L = [
        f"# flashrt_ros GPU benchmarks — {r['gpu']}, torch {r['torch']}, {r['date']}",
        "",
        f"Command: `{r['command']}` (git {r['git']})",
        "",
        f"Device copy bandwidth (read+write): {r['d2d_GBps']} GB/s",
        "",
        "| policy | state | eager p50/p99 us | torch.compile p50 us | graph (unfused) p50 us "
        "| graph p50/p99 us | eager/graph |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in [r["step"], *r["variants"]]:
        L.append(
            f"| {s['policy']} | {s['state_bytes']} B | {s['eager_p50_us']} / "
            f"{s['eager_p99_us']} | {s.get('compile_p50_us')} | {s['graph_unfused_p50_us']} | "
            f"{s['graph_p50_us']} / "
            f"{s['graph_p99_us']} | {s['eager_p50_us'] / s['graph_p50_us']:.1f}x |"
        )
    L += [
        "",
        "| state MB | snapshot p50 us | restore p50 us | floor us | per-tensor clone us | "
        "host round trip us | device checksum us |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in r["capsule"]:
        L.append(
            f"| {c['mb']} | {c['snapshot_p50_us']} | {c['restore_p50_us']} | "
            f"{c['floor_us']} | {c['clone_p50_us']} | {c['host_p50_us']} | "
            f"{c['checksum_p50_us']} |"
        )
    L += ["", "| history | restore p50 us | recompute p50 us | speedup |", "|---|---|---|---|"]
    for c in r["reprefill"]:
        L.append(
            f"| {c['history']} | {c['restore_p50_us']} | {c['reprefill_p50_us']} | "
            f"{c['speedup']}x |"
        )
    return "\n".join(L) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for latest.json and latest.md")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/run_all.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    iters = 300 if a.quick else 2000
    r = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "git": os.environ.get("FLASHRT_GIT", "unknown"),
        "command": "python bench/run_all.py --out bench/results",
    }
    r["checks"] = checks()
    r["checks"]["checksum"] = checksum_check()
    r["copy_paths"] = copy_paths(200)
    log("copy paths", r["copy_paths"])
    log("checks", r["checks"])
    r["d2d_GBps"] = d2d_bandwidth()
    log("d2d", r["d2d_GBps"])
    r["step"] = step_bench({}, iters)
    log("step", r["step"])
    r["variants"] = [step_bench(dict(d_model=256, n_layers=4, n_heads=8, kv_len=256), iters)]
    log("variants", r["variants"])
    r["capsule"] = capsule_bench(r["d2d_GBps"], [1, 16, 256, 1024], 50 if a.quick else 200)
    r["engine_capsule_ops"] = engine_capsule_ops(100)
    log("engine ops", r["engine_capsule_ops"])
    r["reprefill"] = reprefill_bench([2048, 4096, 8192, 16384], 3 if a.quick else 5)
    r["ros"] = None  # filled by bench/ros_bench.py where ROS runs on the GPU machine
    (out / "latest.json").write_text(json.dumps(r, indent=1) + "\n")
    (out / "latest.md").write_text(markdown(r))
    print(markdown(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
