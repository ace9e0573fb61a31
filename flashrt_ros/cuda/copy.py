"""Raw asynchronous copies: bytes device to device, and host to device and back.

On CUDA a copy is one memcpy issued to the driver (cuMemcpy*Async through cuda-python), which
skips torch's dispatcher, dtype and shape checks; device copies are then replayed from a
captured one-node graph (graphs.py), the cheapest way to issue a memcpy. Everything else, and
any platform without cuda-python, uses Tensor.copy_.
"""

from __future__ import annotations

import logging

import torch

from flashrt_ros.cuda import graphs
from flashrt_ros.cuda.driver import check as _drv_check
from flashrt_ros.cuda.driver import drv as _drv
from flashrt_ros.cuda.driver import ptr as _ptr
from flashrt_ros.cuda.driver import stream as _stream

log = logging.getLogger(__name__)

_driver_ok = _drv is not None
_SUCCESS = _drv.CUresult.CUDA_SUCCESS if _drv is not None else None


def _fail(e) -> None:
    global _driver_ok
    log.warning("cuda-python copies unavailable (%s); using torch copies", e)
    _driver_ok = False


# Up to this size a device copy is a replayed one-node graph (cheapest to issue). The graph's
# memcpy node runs at ~2.6 TB/s on the H200 against ~4.2 TB/s for a directly issued copy, so
# larger copies, where bandwidth and not issue cost decides, are issued directly.
GRAPH_MAX_BYTES = 8 << 20


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, both contiguous uint8 of equal size; ordered on the current stream."""
    n = dst.numel()
    if n != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into {n}")
    if not (dst.is_cuda and src.is_cuda):
        dst.copy_(src, non_blocking=True)
        return
    if n <= GRAPH_MAX_BYTES and _driver_ok:
        d, s = dst.data_ptr(), src.data_ptr()
        if graphs.run(("copy", d, s, n), lambda h: _memcpy(d, s, n, h), dst.get_device()):
            return
    copy_now(dst, src)


def _memcpy(d: int, s: int, n: int, h) -> None:
    _drv_check(_drv.cuMemcpyDtoDAsync(_ptr(d), _ptr(s), n, h), "cuMemcpyDtoDAsync")


def issue_dtod(dst: torch.Tensor, src: torch.Tensor, h) -> None:
    """dst <- src (contiguous device tensors of equal bytes) on driver stream `h`: for callers
    that build a graph of several operations (graphs.run)."""
    _memcpy(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), h)


def issue_dtoh(dst: torch.Tensor, src: torch.Tensor, h) -> None:
    """pinned host dst <- device src on driver stream `h` (as issue_dtod)."""
    n = src.numel() * src.element_size()
    _drv_check(_drv.cuMemcpyDtoHAsync(dst.data_ptr(), _ptr(src.data_ptr()), n, h), "cuMemcpyDtoH")


def _issued(memcpy) -> bool:
    """Whether ``memcpy()``, a cuda-python cuMemcpy*Async call (its handles converted inside
    it, so that a conversion failure counts too), was issued. On an exception or an error code
    copies fall back to torch for good, with one warning."""
    try:
        (err,) = memcpy()
    except Exception as e:  # binding mismatch: fall back for good, once
        _fail(e)
        return False
    if err != _SUCCESS:
        _fail(err)
        return False
    return True


def copy_now(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The copy issued directly: one cuMemcpyDtoDAsync (torch's copy_ without cuda-python)."""
    if _driver_ok and _issued(
        lambda: _drv.cuMemcpyDtoDAsync(
            _ptr(dst.data_ptr()), _ptr(src.data_ptr()), dst.numel(), _stream(dst.get_device())
        )
    ):
        return
    dst.copy_(src, non_blocking=True)


def copy_io(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src between a pinned host tensor and a device tensor (either way), asynchronous
    on the current stream. Issued through the driver so that it can be captured into a CUDA
    graph as a memcpy node (torch's pinned copy also records a host-allocator event)."""
    n = dst.numel() * dst.element_size()
    if _driver_ok and dst.is_cuda != src.is_cuda and dst.is_contiguous() and src.is_contiguous():
        if dst.is_cuda:
            issued = _issued(
                lambda: _drv.cuMemcpyHtoDAsync(
                    _ptr(dst.data_ptr()), src.data_ptr(), n, _stream(dst.get_device())
                )
            )
        else:
            issued = _issued(
                lambda: _drv.cuMemcpyDtoHAsync(
                    dst.data_ptr(), _ptr(src.data_ptr()), n, _stream(src.get_device())
                )
            )
        if issued:
            return
    dst.copy_(src, non_blocking=True)


def driver_copies() -> bool:
    """Whether copies currently go through cuda-python (reported by the benchmark)."""
    return _driver_ok
