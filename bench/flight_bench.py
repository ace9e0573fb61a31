"""The flight recorder on the GPU: what a ring write inside the captured step costs per tick,
and what a rewind costs against a restore (no ROS needed).

    python3 bench/flight_bench.py --out DIR [--quick] [--device cuda|cpu]

Prints and writes DIR/flight.json: {"flight": row of builtin:hybrid, "variants": [row of the
~2 MB-state variant], "checks": {...}}. Step times are host wall time per Engine.step (which
waits for the device), with flight_ticks=0 and flight_ticks=N timed interleaved, tick by tick,
in one process, each engine going first on every other tick. Rewind and restore are host wall
time of the call plus a stream sync, each after one untimed step, on the same engine. Exits 1
when a rewind's continuation is not bit-identical to the original run, or a ring slot is not
the state it claims to hold.
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

from bench.checks import obs_stream, record_steps  # noqa: E402
from bench.timing import p as pct  # noqa: E402
from flashrt_ros import Engine, load_policy  # noqa: E402


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_sync(device: str):
    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def engine(spec: dict, device: str, ticks: int, **kw) -> Engine:
    policy = load_policy(spec["policy"], **spec["overrides"])
    return Engine(policy, device=device, seed=0, flight_ticks=ticks, **kw)


# -- correctness ---------------------------------------------------------------------------------
def check_rewind(spec: dict, device: str, ticks: int, steps: int, ks: list[int], **kw) -> dict:
    """Run `steps` ticks, snapshotting the state after each; then the ring slots must equal those
    snapshots, and for each k a rewind plus the same observations must replay the original
    actions bit for bit (across a ring wrap when steps > ticks)."""
    e = engine(spec, device, ticks, **kw)
    obs = obs_stream(steps)
    acts, snaps = record_steps(e, obs)
    held = e.flight()
    s = e.session("main")
    slots_ok = all(bytes(s.flight_state(t).cpu().numpy()) == snaps[t] for t in held)
    cont_ok, worst = True, 0.0
    for k in ks:
        t = e.rewind(k)
        again = np.array([e.step(o) for o in obs[t:]])
        same = np.array_equal(again, acts[t:]) and e.state_bytes() == snaps[steps]
        worst = max(worst, float(np.abs(again - acts[t:]).max()))
        cont_ok = cont_ok and same
    return {
        "held": [held[0], held[-1]],
        "slots_match_snapshots": slots_ok,
        "rewind_continuation_identical": cont_ok,
        "rewind_continuation_max_abs": worst,
        "captured": e.session("main").captured,
    }


# -- timing --------------------------------------------------------------------------------------
def timed_after_step(e: Engine, obs: np.ndarray, op, sync) -> np.ndarray:
    """Host wall time in microseconds of ``op()`` plus a sync, each after one untimed step of
    ``e`` on the next of ``obs``."""
    out = np.empty(len(obs))
    for i, o in enumerate(obs):
        e.step(o)
        sync()
        t0 = time.perf_counter()
        op()
        sync()
        out[i] = (time.perf_counter() - t0) * 1e6
    return out


def measure(spec: dict, device: str, ticks: int, iters: int, warmup: int, sync) -> dict:
    off, on = engine(spec, device, 0), engine(spec, device, ticks)
    obs = obs_stream(warmup + iters, seed=1)
    for o in obs[:warmup]:
        off.step(o)
        on.step(o)
    t_off, t_on = np.empty(iters), np.empty(iters)
    diff = 0.0
    for i, o in enumerate(obs[warmup:]):  # interleaved: both see the same machine state,
        first, second = (off, on) if i % 2 == 0 else (on, off)  # and each goes first half the time
        t0 = time.perf_counter()
        a = first.step(o)
        t1 = time.perf_counter()
        b = second.step(o)
        t2 = time.perf_counter()
        d1, d2 = (t1 - t0) * 1e6, (t2 - t1) * 1e6
        t_off[i], t_on[i] = (d1, d2) if first is off else (d2, d1)
        diff = max(diff, float(np.abs(a - b).max()))
    # rewind vs restore on the same engine, each after one untimed step
    cap = on.checkpoint()
    extra = obs_stream(iters, seed=2)
    t_rw = timed_after_step(on, extra, lambda: on.rewind(1), sync)
    t_rs = timed_after_step(on, extra, lambda: on.restore(cap.id, verify=False), sync)
    t_rsv = timed_after_step(on, extra, lambda: on.restore(cap.id, verify=True), sync)
    return {
        "policy": spec["name"],
        "state_nbytes": on.state_nbytes,
        "ring_kernel": on.session("main").ring_kernel,  # cuda/ring.py (else torch's scatter)
        "step_p50_us_off": pct(t_off, 50),
        "step_p99_us_off": pct(t_off, 99),
        "step_p50_us_on": pct(t_on, 50),
        "step_p99_us_on": pct(t_on, 99),
        "flight_ticks": ticks,
        "flight_bytes": on.flight_bytes(),
        "rewind_p50_us": pct(t_rw, 50),
        "restore_p50_us": pct(t_rs, 50),
        "restore_verify_p50_us": pct(t_rsv, 50),
        "on_vs_off_action_max_abs": diff,
        "iters": iters,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="folder for flight.json")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the CPU smoke test)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ticks", type=int, default=1000, help="flight_ticks of the timed engine")
    args = ap.parse_args()
    quick, device = args.quick, args.device
    sync = make_sync(device)
    ticks = 16 if quick else args.ticks
    iters, warmup = (30, 5) if quick else (3000, 300)
    base = {"name": "builtin:hybrid", "policy": "builtin:hybrid", "overrides": {}}
    big = dict(d_model=256, n_layers=4, n_heads=8, kv_len=256)
    if quick:
        big = dict(d_model=32, n_layers=1, n_heads=2, kv_len=16)
    variant = {
        "name": "builtin:hybrid " + ",".join(f"{k}={v}" for k, v in big.items()),
        "policy": "builtin:hybrid",
        "overrides": big,
    }
    checks: dict = {"device": device, "torch": torch.__version__}
    ok = True
    cases = [("default", {}), ("graph_unfused", {"fuse": False})]
    cases.append(("eager", {"use_graph": False}))
    if not device.startswith("cuda"):
        cases = cases[:1]
    steps, ring = (12, 5) if quick else (150, 64)  # steps > ring: the checks cross a wrap
    runs = [(f"hybrid_{label}", base, [1, 2, ring - 1], kw) for label, kw in cases]
    runs.append(("variant_default", variant, [1, ring - 1], {}))
    for name, spec, ks, kw in runs:
        r = check_rewind(spec, device, ring, steps, ks, **kw)
        checks[name] = r
        ok = ok and r["rewind_continuation_identical"] and r["slots_match_snapshots"]
        log(name, r)
    rows = []
    for spec in (base, variant):
        rows.append(measure(spec, device, ticks, iters, warmup, sync))
        log(rows[-1])
    out = {"flight": rows[0], "variants": rows[1:], "checks": checks, "ok": ok}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "flight.json").write_text(text + "\n")
    if not ok:
        log("FAILED: a rewind continuation or a ring slot is not bit-identical")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
