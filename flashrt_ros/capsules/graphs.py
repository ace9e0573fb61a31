"""Capsule operations as tiny CUDA graphs, captured once per key and replayed ever after.

Issuing cuMemcpyDtoDAsync directly costs ~7.6 us of host time on the H200 machine (the driver
inspects both pointers on every call); replaying a graph holding the same memcpy node costs
~2.9 us (bench/run_all.py copy_paths). A capsule copy or checksum is a pure function of its
buffers' addresses and sizes, so the key names exactly what the graph does: a cached graph is
right for any later buffer at the same address, and stale entries are merely unused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MAX_GRAPHS = 1024  # (sessions + scratch) x slots x directions stays far below this

_cache: dict[tuple, torch.cuda.CUDAGraph] = {}
_side: dict[int, torch.cuda.Stream] = {}


def run(key: tuple, fn: Callable[[], None], device: torch.device) -> None:
    """Do what `fn` issues (CUDA work on the current stream, no allocation) by replaying its
    graph; the first call for a key captures it. Inside another capture, `fn` runs as is."""
    g = _cache.get(key)
    if g is None:
        if torch.cuda.is_current_stream_capturing():
            fn()
            return
        g = _capture(fn, device)
        if len(_cache) >= MAX_GRAPHS:
            _cache.clear()
        _cache[key] = g
    g.replay()


def _capture(fn: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    # capture_begin/end directly: torch.cuda.graph() would also run gc.collect() and empty the
    # allocator cache on every capture. thread_local: another thread's CUDA calls stay legal.
    index = torch.device(device).index or 0
    cur = torch.cuda.current_stream(index)
    side = _side.get(index)
    if side is None:
        side = _side[index] = torch.cuda.Stream(index)
    side.wait_stream(cur)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        g.capture_begin(capture_error_mode="thread_local")
        try:
            fn()
        finally:
            g.capture_end()
    cur.wait_stream(side)
    return g


def cached() -> int:
    return len(_cache)
