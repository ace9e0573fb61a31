"""`linear(x, w, bias)` for a handful of rows: y[M, N] = x[M, K] @ w[N, K]^T + bias, M <= 16.

A policy served at batch 1 multiplies a few rows (a diffusion UNet's horizon of 4 to 16 steps,
one token) by large weight matrices, once per denoising step. That product is bound by reading
the weights, and cuBLAS's kernels for such shapes read them at 0.3 to 1.5 TB/s on an H200
(bench/results: the diffusion probe), a third or less of what the memory gives: each of its
tiles covers 64 or more columns, so a 512- or 2048-column weight keeps only a few SMs busy.
This kernel gives every block R weight rows (R x M accumulators per thread, R = 32 / M), lets
its 256 threads stride over K with 16-byte loads, and sums the threads' partials in a fixed
order (shuffles, then the warps in turn): no atomics, so a step's actions are the same bits on
every replay. The sum order differs from cuBLAS's, so results differ from `F.linear` by float
rounding (about 1e-6 relative), as a compiled step's do.

Everything else (the CPU, other dtypes, M > 16, K not a multiple of 4, unaligned or strided
operands, no NVRTC) is `F.linear`. The kernel is a torch custom op, so torch.compile treats it
as one opaque call and a captured graph records its launch.
"""

import ctypes
import logging
import threading
from typing import Optional

import torch
from torch.nn import functional as F

from flashrt_ros.cuda import kernels
from flashrt_ros.cuda.driver import check as _check
from flashrt_ros.cuda.driver import drv as _drv
from flashrt_ros.cuda.driver import stream

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256)
frt_skinny(const float4* __restrict__ x, const float4* __restrict__ w,
           const float* __restrict__ bias, float* __restrict__ y, int k4, int n) {
    const int n0 = blockIdx.x * R;
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    for (int k = threadIdx.x; k < k4; k += 256) {
        float4 wv[R];
#pragma unroll
        for (int r = 0; r < R; ++r)
            wv[r] = (n0 + r < n) ? __ldg(w + (size_t)(n0 + r) * k4 + k) : make_float4(0, 0, 0, 0);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float4 xv = __ldg(x + (size_t)m * k4 + k);
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float a = acc[r][m];
                a = fmaf(wv[r].x, xv.x, a);
                a = fmaf(wv[r].y, xv.y, a);
                a = fmaf(wv[r].z, xv.z, a);
                a = fmaf(wv[r].w, xv.w, a);
                acc[r][m] = a;
            }
        }
    }
    __shared__ float part[8][R * M];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = acc[r][m];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
            if (lane == 0) part[warp][r * M + m] = v;
        }
    __syncthreads();
    for (int t = threadIdx.x; t < R * M; t += 256) {
        const int r = t / M, m = t % M;
        if (n0 + r < n) {
            float v = part[0][t];
#pragma unroll
            for (int q = 1; q < 8; ++q) v += part[q][t];
            if (bias != nullptr) v += bias[n0 + r];
            y[(size_t)m * n + n0 + r] = v;
        }
    }
}
"""

THREADS = 256
MAX_ROWS = 16
MIN_K = 512  # below this the product is launch-bound and cuBLAS is as good

log = logging.getLogger(__name__)
_lock = threading.Lock()
_funcs: dict[tuple[int, int], object] = {}  # (device, M) -> CUfunction (None: not buildable)
_ARGTYPES = (
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_int,
)


def rows_per_block(m: int) -> int:
    """Weight rows a block takes: R x M accumulators stay at 32 registers a thread."""
    return max(1, 32 // m)


def function(index: int, m: int):
    """The kernel for M = m rows on a device, or None when it cannot be built here (once)."""
    key = (index, m)
    if key not in _funcs:
        with _lock:
            if key not in _funcs:
                func = None
                src = f"#define M {m}\n#define R {rows_per_block(m)}\n{SOURCE}"
                try:
                    func = kernels.build(index, src, "frt_skinny")
                except Exception as e:  # report once, use F.linear
                    log.warning("skinny linear kernel unavailable (%s); using F.linear", e)
                _funcs[key] = func
    return _funcs[key]


def _usable(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:  # noqa: UP045
    if not (x.is_cuda and w.is_cuda) or x.dtype != torch.float32 or w.dtype != torch.float32:
        return False
    if w.device != x.device or w.dim() != 2 or w.shape[0] == 0:
        return False
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if not (1 <= m <= MAX_ROWS and k >= MIN_K and k % 4 == 0):
        return False
    if not (x.is_contiguous() and w.is_contiguous()) or w.shape[1] != k:
        return False
    if x.data_ptr() % 16 or w.data_ptr() % 16:
        return False
    if bias is not None and not (
        bias.device == x.device
        and bias.dtype == torch.float32
        and bias.is_contiguous()
        and tuple(bias.shape) == (w.shape[0],)  # F.linear also broadcasts: not the kernel
    ):
        return False
    return function(x.get_device(), m) is not None


@torch.library.custom_op("flashrt::skinny_linear", mutates_args=())
def _skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045 - custom_op reads the annotation
    if not _usable(x, w, bias):
        return F.linear(x, w, bias)
    k, n = x.shape[-1], w.shape[0]
    m = x.numel() // k
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    index = x.get_device()
    r = rows_per_block(m)
    args = (
        (
            x.data_ptr(),
            w.data_ptr(),
            0 if bias is None else bias.data_ptr(),
            y.data_ptr(),
            k // 4,
            n,
        ),
        _ARGTYPES,
    )
    _check(
        _drv.cuLaunchKernel(
            function(index, m), (n + r - 1) // r, 1, 1, THREADS, 1, 1, 0, stream(index), args, 0
        ),
        "cuLaunchKernel",
    )
    return y


@_skinny_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:  # noqa: UP045
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:  # noqa: UP045
    """F.linear(x, w, bias); on CUDA with few rows, the kernel above. With gradients wanted
    (training) it is F.linear too: the kernel has no backward."""
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, w, bias))
    if not x.is_cuda or grads:
        return F.linear(x, w, bias)
    return _skinny_linear(x, w, bias)
