"""What a compressed camera costs: decode_compressed (the node's decode of one
sensor_msgs/CompressedImage frame) on this machine's CPU, for a 640x480 frame as JPEG (quality
75 and 90; libjpeg-turbo through simplejpeg) and PNG (Pillow), how much of its pace a Python
thread keeps meanwhile (the GIL is free during the decode), how long the hand-over of the pixels
(tobytes) takes with the GIL held, and the gaps another thread sees in its hold of the GIL while
frames decode. No ROS, no GPU.

    python3 bench/compressed_probe.py [--n 200] [--out FILE]
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import report  # noqa: E402
from flashrt_ros.obs.images import decode_compressed  # noqa: E402
from flashrt_ros.sim.camera import ArmCamera  # noqa: E402

H, W = 480, 640


def frame() -> np.ndarray:
    """A rendered sim-arm view with sensor-like noise: compresses like a camera frame, not like
    a flat test pattern."""
    img = ArmCamera(height=H, width=W).render(np.zeros(6), np.full(6, 0.4))
    noise = np.random.default_rng(0).integers(-6, 7, img.shape)
    return np.clip(img.astype(np.int16) + noise, 0, 255).astype(np.uint8)


def encode(img: np.ndarray, fmt: str, **kw) -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.fromarray(img).save(b, fmt, **kw)
    return b.getvalue()


def thread_pace(work) -> float:
    """Loop iterations per second of a counting Python thread while `work()` runs here."""
    done, counts = threading.Event(), []

    def count() -> None:
        n = 0
        while not done.is_set():
            n += 1
        counts.append(n)

    t = threading.Thread(target=count)
    t0 = time.perf_counter()
    t.start()
    work()
    done.set()
    t.join()
    return counts[0] / (time.perf_counter() - t0)


def pace_kept(data: bytes, seconds: float = 0.3) -> float:
    """A counting thread's pace while this one decodes back to back, over its pace alone."""

    def decodes() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            decode_compressed(data, (H, W, 3))

    return round(thread_pace(decodes) / thread_pace(lambda: time.sleep(seconds)), 2)


def tobytes_us(data: bytes, n: int) -> float:
    """p50 of the hand-over of a decoded frame's pixels into the bytes object decode_compressed
    returns (numpy's tobytes after simplejpeg for a JPEG, Pillow's Image.tobytes for a PNG):
    a copy that holds the GIL."""
    if data[:2] == b"\xff\xd8":
        import simplejpeg

        img = simplejpeg.decode_jpeg(data, colorspace="RGB")
        handover = img.tobytes
    else:
        from PIL import Image

        im = Image.open(io.BytesIO(data))
        im.load()
        if im.mode != "RGB":
            im = im.convert("RGB")
        handover = im.tobytes
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        handover()
        ts.append((time.perf_counter() - t0) * 1e6)
    return round(float(np.percentile(ts, 50)), 1)


def gil_gaps_us(data: bytes, seconds: float = 1.0) -> dict:
    """How long another Python thread is kept off the GIL: a thread that does nothing but read
    the clock records every gap over 20 us between two reads while this one decodes, 1 ms apart
    (the waits a stepping thread would see; switch interval 0.5 ms, as the node sets it)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    gaps: list[float] = []
    done = threading.Event()

    def clock() -> None:
        last = time.perf_counter()
        while not done.is_set():
            now = time.perf_counter()
            if now - last > 20e-6:
                gaps.append((now - last) * 1e6)
            last = now

    t = threading.Thread(target=clock)
    t.start()
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        decode_compressed(data, (H, W, 3))
        n += 1
        time.sleep(0.001)
    done.set()
    t.join()
    sys.setswitchinterval(old)
    g = np.asarray(gaps) if gaps else np.zeros(1)
    return {
        "decodes": n,
        "gaps_per_decode": round(len(gaps) / max(n, 1), 1),
        "gap_p50_us": round(float(np.percentile(g, 50)), 1),
        "gap_p90_us": round(float(np.percentile(g, 90)), 1),
        "gap_max_us": round(float(g.max()), 1),
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    except OSError:
        pass
    return f"{platform.machine()}, {os.cpu_count()} CPUs"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="decodes per format")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    img = frame()
    out = {"frame": f"{W}x{H} rgb8 (sim arm view + noise)", "machine": cpu_model()}
    for name, fmt, kw in [
        ("jpeg_q75", "JPEG", {"quality": 75}),
        ("jpeg_q90", "JPEG", {"quality": 90}),
        ("png", "PNG", {}),
    ]:
        data = encode(img, fmt, **kw)
        decode_compressed(data, (H, W, 3))  # warm
        ts = []
        for _ in range(a.n):
            t0 = time.perf_counter()
            decode_compressed(data, (H, W, 3))
            ts.append((time.perf_counter() - t0) * 1e3)
        out[name] = {
            "bytes": len(data),
            "decode_p50_ms": round(float(np.percentile(ts, 50)), 3),
            "decode_p99_ms": round(float(np.percentile(ts, 99)), 3),
            "other_thread_pace_kept": pace_kept(data),
            "tobytes_p50_us": tobytes_us(data, a.n),
            "other_thread_gil_gaps": gil_gaps_us(data),
        }
    report(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
