"""Where a queue tick's host time goes (issue: queue-tick p99 within 1.25x of p50): the phases
of Engine._tick timed apart, per tick kind, for one policy. No ROS; CUDA.

    python3 bench/queue_probe.py [--spec builtin:diffusion] [--size lerobot] [--ticks 400]
        [--no-fuse] [--out FILE]

Phases: "check" (check_dict of the observation), "stage" (the host memcpy of each input into its
pinned buffer), "replay" (launching the kind's graph), "wait" (until the device is done), and
"step" (Engine.step as a whole, timed on other ticks of the same run).

With --spin-variants (e.g. 0.002,1.0) every tick is timed whole instead, in rounds that alternate
runtime/engine.py's SPIN_WAIT_S (how long a step's wait polls before it blocks) on the same
engine, and the queue ticks are grouped by how many ticks after an infer tick they come: it tells
whether the queue ticks' tail is the first ones after a long (blocking) infer wait.
--warm-variants (e.g. none,check,check+upload) does the same for WARM_NEXT: what an infer tick
does for the next tick while the device runs it (Engine._warm). --pin-variants (none, pin,
nice, fifo, spin and + joins) does it for the stepping thread's scheduling: kept on one core,
nice -20, SCHED_FIFO, a wait that never blocks.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flashrt_ros.runtime.engine as engine_module  # noqa: E402
from bench.policies_bench import observations  # noqa: E402
from bench.timing import pct, report  # noqa: E402
from flashrt_ros import Engine, load_policy  # noqa: E402

ALL_CORES = os.sched_getaffinity(0)
SPIN_DEFAULT = engine_module.SPIN_WAIT_S  # the variants change it; "none" puts it back


def by_position(
    eng: Engine, obs: list, attr: str, values: dict[str, object], rounds: int, ticks: int
) -> dict:
    """Whole-tick times per value of runtime/engine.py's `attr` (SPIN_WAIT_S or WARM_NEXT),
    the queue ticks by their distance from the last infer tick (1 = right after it); rounds
    alternate the values on one engine."""
    keep = getattr(engine_module, attr)
    try:
        set_it = lambda v: setattr(engine_module, attr, v)  # noqa: E731
        return by_setting(eng, obs, set_it, values, rounds, ticks)
    finally:
        setattr(engine_module, attr, keep)


def pin_thread(how: str, core: int) -> None:
    """The calling thread: "pin" on one core (sched_setaffinity), "nice" at nice -20, "fifo"
    under SCHED_FIFO (priority 50: nothing of normal priority preempts it; needs root or
    CAP_SYS_NICE), "spin" with the step's wait polling throughout (SPIN_WAIT_S 1 s: it never
    blocks in the driver), any of these joined by + , or back to every core, nice 0, the
    normal scheduler and the default wait ("none")."""
    tid = threading.get_native_id()
    os.sched_setaffinity(0, {core} if "pin" in how else ALL_CORES)
    if "fifo" in how:
        os.sched_setscheduler(tid, os.SCHED_FIFO, os.sched_param(50))
    else:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, -20 if "nice" in how else 0)
    engine_module.SPIN_WAIT_S = 1.0 if "spin" in how else SPIN_DEFAULT


def by_setting(
    eng: Engine, obs: list, apply, values: dict[str, object], rounds: int, ticks: int
) -> dict:
    """by_position for any setting: `apply(value)` switches to it."""
    got: dict[str, dict[str, list[float]]] = {v: {} for v in values}
    gc.collect()
    gc.freeze()
    try:
        for _ in range(rounds):
            for label, v in values.items():
                apply(v)
                since = None
                for i in range(ticks):
                    kind = eng.next_tick_kind()
                    t0 = time.perf_counter()
                    eng.step(obs[i % len(obs)])
                    dt = (time.perf_counter() - t0) * 1e6
                    if i < 4:  # the switch of variant settles
                        since = 0 if kind != "queue" else since
                        continue
                    if kind == "queue":
                        since = None if since is None else since + 1
                        got[label].setdefault("queue", []).append(dt)
                        if since is None:  # no infer tick seen yet in this round
                            continue
                        key = f"queue+{since}"
                    else:
                        since, key = 0, kind
                    got[label].setdefault(key, []).append(dt)
    finally:
        gc.unfreeze()
    return {v: {k: pct(x) for k, x in sorted(d.items())} for v, d in got.items()}


def timed_tick(eng: Engine, s, k: int, o, variant: str = "normal") -> list[float]:
    """Engine._tick by hand for tick kind `k` of session `s`: the perf_counter times between
    its phases (check, stage, replay, wait). `variant` stages as the Engine does ("normal"),
    not at all ("no-stage") or by torch's threaded copy ("torch-stage")."""
    import torch

    t = [time.perf_counter()]
    x = eng._obs(o)
    t.append(time.perf_counter())
    names = s.tick_names[k]
    if variant == "normal":
        for n in names:
            s.inputs.stage(n, x[n])
    elif variant == "torch-stage":
        for n in names:
            s.inputs.host[n].copy_(torch.from_numpy(x[n]).view(s.inputs.host[n].shape))
    t.append(time.perf_counter())
    s.plans[k].replay()
    t.append(time.perf_counter())
    if eng._stream is not None:
        eng._wait()
    t.append(time.perf_counter())
    s.steps += 1
    return t


def post_infer(eng: Engine, obs: list, ticks: int, variant: str) -> dict:
    """Engine._tick's phases by hand on every tick, the queue ticks keyed by their distance
    from the last tick that staged inputs (queue+1, queue+2, queue+3 and later as queue+3).
    `variant`: "normal"; "no-stage" (ticks that read inputs skip the host copy into the pinned
    buffers: is the copy what cools the next tick?); "torch-stage" (that copy by torch, on its
    thread pool, so other cores' caches take it)."""
    s = eng.session("main")
    got: dict[str, dict[str, list[float]]] = {}
    since = None
    gc.collect()
    gc.freeze()
    try:
        for i in range(ticks):
            o = obs[i % len(obs)]
            k = eng.policy.tick_kind(s.steps) if len(s.plans) > 1 else 0
            kind = eng.policy.tick_kinds[k]
            t = timed_tick(eng, s, k, o, variant)
            names = s.tick_names[k]
            if names:
                since, key = 0, kind
            else:
                since = None if since is None else since + 1
                key = "queue" if since is None else f"queue+{min(since, 3)}"
            if i < 8:
                continue
            ph = got.setdefault(key, {})
            for name, t0, t1 in zip(("check", "stage", "replay", "wait"), t, t[1:], strict=False):
                ph.setdefault(name, []).append((t1 - t0) * 1e6)
            ph.setdefault("tick", []).append((t[-1] - t[0]) * 1e6)
    finally:
        gc.unfreeze()
    return {k: {n: pct(v) for n, v in ph.items()} for k, ph in sorted(got.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="builtin:diffusion")
    ap.add_argument("--size", default="lerobot")
    ap.add_argument("--steps", type=int, default=10, help="num_inference_steps (diffusion)")
    ap.add_argument("--ticks", type=int, default=400)
    ap.add_argument("--no-fuse", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="a new copy of the images each tick")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--spin-variants", default="", help="SPIN_WAIT_S values, comma-separated")
    ap.add_argument(
        "--warm-variants",
        default="",
        help="runtime/engine.py WARM_NEXT values, comma-separated, each none or words joined "
        "by + (e.g. none,check,upload,check+upload)",
    )
    ap.add_argument(
        "--pin-variants",
        default="",
        help="the stepping thread's scheduling, comma-separated: none, or words joined by +: "
        "pin (one core), nice (nice -20), fifo (SCHED_FIFO 50), spin (the wait never blocks)",
    )
    ap.add_argument("--core", type=int, default=3, help="the core --pin-variants pins to")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each variant value")
    ap.add_argument(
        "--post-infer",
        default="",
        help="variants of post_infer(), comma-separated: normal, no-stage, torch-stage",
    )
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    over = {"size": a.size}
    if "diffusion" in a.spec:
        over["num_inference_steps"] = a.steps
    eng = Engine(load_policy(a.spec, **over), device=a.device, fuse=not a.no_fuse)
    obs = observations(eng, 64)
    if a.post_infer:
        out = {"spec": a.spec, "size": a.size, "fuse": not a.no_fuse, "post_infer": {}}
        for _ in range(a.rounds):
            for v in a.post_infer.split(","):
                out["post_infer"].setdefault(v, []).append(post_infer(eng, obs, a.ticks, v))
        report(out, a.out)
        return 0
    if a.spin_variants:
        spins = {x: float(x) for x in a.spin_variants.split(",")}
        out = {"spec": a.spec, "size": a.size, "fuse": not a.no_fuse, "by_spin": {}}
        out["by_spin"] = by_position(eng, obs, "SPIN_WAIT_S", spins, a.rounds, a.ticks)
        report(out, a.out)
        return 0
    if a.pin_variants:
        pins = {x: x for x in a.pin_variants.split(",")}
        out = {"spec": a.spec, "size": a.size, "fuse": not a.no_fuse, "core": a.core}
        try:
            out["by_pin"] = by_setting(
                eng, obs, lambda v: pin_thread(v, a.core), pins, a.rounds, a.ticks
            )
        finally:
            pin_thread("none", a.core)
        report(out, a.out)
        return 0
    if a.warm_variants:
        warms = {
            x: tuple(w for w in x.split("+") if w != "none") for x in a.warm_variants.split(",")
        }
        out = {"spec": a.spec, "size": a.size, "fuse": not a.no_fuse, "by_warm": {}}
        out["by_warm"] = by_position(eng, obs, "WARM_NEXT", warms, a.rounds, a.ticks)
        report(out, a.out)
        return 0
    s = eng.session("main")
    phases: dict[str, dict[str, list[float]]] = {}
    whole: dict[str, list[float]] = {}
    gc.collect()
    gc.freeze()
    for i in range(a.ticks):
        o = obs[i % len(obs)]
        if a.fresh:
            o = {k: v.copy() for k, v in o.items()}
        kind = eng.next_tick_kind()
        if i % 2:
            t0 = time.perf_counter()
            eng.step(o)
            whole.setdefault(kind, []).append((time.perf_counter() - t0) * 1e6)
            continue
        k = eng.policy.tick_kind(s.steps) if len(s.plans) > 1 else 0
        t = timed_tick(eng, s, k, o)
        ph = phases.setdefault(kind, {})
        for name, t0, t1 in zip(("check", "stage", "replay", "wait"), t, t[1:], strict=False):
            ph.setdefault(name, []).append((t1 - t0) * 1e6)
    gc.unfreeze()
    out = {
        "spec": a.spec,
        "size": a.size,
        "fuse": not a.no_fuse,
        "fresh_images": a.fresh,
        "io_in_graph": s.io_in_graph,
        "inputs": {n: list(v.shape) for n, v in s.inputs.np.items()},
        "step": {k: pct(v[2:]) for k, v in whole.items()},
        "phases": {k: {n: pct(v[2:]) for n, v in ph.items()} for k, ph in phases.items()},
    }
    report(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
