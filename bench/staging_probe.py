"""How to copy a camera image into its pinned staging buffer (the one host copy of a tick that
reads images): numpy's single-threaded copy, which InputBuffers.stage uses, against torch's
copy_, which splits a large copy over its intra-op threads. No ROS; CUDA (pinned memory).

    python3 bench/staging_probe.py [--n 2000] [--hw 480x640] [--threads 1,2,4,8] [--out FILE]

Each sample copies one of 8 distinct source images (as a stream of camera frames would be,
not one image hot in the cache) into the same pinned buffer; p50/p99 per way of copying.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import report  # noqa: E402


def times(copy, sources: list[np.ndarray], n: int) -> list[float]:
    out = []
    for i in range(n + 20):
        src = sources[i % len(sources)]
        t0 = time.perf_counter()
        copy(src)
        t1 = time.perf_counter()
        if i >= 20:
            out.append((t1 - t0) * 1e6)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--hw", default="480x640")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    h, w = (int(x) for x in a.hw.split("x"))
    pin = torch.cuda.is_available()
    dst = torch.zeros((h, w, 3), dtype=torch.uint8, pin_memory=pin)
    dst_np = dst.numpy()
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(8)]
    results: dict[str, list[float]] = {}
    gc.collect()
    gc.freeze()
    results["numpy_copyto"] = times(lambda s: np.copyto(dst_np, s), sources, a.n)
    default_threads = torch.get_num_threads()
    for k in [int(x) for x in a.threads.split(",")]:
        torch.set_num_threads(k)
        results[f"torch_copy_{k}_threads"] = times(
            lambda s: dst.copy_(torch.from_numpy(s)), sources, a.n
        )
    torch.set_num_threads(default_threads)
    summary = {
        k: {
            "p50_us": round(float(np.percentile(v, 50)), 1),
            "p99_us": round(float(np.percentile(v, 99)), 1),
            "ratio": round(float(np.percentile(v, 99) / np.percentile(v, 50)), 2),
        }
        for k, v in results.items()
    }
    meta = {"bytes": h * w * 3, "pinned": pin, "torch_threads": default_threads}
    report({**meta, "copies": summary}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
