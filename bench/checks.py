"""The CUDA-path checks, written once: bench/run_all.py and bench/cuda_check.py record them in
their JSON and fail on them, test/test_cuda.py (`pytest -m cuda`) asserts them.

Each group is a function returning a list of Check(name, ok, detail); `detail` holds what was
measured (JSON-ready) and the bound it was held to. Every group builds what it needs (engines,
buffers), so any one can run alone. They need a CUDA device and cuda-python; none needs ROS.
Observations stay well inside the Engine's obs_limit (|value| <= 5).
"""

from __future__ import annotations

import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from flashrt_ros import Engine, load_policy
from flashrt_ros.capsules.checksum import device_checksum, reference_digest
from flashrt_ros.cuda import graphs
from flashrt_ros.cuda.copy import copy_bytes, driver_copies
from flashrt_ros.cuda.kernels import compiled as checksum_kernel_compiled
from flashrt_ros.runtime.graph import StepPlan
from flashrt_ros.runtime.recipes import restore_regions

# Largest |action difference| allowed between the fused graph and eager (CUDA or CPU), and
# between the exported-policy adapter and its module. Actions are O(1); the H200 run of
# 2026-11-29 measured 1.8e-7, 2.4e-7 and 6e-8 over 500 / 500 / 200 recurrent steps.
ACTION_TOL = 1e-4
CHECKSUM_SIZES = (4, 1020, 4096 + 12, (1 << 20) + 36, (64 << 20) + 4)  # bytes, multiples of 4
COPY_SIZES = (256, 4096 + 4, 1 << 20, 8 << 20, (8 << 20) + 256, 64 << 20)  # both copy paths


class Check(NamedTuple):
    name: str
    ok: bool
    detail: dict


def check(name: str, ok, **detail) -> Check:
    return Check(name, bool(ok), detail)


# -- shared inputs ---------------------------------------------------------------------------
def obs_stream(n: int, seed: int = 0) -> np.ndarray:
    """Smooth joint trajectories (6 positions, 6 velocities), |value| <= 0.8 * 2 pi."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)[:, None] * 0.01
    f = rng.uniform(0.2, 1.0, 6)
    q = 0.8 * np.sin(2 * np.pi * f * t)
    dq = 0.8 * 2 * np.pi * f * np.cos(2 * np.pi * f * t)
    return np.concatenate([q, dq], 1).astype(np.float32)


def hybrid_engine(device: str = "cuda", **kw) -> Engine:
    return Engine(load_policy("builtin:hybrid"), device=device, seed=0, **kw)


def core_plan(s) -> StepPlan:
    """The session's step captured without its IO nodes, to drive it from device-resident
    observations (a whole history uploaded once) without a host round trip per step."""
    plan = StepPlan(s.step_fn, s.obs.device)
    plan.capture([s.arena.buf, s.obs, s.action, s.chunk])
    return plan


def _steps(eng: Engine, obs: np.ndarray, session: str = "main") -> np.ndarray:
    return np.array([eng.step(o, session) for o in obs])


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


def _bytes(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen)


# -- groups ----------------------------------------------------------------------------------
def graph_vs_eager(steps: int = 500) -> list[Check]:
    """The fused captured step against eager CUDA and the CPU; unfused graph bit for bit."""
    obs = obs_stream(steps)
    g = hybrid_engine("cuda")  # fused + captured (the default on CUDA)
    u = hybrid_engine("cuda", fuse=False)
    e = hybrid_engine("cuda", use_graph=False)
    c = hybrid_engine("cpu")
    ga, ua, ea, ca = (_steps(x, obs) for x in (g, u, e, c))
    ge, gc = _max_abs(ga, ea), _max_abs(ga, ca)
    captured = (g.session("main").captured, u.session("main").captured)
    return [
        check(
            "graph_captured",
            g.fuse and captured == (True, True) and not e.session("main").captured,
            fused=g.fuse,
            fused_captured=captured[0],
            unfused_captured=captured[1],
            eager_captured=e.session("main").captured,
        ),
        check(
            "graph_vs_eager_cuda",
            ge <= ACTION_TOL,
            max_abs=ge,
            rel=float(np.linalg.norm(ga - ea) / np.linalg.norm(ea)),
            tol=ACTION_TOL,
            steps=steps,
        ),
        check("graph_vs_cpu", gc <= ACTION_TOL, max_abs=gc, tol=ACTION_TOL, steps=steps),
        check(
            "unfused_graph_equals_eager_cuda_bitwise",
            np.array_equal(ua, ea),
            max_abs=_max_abs(ua, ea),
        ),
    ]


def replay_stable(n: int = 10_000) -> list[Check]:
    """n replays of the captured step (no host round trip): no allocation, finite, counted."""
    eng = hybrid_engine("cuda")
    s = eng.session("main")
    dev = s.obs.device
    core = core_plan(s)
    x = torch.from_numpy(obs_stream(n, seed=1)).to(dev)
    torch.cuda.synchronize(dev)
    step0 = int(s.views["step"][0])
    mem0 = torch.cuda.memory_allocated(dev)
    allocs0 = torch.cuda.memory_stats(dev)["allocation.all.allocated"]
    t0 = time.perf_counter()
    for i in range(n):
        s.obs.copy_(x[i : i + 1])
        core.replay()
    torch.cuda.synchronize(dev)
    secs = time.perf_counter() - t0
    mem1 = torch.cuda.memory_allocated(dev)
    allocs = torch.cuda.memory_stats(dev)["allocation.all.allocated"] - allocs0
    action_finite = bool(torch.isfinite(s.action).all().item())
    bad_state = [
        k for k, v in s.views.items() if v.is_floating_point() and not bool(v.isfinite().all())
    ]
    counted = int(s.views["step"][0]) - step0
    return [
        check(
            "replay_10k_no_allocation",
            mem1 == mem0 and allocs == 0,
            replays=n,
            memory_allocated_delta=mem1 - mem0,
            allocations=allocs,
            seconds=round(secs, 3),
        ),
        check("replay_10k_finite", action_finite and not bad_state, non_finite_state=bad_state),
        check("replay_10k_step_counter", counted == n, counted=counted, replays=n),
    ]


def capsules_continue(steps: int = 200) -> list[Check]:
    """Restore and branch on CUDA continue bit for bit with equal checksums (also from another
    thread, as rclpy's executor calls services); restoring only the KV regions diverges."""
    g = hybrid_engine("cuda", capsule_slots=4)
    for o in obs_stream(50, seed=5):  # some history first
        g.step(o)
    obs = obs_stream(steps, seed=4)
    cap = g.checkpoint(name="cuda_cap")
    first = _steps(g, obs)
    g.restore(cap.id, verify=True)
    restored_sum = g.state_checksum()
    second = _steps(g, obs)
    g.branch(cap.id, "alt")
    branch_sum = g.state_checksum("alt")  # right after the branch: the capsule's
    third = _steps(g, obs, "alt")
    main_after = g.state_checksum()
    branch_after = g.state_checksum("alt")
    # the KV-only ablation of the capsules paper (arXiv 2606.20537): main is 200 steps on
    restore_regions(g, cap.id, "main", ("kv",))
    kv_only = _steps(g, obs)
    res: dict = {}

    def other() -> None:
        try:
            g.restore(cap.id, verify=True)
            res["x"] = _steps(g, obs)
        except Exception as ex:  # reported in the check
            res["error"] = f"{type(ex).__name__}: {ex}"[:300]

    t = threading.Thread(target=other)
    t.start()
    t.join()
    from_thread = res.get("x")
    return [
        check("capsule_tier_gpu", cap.tier == "gpu", tier=cap.tier),
        check(
            "restore_checksum_equal",
            restored_sum == cap.checksum,
            checkpoint=cap.checksum,
            restored=restored_sum,
        ),
        check(
            "restore_continuation_bitwise",
            np.array_equal(first, second),
            max_abs=_max_abs(first, second),
            steps=steps,
        ),
        check(
            "branch_continuation_bitwise",
            np.array_equal(first, third)
            and branch_sum == cap.checksum
            and branch_after == main_after,
            max_abs=_max_abs(first, third),
            checksum_at_branch=branch_sum,
            same_state_after=branch_after == main_after,
        ),
        check(
            "kv_only_restore_diverges",
            not np.array_equal(first, kv_only),
            max_abs=_max_abs(first, kv_only),
        ),
        check(
            "restore_from_other_thread_bitwise",
            from_thread is not None and np.array_equal(first, from_thread),
            error=res.get("error"),
        ),
    ]


def checksum_kernel(sizes: Iterable[int] = CHECKSUM_SIZES) -> list[Check]:
    """The NVRTC kernel (direct and as a replayed graph) equals the torch definition, on the
    device and on the CPU, on awkward sizes; a flipped bit anywhere changes the digest."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = list(sizes)
    wrong = []
    for n in sizes:
        buf = _bytes(n, gen)
        ref = reference_digest(buf)
        out = torch.empty(2, dtype=torch.int64, device="cuda")
        kernel, graphed = device_checksum(buf), device_checksum(buf, out=out)
        cpu = reference_digest(buf.cpu())
        if not (
            torch.equal(kernel, ref) and torch.equal(graphed, ref) and torch.equal(ref.cpu(), cpu)
        ):
            wrong.append(n)
    buf = _bytes(sizes[-1], gen)
    out = torch.empty(2, dtype=torch.int64, device="cuda")
    missed = []
    for pos, bit in ((0, 1), (len(buf) // 2, 1), (len(buf) - 1, 0x80)):
        before = device_checksum(buf).clone()
        buf[pos] ^= bit
        now = device_checksum(buf)
        graphed = device_checksum(buf, out=out)  # the graph captured for the key replays too
        if torch.equal(now, before) or not torch.equal(graphed, now):
            missed.append(pos)
    return [
        check("checksum_equals_reference", not wrong, sizes=sizes, wrong_sizes=wrong),
        check("checksum_sees_flipped_bit", not missed, bytes=len(buf), missed_at=missed),
    ]


def copies_exact(sizes: Iterable[int] = COPY_SIZES) -> list[Check]:
    """copy_bytes exact from 256 B to 64 MB (graph and direct paths) and at odd offsets, inside
    a foreign capture, and while the graph cache evicts (exact and bounded)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    sizes = list(sizes)
    wrong = []
    for n in sizes:
        a = _bytes(n, gen)
        b = torch.zeros_like(a)
        copy_bytes(b, a)
        if not torch.equal(a, b):
            wrong.append(n)
    big = _bytes(1 << 16, gen)
    odd = torch.zeros_like(big)
    copy_bytes(odd[3:1004], big[5:1006])  # unaligned views of larger buffers
    odd_ok = torch.equal(odd[3:1004], big[5:1006]) and not bool(odd[:3].any() | odd[1004:].any())

    a = _bytes(4096, gen)
    b = torch.zeros_like(a)
    copy_bytes(b, a)  # a cached key now
    c = torch.zeros_like(a)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        copy_bytes(c, a)  # a cached key inside someone else's capture: issued directly
    g.replay()
    torch.cuda.synchronize()
    foreign = torch.equal(c, a)

    old, limit = graphs.MAX_GRAPHS, 8
    graphs.MAX_GRAPHS = limit
    try:
        bufs = [_bytes(1024, gen) for _ in range(20)]
        dst = torch.empty_like(bufs[0])
        exact = []
        for x in bufs + bufs[:4]:  # the first four again: evicted keys are captured anew
            dst.zero_()
            copy_bytes(dst, x)
            exact.append(torch.equal(dst, x))
        cached = graphs.cached()
    finally:
        graphs.MAX_GRAPHS = old
    return [
        check("copies_exact", not wrong, sizes=sizes, wrong_sizes=wrong),
        check("copy_at_odd_offsets_exact", odd_ok),
        check("copy_inside_foreign_capture", foreign),
        check(
            "eviction_keeps_copies_exact",
            all(exact),
            wrong=[i for i, x in enumerate(exact) if not x],
        ),
        check("eviction_bounds_the_cache", cached <= limit, cached=cached, limit=limit),
    ]


def driver_paths() -> list[Check]:
    """Copies and checksums really take the cuda-python paths (else the checks above would
    only have tested the torch fallbacks)."""
    a = torch.arange(1024, dtype=torch.int32, device="cuda").view(torch.uint8)
    b = torch.zeros_like(a)
    copy_bytes(b, a)
    device_checksum(a, out=torch.empty(2, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()
    index = a.get_device()
    return [
        check("cuda_python_copies", driver_copies()),
        check("one_node_graphs_enabled", graphs._ok),
        check("checksum_kernel_compiled", checksum_kernel_compiled(index), device=index),
    ]


def exported_policy(steps: int = 200) -> list[Check]:
    """A user's torch.export policy captured on CUDA gives the module's actions."""
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
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "user.pt2"
        torch.export.save(torch.export.export(m, args), str(path))
        eng = Engine(load_policy(str(path)), device="cuda")
    h, worst = torch.zeros(16), 0.0
    with torch.no_grad():
        for o in obs_stream(steps, seed=3):
            a, h = m(torch.from_numpy(o), torch.zeros(6), h)
            worst = max(worst, _max_abs(eng.step(o), a.numpy()))
    return [
        check("exported_policy_captured", eng.session("main").captured),
        check(
            "exported_policy_matches_module",
            worst <= ACTION_TOL,
            max_abs=worst,
            tol=ACTION_TOL,
            steps=steps,
        ),
    ]


def record_steps(eng, obs) -> tuple[np.ndarray, dict[int, bytes]]:
    """Step `eng` on each of `obs`: the actions, and the state bytes after each step (0: before
    the first), which the flight ring's slots must hold."""
    acts, snaps = [], {0: eng.state_bytes()}
    for i, o in enumerate(obs):
        acts.append(eng.step(o))
        snaps[i + 1] = eng.state_bytes()
    return np.array(acts), snaps


def flight_ring(ticks: int = 5, steps: int = 13) -> list[Check]:
    """The flight ring is written by cuda/ring.py's kernel inside the captured step, fused and
    unfused: after a wrap every listed slot holds the state it claims, and a rewind plus the
    same observations replays the original actions bit for bit."""
    out = []
    for fuse in (True, False):
        eng = hybrid_engine(flight_ticks=ticks, fuse=fuse)
        s = eng.session("main")
        obs = obs_stream(steps, seed=4)
        acts, snaps = record_steps(eng, obs)
        held = eng.flight()
        wrong = [t for t in held[:-1] if s.flight_state(t).cpu().numpy().tobytes() != snaps[t]]
        k = len(held) - 1
        eng.rewind(k)
        again = _steps(eng, obs[steps - k :])
        tag = "fused" if fuse else "unfused"
        out += [
            check(f"ring_kernel_in_use_{tag}", s.ring_kernel and s.captured),
            check(
                f"ring_slots_hold_their_steps_{tag}",
                not wrong and held == list(range(steps - ticks + 1, steps + 1)),
                held=held,
                wrong=wrong,
            ),
            check(
                f"ring_rewind_replays_bitwise_{tag}",
                np.array_equal(again, acts[steps - k :]),
                k=k,
            ),
        ]
    return out


# -- running and reporting -------------------------------------------------------------------
def run_groups(groups: Iterable[tuple[str, Callable[[], list[Check]]]], log=print) -> list[Check]:
    """Run each group; one that raises becomes the failed check `<group>_ran` (traceback on
    stderr), and the others still run."""
    out: list[Check] = []
    for name, fn in groups:
        t0 = time.perf_counter()
        try:
            got = list(fn())
        except Exception as ex:  # report, don't hide
            traceback.print_exc()
            got = [check(f"{name}_ran", False, error=f"{type(ex).__name__}: {ex}"[:500])]
        for c in got:
            log(f"check {'ok  ' if c.ok else 'FAIL'} {c.name} {c.detail}")
        log(f"checks {name}: {time.perf_counter() - t0:.1f} s")
        out += got
    return out


def as_json(checks: Iterable[Check]) -> dict:
    """{name: {"ok": bool, **detail}}; a repeated name gets a suffix instead of hiding one."""
    d: dict = {}
    for c in checks:
        key, k = c.name, 2
        while key in d:
            key, k = f"{c.name}#{k}", k + 1
        d[key] = {"ok": c.ok, **c.detail}
    return d


def failed(checks: Iterable[Check]) -> list[str]:
    return [c.name for c in checks if not c.ok]


def verdict(checks: list[Check], what: str) -> str:
    """The last line a bench prints: every failed check by name, or how many passed."""
    bad = failed(checks)
    if bad:
        return f"{what}: FAILED {len(bad)} of {len(checks)} checks: {', '.join(bad)}"
    return f"{what}: all {len(checks)} checks passed"
