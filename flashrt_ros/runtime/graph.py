"""The graph plan: one session's step captured once as a CUDA graph and replayed every tick.

On the CPU the same step function runs over the same static buffers (the reference path).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from flashrt_ros.cuda.driver import check, drv, stream
from flashrt_ros.cuda.graphs import CAPTURE_LOCK


class StepPlan:
    """Replays `fn`, a closure over static buffers that updates them in place."""

    def __init__(
        self,
        fn: Callable[[], None],
        device: torch.device,
        use_graph: bool = True,
        default_device: bool = False,
    ):
        """`default_device`: capture with `device` as torch's default device (capture())."""
        self.fn = fn
        self.default_device = default_device
        self.device = torch.device(device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.use_graph = use_graph and self.device.type == "cuda"
        self._upload: tuple | None = None  # upload()'s (handle, index); () when unavailable

    def capture(self, protect: list[torch.Tensor], warmup: int = 3) -> None:
        """Warm up on a side stream (lazy init, cuBLAS handles), then capture one step.

        Warm-up really runs the step, so the buffers in `protect` are saved first and put back
        after capture: building the plan leaves the session's state as it found it.

        With `default_device` (the session sets it for eager kernels, not for a compiled
        step) both run with the plan's device as torch's default device: a tensor the step
        makes without naming a device is made there. LeRobot's ACTPolicy makes its latent as
        `torch.zeros(...).to(device)`, a copy from pageable host memory, which capture refuses;
        made on the device, the `.to()` is a no-op and the fill is captured like any kernel.
        (Inductor moves such constructors to the device itself; and a compiled step's guards
        would see the extra mode.) Replays run no Python, so ticks pay nothing for it.
        """
        if not self.use_graph:
            return
        with CAPTURE_LOCK:
            self._warm_and_capture(protect, warmup)

    def _warm_and_capture(self, protect: list[torch.Tensor], warmup: int) -> None:
        saved = [t.clone() for t in protect]
        cur = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(cur)
        where = self.device if self.default_device else contextlib.nullcontext()
        with torch.cuda.stream(side), torch.no_grad(), where:
            for _ in range(warmup):
                self.fn()
        cur.wait_stream(side)
        graph = self._record()
        for t, s in zip(protect, saved, strict=True):
            t.copy_(s)
        torch.cuda.synchronize(self.device)
        self.graph = graph
        self._upload = None

    def capture_only(self) -> None:
        """Capture one step without running anything: for buffers another thread may be
        stepping meanwhile (latefuse.py). The step's kernels must be ready (compiled, loaded,
        their handles made) by an earlier run on buffers of the same shapes."""
        if not self.use_graph:
            return
        with CAPTURE_LOCK:
            self.graph, self._upload = self._record(), None

    def _record(self) -> torch.cuda.CUDAGraph:
        """The captured graph of one call of fn. Thread-local capture: only this thread's
        unsafe calls end it, so another thread may keep stepping, copying and waiting on
        events meanwhile (a step built in the background, latefuse.py). A device-wide sync
        in another thread would still end it: every capture holds CAPTURE_LOCK, which a
        late-fusing build holds throughout."""
        where = self.device if self.default_device else contextlib.nullcontext()
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), where, torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.fn()
        return graph

    def upload(self) -> bool:
        """Upload the captured graph to the device on the current stream without running it
        (cuGraphUpload, ordered after the work already queued there), so its next launch finds
        the driver's and the device's copies of it ready. False where that is unavailable."""
        if self._upload is None:  # the driver handle, made once (it runs on the tick path)
            self._upload = self._upload_args()
        if not self._upload:
            return False
        exe, index = self._upload
        check(drv.cuGraphUpload(exe, stream(index)), "cuGraphUpload")
        return True

    def _upload_args(self) -> tuple:
        """(graph exec handle, device index) for cuGraphUpload; () where that is unavailable."""
        if self.graph is None or drv is None or not hasattr(self.graph, "raw_cuda_graph_exec"):
            return ()
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return drv.CUgraphExec(self.graph.raw_cuda_graph_exec()), index

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            with torch.no_grad():
                self.fn()
