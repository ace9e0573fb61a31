"""Small fixed operations (copies, a checksum) as tiny CUDA graphs, captured once per key and
replayed ever after.

Issuing cuMemcpyDtoDAsync directly costs ~8-12 us of host time on the H200 machine (the driver
inspects both pointers on every call); launching an instantiated graph that holds the same
memcpy node costs a third of that (bench/run_all.py copy_paths). The graphs are built and
launched with the driver API (cuda-python), not torch.cuda.CUDAGraph, whose replay also
refreshes its RNG seeds with two extra kernels on every call. A device-to-device copy or a
checksum is a pure function of its buffers' addresses and sizes, so `run` caches it by them and
launches it for any later buffer at the same address. A graph that also writes pinned host
memory is not cached that way: the checkpoint pass (runtime/probe.py), keyed by every address and
size it holds, crashed the driver when a graph captured for a dead engine was launched for a new
engine whose buffers had the same addresses (the H200 machine). Such a graph is its caller's
(`owned`), freed with the buffers it names.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from flashrt_ros.cuda.driver import check, drv, ensure_context, stream

MAX_GRAPHS = 4096  # distinct (buffer pair, kind) keys; beyond it the oldest is destroyed

log = logging.getLogger(__name__)
_cache: OrderedDict[tuple, object] = OrderedDict()  # key -> CUgraphExec, least recent first
_capture_streams: dict[tuple[int, int], object] = {}
_lock = threading.Lock()
_ok = drv is not None
# Held around every graph capture of this process (ours here, StepPlan's, a late-fusing build's
# whole run): a capture fails when another thread syncs the whole device meanwhile, which
# compiling does (runtime/latefuse.py). Captures here do not wait for it (see _Busy).
CAPTURE_LOCK = threading.RLock()


class _Busy(Exception):
    """Another thread holds CAPTURE_LOCK: issue this work directly, capture it another time."""


def available() -> bool:
    """Whether run() captures graphs here (cuda-python present, no capture has failed)."""
    return _ok


def run(key: tuple, fn: Callable[[object], None], index: int) -> bool:
    """Launch the graph of `fn(stream)` (driver calls on that stream, no allocation) on the
    current torch stream of device `index`; the first call for a key captures it. Returns
    False, having done nothing, where graphs are unavailable: the caller issues the work
    itself (also while another thread holds CAPTURE_LOCK: the key is captured on a later
    call). Inside a foreign capture `fn` is issued directly on the capturing stream."""
    if not _ok:
        return False
    if torch.cuda.is_current_stream_capturing():
        fn(stream(index))
        return True
    key = (index, *key)
    exe = _cache.get(key)
    if exe is None:
        try:
            exe = _capture(fn, index)
        except _Busy:
            return False
        except Exception as e:  # a driver or binding problem: say so once, stop using graphs
            _disable(e)
            return False
        with _lock:
            _cache[key] = exe
            while len(_cache) > MAX_GRAPHS:
                _evict_oldest(index)
    else:
        _cache.move_to_end(key)
    check(drv.cuGraphLaunch(exe, stream(index)), "cuGraphLaunch")
    return True


def owned(fn: Callable[[object], None], index: int):
    """The graph of `fn(stream)` for a caller that keeps it with the buffers it names and
    frees it with them (`release`); None where graphs are unavailable (or, for now, while
    another thread holds CAPTURE_LOCK). Not cached by address:
    a graph whose buffers were freed crashed the driver when launched for new buffers that got
    the same addresses (a graph holding a copy into pinned memory, on the H200 machine)."""
    if not _ok:
        return None
    try:
        return _capture(fn, index)
    except _Busy:
        return None
    except Exception as e:
        _disable(e)
        return None


def launch(exe, index: int) -> None:
    """Launch a graph from owned() on the current torch stream of device `index`."""
    check(drv.cuGraphLaunch(exe, stream(index)), "cuGraphLaunch")


def release(exes: dict, index: int) -> None:
    """Destroy the graphs from owned() held as the values of `exes`, once the device is done
    with them (a finalizer's work: errors, as at interpreter exit, are ignored)."""
    try:
        if exes:
            torch.cuda.current_stream(index).synchronize()
        for exe in exes.values():
            drv.cuGraphExecDestroy(exe)
    except Exception:  # noqa: BLE001 - the context may already be gone
        pass
    exes.clear()


def _disable(e: Exception) -> None:
    global _ok
    log.warning("one-node graphs unavailable (%s); issuing copies directly", e)
    _ok = False


def _evict_oldest(index: int) -> None:
    _, exe = _cache.popitem(last=False)
    torch.cuda.current_stream(index).synchronize()  # it may still be queued
    check(drv.cuGraphExecDestroy(exe), "cuGraphExecDestroy")


def _capture(fn: Callable[[object], None], index: int):
    if not CAPTURE_LOCK.acquire(blocking=False):  # a copy or checksum never waits for a build
        raise _Busy
    try:
        return _capture_held(fn, index)
    finally:
        CAPTURE_LOCK.release()


def _capture_held(fn: Callable[[object], None], index: int):
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
    try:
        return check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
    finally:
        check(drv.cuGraphDestroy(graph), "cuGraphDestroy")


def cached() -> int:
    return len(_cache)
