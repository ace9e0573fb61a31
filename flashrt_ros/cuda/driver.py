"""The CUDA driver API through cuda-python, for the few calls where it beats torch.

Handles (device pointers, streams) are converted to the binding's types once and cached: the
conversion costs about a microsecond per call, a sixth of a 1 MB copy's host cost. The driver
needs the device's context current in the calling thread (rclpy's executor thread included);
torch uses the device's primary context, which is made current here when it is not.
"""

from __future__ import annotations

import threading

import torch

try:  # cuda-python is optional: the CPU path and CI need no GPU
    from cuda.bindings import driver as drv
except Exception:  # pragma: no cover - depends on the machine
    drv = None

_ptrs: dict[int, object] = {}
_streams: dict[int, object] = {}
_ctxs: dict[int, object] = {}  # device index -> its primary context (retained once)
_lock = threading.Lock()
_tls = threading.local()


def check(res, what: str):
    """The value of a binding call's (err, value...) tuple; RuntimeError on an error code."""
    err, *rest = res if isinstance(res, tuple) else (res,)
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def ensure_context(index: int) -> None:
    """Make device `index`'s primary context current in this thread (torch's device guards may
    have left another device's, or none, current)."""
    if _single_gpu() and getattr(_tls, "ready", False):
        return  # one device, one primary context: once current in a thread, it stays
    ctx = _ctxs.get(index)
    if ctx is None:
        with _lock:
            if index not in _ctxs:
                dev = check(drv.cuDeviceGet(index), "cuDeviceGet")
                _ctxs[index] = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            ctx = _ctxs[index]
    if int(check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")) != int(ctx):
        check(drv.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _tls.ready = True


_gpus: list[int] = []


def _single_gpu() -> bool:
    if not _gpus:
        _gpus.append(torch.cuda.device_count())
    return _gpus[0] == 1


def ptr(addr: int):
    p = _ptrs.get(addr)
    if p is None:
        if len(_ptrs) > 4096:  # buffers come and go (benchmarks); the live set is small
            _ptrs.clear()
        p = _ptrs[addr] = drv.CUdeviceptr(addr)
    return p


def stream(index: int):
    """The current torch stream of a device as a driver handle (made current-context-safe)."""
    ensure_context(index)
    raw = torch._C._cuda_getCurrentRawStream(index)
    h = _streams.get(raw)
    if h is None:
        h = _streams[raw] = drv.CUstream(raw)
    return h
