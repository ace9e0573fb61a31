"""Quick CUDA-path check of the capsule machinery (no ROS): the driver paths in use, restore and
branch bit for bit (also from another thread), checksum kernel against its definition, exact
copies (inside a foreign capture, under graph-cache eviction), and the 1 MB capsule row.

    python3 bench/cuda_check.py --out OUT_DIR      (GPU machine; writes OUT_DIR/cuda_check.json)

The checks are bench/checks.py's (test/test_cuda.py asserts the same). The JSON is written with
everything measured; then the exit status is 1 when any check failed, and the last line printed
names every failed one. Exit status 2: no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import checks as ck  # noqa: E402
from bench.timing import burst_timed, p  # noqa: E402
from flashrt_ros import load_policy  # noqa: E402
from flashrt_ros.cuda.copy import copy_bytes  # noqa: E402
from flashrt_ros.runtime.arena import Arena  # noqa: E402
from flashrt_ros.runtime.session import engine_entries  # noqa: E402

MB = 1 << 20

CHECK_GROUPS = [
    ("driver_paths", ck.driver_paths),
    ("capsules", ck.capsules_continue),
    ("checksum", ck.checksum_kernel),
    ("copies", ck.copies_exact),
    ("flight_ring", ck.flight_ring),
]


def capsule_1mb() -> dict:
    """The 1 MB row of run_all.capsule_row again, at this commit: copy vs per-tensor clone."""
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
    return {
        "bytes": arena.nbytes,
        "snapshot_p50_us": snap,
        "restore_p50_us": rest,
        "clone_p50_us": clone,
        "clone_over_snapshot": round(clone / snap, 1),
        "clone_over_restore": round(clone / rest, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for cuda_check.json")
    out = Path(ap.parse_args().out)
    if not torch.cuda.is_available():
        print("bench/cuda_check.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    r: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    results = ck.run_groups(CHECK_GROUPS, lambda *a: print(*a, flush=True))
    try:
        r["capsule_1MB"] = capsule_1mb()
    except Exception as ex:  # report, don't hide
        traceback.print_exc()
        r["capsule_1MB"] = None
        results.append(ck.check("capsule_1MB_ran", False, error=f"{type(ex).__name__}: {ex}"[:500]))
    r["checks"] = ck.as_json(results)
    r["failed_checks"] = ck.failed(results)
    r["all_ok"] = not r["failed_checks"]
    (out / "cuda_check.json").write_text(json.dumps(r, indent=1, default=str) + "\n")
    print(json.dumps(r, indent=1, default=str))
    print(ck.verdict(results, "bench/cuda_check.py"), flush=True)
    return 0 if r["all_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
