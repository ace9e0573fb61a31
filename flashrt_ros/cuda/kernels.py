"""Kernels compiled at run time by NVRTC and launched through the driver (cuda-python):
`build` compiles one (ring.py uses it too); this module's own are the capsule checksum, a
128-bit digest of a byte buffer as one CUDA kernel, and the finite check of a checkpoint (a
NaN/Inf flag per floating-point region of an arena, all regions in one launch), compiled
together.

Why not torch: the same digest in torch is a dozen elementwise kernels with state-sized int64
temporaries (about 250 us for a 1 MB state on an H200, nearly all launch and allocation cost,
and 23 ms for 1 GB). This kernel reads every word once and keeps nothing but two registers per
thread: one launch plus a 16-byte memset. It computes exactly checksum.reference_digest (integer
sums, order independent) for the lane constants the caller passes, so digests made here, on the
CPU and in files all agree. Where NVRTC
or the driver API is missing, `available()` is False and callers use the torch version.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import torch

from flashrt_ros.cuda.driver import check as _check
from flashrt_ros.cuda.driver import drv as _drv
from flashrt_ros.cuda.driver import ensure_context, ptr, stream

try:  # optional: CI and CPU-only machines have no NVRTC
    from cuda.bindings import nvrtc as _nvrtc
except Exception:  # pragma: no cover - depends on the machine
    _nvrtc = None

SOURCE = r"""
#define M32 0xFFFFFFFFull
#define MASK62 0x3FFFFFFFFFFFFFFFull
__device__ __forceinline__ unsigned long long mix(unsigned long long v, unsigned long long i,
                                                  unsigned long long m1, unsigned long long m2) {
    unsigned long long x = ((v ^ ((i * m1) & M32)) * m2) & MASK62;
    return x ^ (x >> 29);
}
// The block's warps add their two checksum lanes into to[0], to[1] (one atomic per warp).
__device__ __forceinline__ void add_lanes(unsigned long long a0, unsigned long long a1,
                                          unsigned long long* to) {
    for (int o = 16; o > 0; o >>= 1) {
        a0 += __shfl_down_sync(0xffffffffu, a0, o);
        a1 += __shfl_down_sync(0xffffffffu, a1, o);
    }
    if ((threadIdx.x & 31) == 0) {
        atomicAdd(to, a0);
        atomicAdd(to + 1, a1);
    }
}
extern "C" __global__ void frt_checksum(const unsigned int* __restrict__ w,
                                        unsigned long long n, unsigned long long* out) {
    unsigned long long a0 = 0, a1 = 0;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        unsigned long long v = __ldg(w + i);
        a0 += mix(v, i, LANE0_M1, LANE0_M2);
        a1 += mix(v, i, LANE1_M1, LANE1_M2);
    }
    add_lanes(a0, a1, out);
}
// bad[r] <- 1 when region r of `base` holds a NaN or an Inf (bad is zeroed by the caller).
// Region r is table[3r .. 3r+2] = (byte offset, element count, kind): 0 float32, 1 float64,
// 2 float16, 3 bfloat16; non-finite means every exponent bit set.
extern "C" __global__ void frt_finite(const unsigned char* __restrict__ base,
                                      const long long* __restrict__ table, int n,
                                      unsigned long long* bad) {
    long long stride = (long long)gridDim.x * blockDim.x;
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (int r = 0; r < n; ++r) {
        long long off = table[3 * r], cnt = table[3 * r + 1], kind = table[3 * r + 2];
        int hit = 0;
        if (kind == 0) {
            const unsigned int* p = (const unsigned int*)(base + off);
            for (long long i = t; i < cnt; i += stride)
                hit |= (__ldg(p + i) & 0x7f800000u) == 0x7f800000u;
        } else if (kind == 1) {
            const unsigned long long* p = (const unsigned long long*)(base + off);
            for (long long i = t; i < cnt; i += stride)
                hit |= (__ldg(p + i) & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
        } else {
            const unsigned short m = kind == 2 ? 0x7c00 : 0x7f80;
            const unsigned short* p = (const unsigned short*)(base + off);
            for (long long i = t; i < cnt; i += stride) hit |= (__ldg(p + i) & m) == m;
        }
        if (__syncthreads_or(hit) && threadIdx.x == 0) bad[r] = 1ull;
    }
}
// A checkpoint's whole pass in one kernel: the digest of w's n words (as frt_checksum), a
// NaN/Inf flag per region (as frt_finite), the words copied into `slot` and the digest into
// `row` when given (else null), and the results [lane 0, lane 1, flag...] written both to `out`
// (device) and to `host` (mapped pinned memory: no copy node). `acc` ([lanes, flags, count],
// zero before the first launch) gathers the blocks' parts; the last block to finish reads and
// zeroes it, so the next launch needs no memset.
extern "C" __global__ void frt_probe(const unsigned int* __restrict__ w, unsigned long long n,
                                     const long long* __restrict__ table, int nreg,
                                     unsigned int* slot, unsigned long long* row,
                                     unsigned long long* acc, unsigned long long* out,
                                     unsigned long long* host) {
    unsigned long long a0 = 0, a1 = 0;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long t = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (unsigned long long i = t; i < n; i += stride) {
        unsigned int v = __ldg(w + i);
        if (slot) slot[i] = v;
        a0 += mix(v, i, LANE0_M1, LANE0_M2);
        a1 += mix(v, i, LANE1_M1, LANE1_M2);
    }
    add_lanes(a0, a1, acc);
    if ((threadIdx.x & 31) == 0) __threadfence();  // the lanes' adds before the block's count
    const unsigned char* base = (const unsigned char*)w;
    for (int r = 0; r < nreg; ++r) {
        long long off = table[3 * r], cnt = table[3 * r + 1], kind = table[3 * r + 2];
        int hit = 0;
        if (kind == 0) {
            const unsigned int* p = (const unsigned int*)(base + off);
            for (long long i = (long long)t; i < cnt; i += (long long)stride)
                hit |= (__ldg(p + i) & 0x7f800000u) == 0x7f800000u;
        } else if (kind == 1) {
            const unsigned long long* p = (const unsigned long long*)(base + off);
            for (long long i = (long long)t; i < cnt; i += (long long)stride)
                hit |= (__ldg(p + i) & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
        } else {
            const unsigned short m = kind == 2 ? 0x7c00 : 0x7f80;
            const unsigned short* p = (const unsigned short*)(base + off);
            for (long long i = (long long)t; i < cnt; i += (long long)stride)
                hit |= (__ldg(p + i) & m) == m;
        }
        if (__syncthreads_or(hit) && threadIdx.x == 0) acc[2 + r] = 1ull;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(acc + 2 + nreg, 1ull) == (unsigned long long)gridDim.x - 1) {
            __threadfence();
            for (int k = 0; k < 2 + nreg; ++k) {
                unsigned long long v = atomicExch(acc + k, 0ull);
                out[k] = v;
                host[k] = v;
            }
            if (row) {
                row[0] = out[0];
                row[1] = out[1];
            }
            acc[2 + nreg] = 0ull;
            __threadfence_system();
        }
    }
}
"""
FINITE_KINDS = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}

THREADS = 256  # whole warps: the kernels' full-mask shuffles need them
assert THREADS % 32 == 0

log = logging.getLogger(__name__)
_lock = threading.Lock()
_funcs: dict[int, object] = {}  # device index -> checksum CUfunction (None: compile failed)
_finite: dict[int, object] = {}  # device index -> finite-check CUfunction, built with it
_probe: dict[int, object] = {}  # device index -> the one-kernel checkpoint pass, built with it
_blocks: dict[int, int] = {}
_ARGTYPES = (ctypes.c_void_p, ctypes.c_ulonglong, ctypes.c_void_p)
_FINITE_ARGTYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)
_PROBE_ARGTYPES = (
    ctypes.c_void_p,
    ctypes.c_ulonglong,
    ctypes.c_void_p,
    ctypes.c_int,
    *(ctypes.c_void_p,) * 5,
)


def build(index: int, source: str, name: str) -> object:
    """Compile CUDA C `source` for device `index` with NVRTC and return its kernel `name` (a
    CUfunction). Raises RuntimeError with NVRTC's log when it does not compile."""
    return build_all(index, source, (name,))[0]


def build_all(index: int, source: str, names: tuple[str, ...]) -> tuple:
    """`build` for several kernels of one source: one compile."""
    if _drv is None or _nvrtc is None:
        raise RuntimeError("cuda-python's driver or NVRTC bindings are not installed")
    major, minor = torch.cuda.get_device_capability(index)
    prog = _check(
        _nvrtc.nvrtcCreateProgram(source.encode(), f"{names[0]}.cu".encode(), 0, [], []),
        "nvrtcCreateProgram",
    )
    opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
    (err,) = _nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err) != 0:
        size = _check(_nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        text = b" " * size
        _nvrtc.nvrtcGetProgramLog(prog, text)
        raise RuntimeError(f"NVRTC: {text.decode(errors='replace')}")
    size = _check(_nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
    cubin = b" " * size
    _check(_nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    _nvrtc.nvrtcDestroyProgram(prog)
    ensure_context(index)
    module = _check(_drv.cuModuleLoadData(cubin), "cuModuleLoadData")
    return tuple(
        _check(_drv.cuModuleGetFunction(module, n.encode()), "cuModuleGetFunction") for n in names
    )


def sm_count(index: int) -> int:
    if index not in _blocks:
        _blocks[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _blocks[index]


def _compile(index: int, lanes: tuple) -> tuple:
    src = SOURCE
    for k, (m1, m2) in enumerate(lanes):
        src = src.replace(f"LANE{k}_M1", f"{m1}ull").replace(f"LANE{k}_M2", f"{m2}ull")
    return build_all(index, src, ("frt_checksum", "frt_finite", "frt_probe"))


def function(index: int, lanes: tuple):
    """The compiled kernel for a device, or None when this machine cannot build it (once)."""
    if index not in _funcs:
        with _lock:
            if index not in _funcs:
                funcs = (None, None, None)
                if _drv is not None and _nvrtc is not None:
                    try:
                        funcs = _compile(index, lanes)
                    except Exception as e:  # report once, use the torch path
                        log.warning("checksum kernel unavailable (%s); using torch ops", e)
                _finite[index] = funcs[1]
                _probe[index] = funcs[2]
                _funcs[index] = funcs[0]
    return _funcs[index]


def compiled(index: int) -> bool:
    """Whether the kernel was built for this device (after a first checksum there)."""
    return _funcs.get(index) is not None


def launch_checksum(buf: torch.Tensor, out: torch.Tensor, lanes: tuple, h=None) -> bool:
    """out (int64[2], zeroed here) <- digest of buf's 32-bit words, on stream `h` (default:
    the current torch stream). False when the kernel is unavailable (nothing was launched)."""
    index = buf.get_device()
    func = function(index, lanes)
    if func is None:
        return False
    h = stream(index) if h is None else h
    n = buf.numel() // 4
    _check(_drv.cuMemsetD8Async(ptr(out.data_ptr()), 0, 16, h), "cuMemsetD8Async")
    grid = max(1, min(4 * sm_count(index), (n + THREADS - 1) // THREADS))
    params = ((buf.data_ptr(), n, out.data_ptr()), _ARGTYPES)
    _check(_drv.cuLaunchKernel(func, grid, 1, 1, THREADS, 1, 1, 0, h, params, 0), "cuLaunchKernel")
    return True


def finite_ready(index: int) -> bool:
    """Whether launch_finite works on this device (after function() was called there)."""
    return _finite.get(index) is not None


def launch_finite(buf: torch.Tensor, table: torch.Tensor, most: int, bad: torch.Tensor, h) -> None:
    """bad[r] <- 1 where region r of `buf` (table: int64 (R, 3) on the device, rows of byte
    offset, element count and kind as FINITE_KINDS; `most` the largest count) holds NaN or
    Inf; `bad` (int64 [R]) must be zeroed before. On driver stream `h` (capturable: nothing
    is read back); the caller checked finite_ready."""
    index = buf.get_device()
    grid = max(1, min(4 * sm_count(index), (most + THREADS - 1) // THREADS))
    params = ((buf.data_ptr(), table.data_ptr(), table.shape[0], bad.data_ptr()), _FINITE_ARGTYPES)
    _check(
        _drv.cuLaunchKernel(_finite[index], grid, 1, 1, THREADS, 1, 1, 0, h, params, 0),
        "cuLaunchKernel",
    )


def probe_ready(index: int) -> bool:
    """Whether launch_probe works on this device (after function() was called there)."""
    return _probe.get(index) is not None


def launch_probe(
    buf: torch.Tensor,
    table: torch.Tensor,
    most: int,
    acc: torch.Tensor,
    out: torch.Tensor,
    host_ptr: int,
    slot: torch.Tensor | None,
    row: torch.Tensor | None,
    h,
) -> None:
    """A checkpoint's pass as one kernel (frt_probe): `out` (int64 [2 + R] on the device) and
    the pinned memory at device address `host_ptr` <- [digest lanes, a NaN/Inf flag per region
    of `table` (as launch_finite)], and, when given, `slot` <- buf and `row` (16 bytes) <- the
    digest. `acc` (int64 [3 + R], zero before the first launch) is left zero for the next one.
    On driver stream `h` (capturable); the caller checked probe_ready."""
    if buf.numel() % 4:  # the kernel checksums and copies whole 32-bit words
        raise ValueError(f"frt_probe needs whole 32-bit words, got {buf.numel()} bytes")
    index = buf.get_device()
    n = buf.numel() // 4
    work = max(n, most)
    grid = max(1, min(4 * sm_count(index), (work + THREADS - 1) // THREADS))
    args = (
        buf.data_ptr(),
        n,
        table.data_ptr(),
        table.shape[0],
        0 if slot is None else slot.data_ptr(),
        0 if row is None else row.data_ptr(),
        acc.data_ptr(),
        out.data_ptr(),
        host_ptr,
    )
    _check(
        _drv.cuLaunchKernel(
            _probe[index], grid, 1, 1, THREADS, 1, 1, 0, h, (args, _PROBE_ARGTYPES), 0
        ),
        "cuLaunchKernel",
    )


def host_device_pointer(host: torch.Tensor) -> int | None:
    """The device address of pinned host memory (mapped, as pinned memory is under unified
    addressing), or None where the driver gives none: then the caller copies instead."""
    try:
        return int(
            _check(_drv.cuMemHostGetDevicePointer(host.data_ptr(), 0), "cuMemHostGetDevicePointer")
        )
    except Exception:  # noqa: BLE001 - not mapped, or no driver: the copy path
        return None
