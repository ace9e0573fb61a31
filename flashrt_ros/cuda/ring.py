"""The flight recorder's ring write as one CUDA kernel: ring[step % N] <- arena.

It is launched inside the captured step, so the slot must be computed on the device from the
step counter. torch can express that (index_copy_ with a device index), but the kernel it
yields moves 8-byte words with an index computation per element: on the H200 a 2 MB arena
cost about 6 us per tick that way. This one reads the counter once per thread and moves
16-byte words over every SM, which is what a 2 MB copy needs to stay near a microsecond.
Where NVRTC or the driver is missing, `function()` is None and the recorder uses torch.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from flashrt_ros.cuda import kernels
from flashrt_ros.cuda.driver import check as _check
from flashrt_ros.cuda.driver import drv as _drv
from flashrt_ros.cuda.driver import stream

SOURCE = r"""
extern "C" __global__ void frt_ring_record(const uint4* __restrict__ src,
                                           uint4* __restrict__ ring,
                                           const long long* __restrict__ step,
                                           unsigned long long n16,
                                           unsigned long long row16,
                                           unsigned long long ticks) {
    // the slot of this step; the counter never goes negative (it only counts steps)
    unsigned long long slot = (unsigned long long)__ldg(step) % ticks;
    uint4* dst = ring + slot * row16;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n16; i += stride) {
        dst[i] = __ldg(src + i);
    }
}
"""

THREADS = 256
ALIGN = 16  # bytes: arena, ring rows and the copy length are whole 16-byte words

log = logging.getLogger(__name__)
_lock = threading.Lock()
_funcs: dict[int, object] = {}  # device index -> CUfunction (None: not buildable here)
_ARGTYPES = (
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_ulonglong,
    ctypes.c_ulonglong,
    ctypes.c_ulonglong,
)


def function(index: int):
    """The compiled kernel for a device, or None when this machine cannot build it (once)."""
    if index not in _funcs:
        with _lock:
            if index not in _funcs:
                func = None
                try:
                    func = kernels.build(index, SOURCE, "frt_ring_record")
                except Exception as e:  # report once, use the torch path
                    log.warning("ring-record kernel unavailable (%s); using torch ops", e)
                _funcs[index] = func
    return _funcs[index]


def usable(ring: torch.Tensor, buf: torch.Tensor, step: torch.Tensor) -> bool:
    """Whether the kernel can write this ring: CUDA, 16-byte aligned, and it builds here."""
    return (
        ring.is_cuda
        and buf.is_cuda
        and step.dtype == torch.int64
        and buf.data_ptr() % ALIGN == 0
        and ring.data_ptr() % ALIGN == 0
        and buf.numel() * buf.element_size() % ALIGN == 0
        and ring.stride(0) * ring.element_size() % ALIGN == 0
        and function(buf.get_device()) is not None
    )


def launch(ring: torch.Tensor, buf: torch.Tensor, step: torch.Tensor) -> None:
    """ring[step % ring.shape[0], :len(buf)] <- buf on the current torch stream (capturable:
    no host read of `step`). The caller checked `usable`."""
    index = buf.get_device()
    n16 = buf.numel() * buf.element_size() // ALIGN
    row16 = ring.stride(0) * ring.element_size() // ALIGN
    grid = max(1, min(8 * kernels.sm_count(index), (n16 + THREADS - 1) // THREADS))
    args = (
        (buf.data_ptr(), ring.data_ptr(), step.data_ptr(), n16, row16, ring.shape[0]),
        _ARGTYPES,
    )
    h = stream(index)
    _check(
        _drv.cuLaunchKernel(function(index), grid, 1, 1, THREADS, 1, 1, 0, h, args, 0),
        "cuLaunchKernel",
    )
