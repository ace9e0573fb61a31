"""One raw asynchronous byte copy between two buffers.

On CUDA the copy goes straight to cuMemcpyDtoDAsync through cuda-python: a capsule operation is
one memcpy of a contiguous region, and issuing it through the driver skips torch's dispatcher,
dtype and shape checks (several microseconds of host time per call, which is most of the cost of
a 1 MB checkpoint). Everything else, and any platform without cuda-python, uses Tensor.copy_.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

try:  # cuda-python is optional: the CPU path and CI need no GPU
    from cuda.bindings import driver as _drv
except Exception:  # pragma: no cover - depends on the machine
    _drv = None

_driver_ok = _drv is not None
_SUCCESS = _drv.CUresult.CUDA_SUCCESS if _drv is not None else None


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src, both contiguous uint8 of equal size; ordered on the current stream."""
    global _driver_ok
    if dst.numel() != src.numel():
        raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()}")
    if _driver_ok and dst.is_cuda and src.is_cuda:
        # the raw handle of the current stream, without building a torch Stream object
        stream = torch._C._cuda_getCurrentRawStream(dst.get_device())
        try:
            (err,) = _drv.cuMemcpyDtoDAsync(dst.data_ptr(), src.data_ptr(), dst.numel(), stream)
        except Exception as e:  # binding mismatch: fall back for good, once
            log.warning("cuda-python copy unavailable (%s); using torch copies", e)
            _driver_ok = False
        else:
            if err == _SUCCESS:
                return
            log.warning("cuMemcpyDtoDAsync failed (%s); using torch copies", err)
            _driver_ok = False
    dst.copy_(src, non_blocking=True)


def driver_copies() -> bool:
    """Whether copies currently go through cuda-python (reported by the benchmark)."""
    return _driver_ok
