"""Quick CUDA-path check of the capsule machinery (no ROS): exactness, graph cache eviction,
copies inside a foreign capture, device-context handling from another thread.

    python3 bench/cuda_check.py --out OUT_DIR      (GPU machine; writes cuda_check.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import burst_timed, p  # noqa: E402
from flashrt_ros import Engine, load_policy  # noqa: E402
from flashrt_ros.capsules.checksum import device_checksum, reference_digest  # noqa: E402
from flashrt_ros.cuda import graphs  # noqa: E402
from flashrt_ros.cuda.copy import copy_bytes  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    r: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    rng = np.random.default_rng(0)
    obs = rng.uniform(-1, 1, (120, 12))
    eng = Engine(load_policy("builtin:hybrid"), device="cuda", seed=0, capsule_slots=4)
    for o in obs[:20]:
        eng.step(o)
    cap = eng.checkpoint(name="a")
    first = np.array([eng.step(o) for o in obs[20:80]])
    eng.restore("a", verify=True)
    r["restore_bitwise"] = bool(np.array_equal(first, [eng.step(o) for o in obs[20:80]]))
    eng.branch("a", "b")
    r["branch_bitwise"] = bool(np.array_equal(first, [eng.step(o, "b") for o in obs[20:80]]))

    # from another thread (rclpy's executor calls services from one): same results
    res = {}

    def other() -> None:
        eng.restore("a", verify=True)
        res["x"] = np.array([eng.step(o) for o in obs[20:80]])

    t = threading.Thread(target=other)
    t.start()
    t.join()
    r["other_thread_bitwise"] = bool(np.array_equal(first, res["x"]))
    r["checksum_equal"] = eng.capsule("a").checksum == cap.checksum

    # copies: small (graph) and large (direct) exact; inside a torch capture; cache eviction
    ok = []
    for n in (256, 1 << 20, 8 << 20, (8 << 20) + 256, 64 << 20):
        a = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        copy_bytes(b, a)
        ok.append(torch.equal(a, b))
        ok.append(
            torch.equal(
                device_checksum(a, out=torch.empty(2, dtype=torch.int64, device="cuda")),
                reference_digest(a),
            )
        )
    r["copies_and_checksums_exact"] = all(ok)
    a = torch.randint(0, 256, (4096,), dtype=torch.uint8, device="cuda")
    b = torch.zeros_like(a)
    copy_bytes(b, a)  # cached key now
    g = torch.cuda.CUDAGraph()
    c = torch.zeros_like(a)
    with torch.cuda.graph(g):
        copy_bytes(c, a)  # cached key inside a foreign capture: issued directly
    g.replay()
    torch.cuda.synchronize()
    r["copy_inside_foreign_capture"] = bool(torch.equal(c, a))
    old = graphs.MAX_GRAPHS
    graphs.MAX_GRAPHS = 8
    bufs = [torch.randint(0, 256, (1024,), dtype=torch.uint8, device="cuda") for _ in range(20)]
    dst = torch.empty_like(bufs[0])
    ev = []
    for x in bufs:
        copy_bytes(dst, x)
        ev.append(torch.equal(dst, x))
    r["eviction_keeps_results_exact"] = all(ev)
    r["eviction_bounds_the_cache"] = graphs.cached() <= 8
    graphs.MAX_GRAPHS = old
    # the 1 MB row of run_all.capsule_row again, at this commit: copy vs per-tensor clone
    from bench.run_all import MB
    from flashrt_ros.runtime.arena import Arena
    from flashrt_ros.runtime.session import engine_entries

    kv = max(16, MB // (2 * 4 * 256 * 4))
    pol = load_policy("builtin:hybrid", d_model=256, n_layers=4, n_heads=8, kv_len=kv)
    arena = Arena(pol.state_spec() + engine_entries(pol), torch.device("cuda"))
    arena.buf.random_()
    slot = torch.empty_like(arena.buf)
    views = list(arena.views.values())
    warm = time.perf_counter() + 1.0  # clocks up first, as run_all.copy_paths does
    while time.perf_counter() < warm:
        copy_bytes(slot, arena.buf)
        torch.cuda.synchronize()
    snap = p(burst_timed(lambda: copy_bytes(slot, arena.buf), 200), 50)
    rest = p(burst_timed(lambda: copy_bytes(arena.buf, slot), 200), 50)
    clone = p(burst_timed(lambda: [v.clone() for v in views], 200), 50)
    r["capsule_1MB"] = {
        "bytes": arena.nbytes,
        "snapshot_p50_us": snap,
        "restore_p50_us": rest,
        "clone_p50_us": clone,
        "clone_over_snapshot": round(clone / snap, 1),
        "clone_over_restore": round(clone / rest, 1),
    }
    r["graphs_enabled"] = graphs._ok
    r["all_ok"] = all(v for k, v in r.items() if isinstance(v, bool))
    (out / "cuda_check.json").write_text(json.dumps(r, indent=1) + "\n")
    print(json.dumps(r, indent=1))
    return 0 if r["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
