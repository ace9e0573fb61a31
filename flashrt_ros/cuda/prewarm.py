"""Create the device's CUDA context while the process is still importing torch.

A start of the node spends about 1.5 s importing torch and then ~0.1-0.2 s more creating the
CUDA context on its first device tensor, one after the other. The import holds the GIL; creating
a context does not need it. So the node (main.py) calls `warm_context` just before its imports:
a thread initializes the driver and retains the device's primary context, the one torch uses,
through ctypes (which releases the GIL during each foreign call; torch and cuda-python are not
imported yet). When torch then touches the device, the context is already there.

Nothing here is required: without a driver (a CPU machine, CI) or on any driver error the
thread ends quietly and torch creates the context as usual, reporting any real error itself.
"""

from __future__ import annotations

import ctypes
import threading
import time


class ContextWarmer:
    """One background retain of a device's primary context; `seconds` once it ended."""

    def __init__(self, index: int):
        self.index = index
        self.seconds: float | None = None  # how long the driver took (None: not done)
        self.error = ""  # why no context was made ("" when one was, or still running)
        self.context: int | None = None  # the primary context's handle, once retained
        self._lib = None  # libcuda, kept loaded: the retained context lives in it
        self._dev = ctypes.c_int()
        self.thread = threading.Thread(target=self._run, name="flashrt-cuda-warm", daemon=True)

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            self.error = f"no CUDA driver ({e})"
            return
        dev, ctx = self._dev, ctypes.c_void_p()
        retain = lib.cuDevicePrimaryCtxRetain
        calls = (
            ("cuInit", lambda: lib.cuInit(0)),
            ("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(dev), self.index)),
            ("cuDevicePrimaryCtxRetain", lambda: retain(ctypes.byref(ctx), dev)),
        )
        for what, call in calls:
            err = call()
            if err != 0:
                self.error = f"{what} returned CUDA error {err}"
                return
        self._lib, self.context = lib, ctx.value
        self.seconds = time.perf_counter() - t0

    def release(self, timeout: float = 10.0) -> bool:
        """Give the retained context back (the engine runs on the CPU after all: with device
        auto and a torch without CUDA, say). True when one was given back."""
        self.thread.join(timeout)
        if self._lib is None or self.context is None or self.thread.is_alive():
            return False
        release = getattr(self._lib, "cuDevicePrimaryCtxRelease_v2", None)
        if release is None:
            release = self._lib.cuDevicePrimaryCtxRelease
        if release(self._dev) != 0:
            return False
        self.context = None
        return True


def device_index(device: str) -> int | None:
    """The CUDA device a node's `device` parameter names (auto may be CUDA: device 0), or None
    for the CPU."""
    if device == "cpu":
        return None
    if device.startswith("cuda:"):
        return int(device.split(":", 1)[1])
    return 0  # "cuda" and "auto": torch's default device


def warm_context(device: str) -> ContextWarmer | None:
    """Start creating `device`'s context in the background (None for the CPU)."""
    index = device_index(device)
    if index is None:
        return None
    warmer = ContextWarmer(index)
    warmer.thread.start()
    return warmer
