"""The tick floor: how evenly the smallest captured-graph tick runs on this machine, timed the
way bench/policies_bench.py times our ticks. No ROS; CUDA.

    python3 bench/tick_floor.py [--ticks 2000] [--busy-ms 8] [--after 7] [--out FILE]

A chunked policy's queue tick (bench/policies_bench.py) checks an observation, replays a small
graph and waits for it: 40-60 us, whose p99 has come out at 1.5-5x its p50. This measures the
same loop around the least a tick can be, so the queue rows have a floor from the same run:

- "steady": a graph of one kernel (14 floats updated in place, as an action) and the copy of
  those floats to pinned host memory, replayed back to back, each replay waited for as
  Engine._wait waits (an event polled for SPIN_WAIT_S, then a blocking wait); per tick, the
  host wall time from the replay to the end of the wait;
- "host": the same loop without the device (a 14-float numpy copy and finite check): how
  evenly plain Python runs here;
- "after_busy": the same tiny tick right after a graph that keeps the device busy for
  ~--busy-ms (a chain of matmuls, waited for the same way), as a queue tick follows an infer
  tick; grouped by distance from the busy graph ("+1" is the first tick after it).

policies_bench.py runs `measure()` after the policies on CUDA ("tick_floor" in its JSON;
`--no-floor` skips it).

`--split` adds "split": where the first ticks after a busy graph lose their time, for two busy
graphs of the same length: the matmul chain (streams memory through the caches) and a sleeping
kernel (torch.cuda._sleep: the device spins, touching no memory); and the matmuls once more
with a twin of the tiny graph (the same kernels, another executable and buffers) replayed
untimed before the timed ticks. Per tick by position: the host's replay() call, the wait after
it, and the device's own time from an event recorded just before the replay to one just after
it (it includes the launch's time in the device's queue). A slow "+1" under both busy graphs
is not the caches the matmuls evicted.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.timing import pct  # noqa: E402
from flashrt_ros.runtime.engine import SPIN_WAIT_S  # noqa: E402

MAX_MATMULS = 4096  # a bound on the busy graph's size, whatever the calibration says


class Waiter:
    """Engine._wait's way: record an event, poll it up to SPIN_WAIT_S, then block."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self.done = torch.cuda.Event()

    def __call__(self) -> None:
        self.done.record(self.stream)
        t_end = time.perf_counter() + SPIN_WAIT_S
        while not self.done.query():
            if time.perf_counter() > t_end:
                self.done.synchronize()
                return


def capture(fn, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """fn run twice (warm-up), then captured; all on `stream`, which the caller has made the
    current stream, so that replays and Waiter's event are on it too."""
    assert torch.cuda.current_stream() == stream, "make `stream` current first"
    fn()
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        fn()
    torch.cuda.synchronize()
    # The graph holds the addresses of the tensors fn's closure reads and writes, not the
    # tensors: kept alive with it, or their memory goes back to the allocator while replays
    # still write there (an illegal memory access in --split's first run, c1bc984).
    g.keep = fn
    return g


def tiny_graph(stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One kernel on a 14-float static buffer and its copy to pinned host memory."""
    dev = torch.zeros(14, device="cuda")
    host = torch.zeros(14, pin_memory=True)

    def fn() -> None:
        dev.mul_(0.5).add_(1.0)
        host.copy_(dev, non_blocking=True)

    return capture(fn, stream), host


def busy_graph(stream: torch.cuda.Stream, ms: float, wait: Waiter) -> tuple:
    """A chain of 2048x2048 matmuls sized to keep the device busy for about `ms`."""
    a = torch.randn(2048, 2048, device="cuda")
    b = torch.randn(2048, 2048, device="cuda") / 2048**0.5

    def chain(n: int):
        def fn() -> None:
            x = a
            for _ in range(n):
                x = x @ b
            a.copy_(x)

        return fn

    per = replay_s(capture(chain(16), stream), wait) / 16
    n = min(MAX_MATMULS, max(1, round(ms / 1e3 / per)))
    return capture(chain(n), stream), n


def replay_s(graph: torch.cuda.CUDAGraph, wait: Waiter) -> float:
    """Median seconds of five replays of `graph`, each waited for."""
    t = []
    for _ in range(5):
        t0 = time.perf_counter()
        graph.replay()
        wait()
        t.append(time.perf_counter() - t0)
    return float(np.median(t))


def sleep_graph(stream: torch.cuda.Stream, ms: float, wait: Waiter) -> tuple:
    """A graph of one sleeping kernel (torch.cuda._sleep) sized to about `ms`."""

    def spin(cycles: int):
        return lambda: torch.cuda._sleep(cycles)

    cycles = max(
        1000, round(1_000_000 * ms / 1e3 / replay_s(capture(spin(1_000_000), stream), wait))
    )
    return capture(spin(cycles), stream), cycles


def split(stream, busy, tiny, host, wait: Waiter, rounds: int, after: int, primer=None) -> dict:
    """Per position after `busy`: host replay() us, wait us, device us (events). `primer`, a
    graph replayed and waited for between `busy` and the timed ticks (untimed)."""
    ev = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(after)
    ]
    rows: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        busy.replay()
        wait()
        if primer is not None:
            primer.replay()
            wait()
        for k in range(after):
            a, b = ev[k]
            a.record(stream)
            t0 = time.perf_counter()
            tiny.replay()
            t1 = time.perf_counter()
            b.record(stream)
            wait()
            np.isfinite(host.numpy()).all()
            t2 = time.perf_counter()
            r = rows.setdefault(f"+{k + 1}", {"replay": [], "wait": [], "tick": [], "device": []})
            r["replay"].append((t1 - t0) * 1e6)
            r["wait"].append((t2 - t1) * 1e6)
            r["tick"].append((t2 - t0) * 1e6)
        for k in range(after):
            a, b = ev[k]
            rows[f"+{k + 1}"]["device"].append(a.elapsed_time(b) * 1e3)
    return {pos: {part: pct(v) for part, v in r.items()} for pos, r in rows.items()}


def measure_split(ticks: int, busy_ms: float, after: int) -> dict:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        wait = Waiter(stream)
        tiny, host = tiny_graph(stream)
        mm, n_mm = busy_graph(stream, busy_ms, wait)
        sl, cycles = sleep_graph(stream, busy_ms, wait)
        rounds = max(1, ticks // after)
        gc.collect()
        gc.freeze()
        try:
            twin, _ = tiny_graph(stream)  # the same kernels, another executable and buffers
            out = {
                "matmuls": {"n": n_mm, **split(stream, mm, tiny, host, wait, rounds, after)},
                "sleep": {"cycles": cycles, **split(stream, sl, tiny, host, wait, rounds, after)},
                "matmuls_twin_primed": split(stream, mm, tiny, host, wait, rounds, after, twin),
            }
        finally:
            gc.unfreeze()
    return out


def measure(ticks: int, busy_ms: float, after: int) -> dict:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # everything below runs, and is waited for, on `stream`
        return _measure(stream, ticks, busy_ms, after)


def _measure(stream: torch.cuda.Stream, ticks: int, busy_ms: float, after: int) -> dict:
    wait = Waiter(stream)
    tiny, host = tiny_graph(stream)
    busy, n_mm = busy_graph(stream, busy_ms, wait)
    gc.collect()
    gc.freeze()  # as the benches do: no collector pass over torch's objects in a tick
    try:
        steady = []
        for _ in range(ticks + 20):
            t0 = time.perf_counter()
            tiny.replay()
            wait()
            np.isfinite(host.numpy()).all()
            steady.append((time.perf_counter() - t0) * 1e6)
        src, dst = np.zeros(14, np.float32), np.zeros(14, np.float32)
        plain = []
        for _ in range(ticks + 20):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            np.isfinite(dst).all()
            plain.append((time.perf_counter() - t0) * 1e6)
        by_pos: dict[str, list[float]] = {}
        busy_t = []
        for _ in range(max(1, ticks // after)):
            t0 = time.perf_counter()
            busy.replay()
            wait()
            busy_t.append((time.perf_counter() - t0) * 1e6)
            for k in range(1, after + 1):
                t0 = time.perf_counter()
                tiny.replay()
                wait()
                np.isfinite(host.numpy()).all()
                by_pos.setdefault(f"+{k}", []).append((time.perf_counter() - t0) * 1e6)
    finally:
        gc.unfreeze()
    after_all = [x for v in by_pos.values() for x in v]
    return {
        "steady": pct(steady[20:]),
        "host": pct(plain[20:]),
        "after_busy": {
            "busy": {**pct(busy_t), "matmuls": n_mm},
            **{k: pct(v) for k, v in by_pos.items()},
            "all": pct(after_all),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ticks", type=int, default=2000, help="steady ticks (and after-busy ones)")
    ap.add_argument("--busy-ms", type=float, default=8.0, help="the busy graph's length (ms)")
    ap.add_argument("--after", type=int, default=7, help="tiny ticks after each busy graph")
    ap.add_argument("--split", action="store_true", help="also the split after busy graphs")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("tick_floor: needs CUDA (it times captured graphs)", file=sys.stderr)
        return 2
    if a.ticks < 10 or a.after < 1 or a.busy_ms <= 0:
        print("tick_floor: --ticks >= 10, --after >= 1 and --busy-ms > 0", file=sys.stderr)
        return 2
    r = measure(a.ticks, a.busy_ms, a.after)
    if a.split:
        r["split"] = measure_split(a.ticks, a.busy_ms, a.after)
    text = json.dumps(r, indent=1)
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
