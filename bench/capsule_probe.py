"""Where a checkpoint's host time goes on CUDA (the node's ~/checkpoint handler took ~250 us p50
on the H200 machine): Engine.checkpoint timed whole and part by part. No ROS.

    python3 bench/capsule_probe.py [--policy builtin:hybrid] [--n 300] [--out FILE]

Parts: "probe_issue" (the probe pass launched; with the kernels it also fills the free slot),
"probe_wait" (the one host wait), "probe_read" (flags and hex checksum from pinned memory),
"pool_put" (the pool's bookkeeping; without the kernels also the slot's copies queued),
"pool_info"; and, whole, "checkpoint", "drop" and "restore" (unverified, then verified).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import report  # noqa: E402
from flashrt_ros import Engine, load_policy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="builtin:hybrid")
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fuse", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--gap-ms",
        type=float,
        default=0.0,
        help="before each round, one step and then this long idle, as between a node's ticks "
        "(0: back to back, a hot loop)",
    )
    ap.add_argument(
        "--gap-spin",
        action="store_true",
        help="spend the gap spinning instead of sleeping (a busy core: cold caches without the "
        "idle core's wake-up)",
    )
    ap.add_argument(
        "--six-nodes",
        action="store_true",
        help="the probe's older pass: a graph of six nodes (memset, checksum, finite, the two "
        "slot copies and the readback's copy) instead of the one kernel",
    )
    a = ap.parse_args()
    if a.six_nodes:
        from flashrt_ros.runtime import probe as probe_mod

        probe_mod.ONE_KERNEL = False
    eng = Engine(load_policy(a.policy), device=a.device, fuse=a.fuse)
    spec = eng.observation_spec()
    obs = {k: np.zeros(v["shape"], np.float32) for k, v in spec.items() if v["kind"] == "vector"}
    for _ in range(5):
        eng.step(obs)
    t: dict[str, list[float]] = {}

    def add(name: str, t0: float, t1: float) -> None:
        t.setdefault(name, []).append((t1 - t0) * 1e6)

    s = eng.session("main")
    gap = a.gap_ms * 1e-3

    def idle() -> None:
        if not gap:
            return
        eng.step(obs)
        end = time.perf_counter() + gap
        if a.gap_spin:
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(gap)

    for i in range(a.n + 10):
        idle()
        c0 = time.perf_counter()
        info = eng.checkpoint("main")
        c1 = time.perf_counter()
        eng.restore(info.id, "main", verify=False)
        c2 = time.perf_counter()
        eng.restore(info.id, "main", verify=True)
        c3 = time.perf_counter()
        eng.drop(info.id)
        c4 = time.perf_counter()
        idle()
        p0 = time.perf_counter()
        probe = eng._probe_of(s)
        slot = eng.pool.free_slot() if probe.fused else None
        if slot is None:  # the pass, then the pool's copies
            probe.issue()
        else:  # the pass fills the free slot too
            probe.issue(eng.pool.slot_row(slot), eng.pool.digest_row(slot))
        p1 = time.perf_counter()
        if eng._stream is not None:
            eng._wait()
        p2 = time.perf_counter()
        _bad, checksum = probe.result()
        p3 = time.perf_counter()
        kw = dict(session=s.name, parent_id=s.parent_id, step=s.steps, checksum=checksum)
        if slot is None:
            cap = eng.pool.put(s.arena.buf, digest=probe.digest, **kw)
        else:
            cap = eng.pool.adopt(slot, **kw)
        p4 = time.perf_counter()
        eng.pool.info(cap)
        p5 = time.perf_counter()
        eng.drop(cap.info.id)
        if i < 10:
            continue
        add("checkpoint", c0, c1)
        add("restore", c1, c2)
        add("restore_verify", c2, c3)
        add("drop", c3, c4)
        add("probe_issue", p0, p1)
        add("probe_wait", p1, p2)
        add("probe_read", p2, p3)
        add("pool_put", p3, p4)
        add("pool_info", p4, p5)
    out = {
        "policy": a.policy,
        "device": str(eng.device),
        "state_bytes": eng.state_nbytes,
        "pass_fills_slot": bool(eng._probe_of(s).fused),
        "pass": "one kernel"
        if eng._probe_of(s)._one is not None
        else ("six nodes" if eng._probe_of(s).fused else "torch"),
        "gap_ms": a.gap_ms,
        "gap": "spin" if a.gap_spin else "sleep",
        "p50_us": {k: round(float(np.median(v)), 1) for k, v in t.items()},
        "p99_us": {k: round(float(np.percentile(v, 99)), 1) for k, v in t.items()},
    }
    report(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
