"""Capsule operations as tiny CUDA graphs, captured once per key and replayed ever after.

Issuing cuMemcpyDtoDAsync directly costs ~8-12 us of host time on the H200 machine (the driver
inspects both pointers on every call); launching an instantiated graph that holds the same
memcpy node costs a third of that (bench/run_all.py copy_paths). The graphs are built and
launched with the driver API (cuda-python), not torch.cuda.CUDAGraph, whose replay also
refreshes its RNG seeds with two extra kernels on every call. A capsule copy or checksum is a
pure function of its buffers' addresses and sizes, so the key names exactly what the graph
does: a cached graph is right for any later buffer at the same address.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from flashrt_ros.capsules.driver import check, drv, ensure_context, stream

MAX_GRAPHS = 1024  # (sessions + scratch) x slots x kinds stays far below this

_cache: dict[tuple, object] = {}  # key -> CUgraphExec
_capture_streams: dict[tuple[int, int], object] = {}
_lock = threading.Lock()


def run(key: tuple, fn: Callable[[object], None], index: int) -> None:
    """Launch the graph of `fn(stream)` (driver calls on that stream, no allocation) on the
    current torch stream of device `index`; the first call for a key captures it."""
    exe = _cache.get(key)
    if exe is None:
        if torch.cuda.is_current_stream_capturing():  # inside someone's capture: just issue it
            fn(stream(index))
            return
        exe = _capture(fn, index)
        with _lock:
            if len(_cache) >= MAX_GRAPHS:
                _cache.clear()
            _cache[key] = exe
    check(drv.cuGraphLaunch(exe, stream(index)), "cuGraphLaunch")


def _capture(fn: Callable[[object], None], index: int):
    ensure_context(index)
    sk = (index, threading.get_ident())  # one capture stream per thread: captures don't mix
    s = _capture_streams.get(sk)
    if s is None:
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        s = _capture_streams[sk] = check(drv.cuStreamCreate(flags), "cuStreamCreate")
    mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
    check(drv.cuStreamBeginCapture(s, mode), "cuStreamBeginCapture")
    try:
        fn(s)
    finally:
        graph = check(drv.cuStreamEndCapture(s), "cuStreamEndCapture")
    exe = check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    check(drv.cuGraphDestroy(graph), "cuGraphDestroy")
    return exe


def cached() -> int:
    return len(_cache)
