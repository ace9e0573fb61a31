"""The checkpoint probe: what a checkpoint must know of one session's arena (its checksum, and
whether its floating-point regions hold NaN/Inf) from one device pass and one readback.

Two ways, one result (`out` = [lane 0, lane 1, flag...] on the device, `host` its pinned copy):

- kernels (CUDA with NVRTC and cuda-python): one kernel (kernels.frt_probe) reads the arena
  once for the checksum and a finite flag per floating-point region, may copy it into a free
  pool slot and the digest into the slot's row, and writes its results straight into the
  pinned readback (mapped memory), in a driver graph of the probe's own (graphs.owned). A
  checkpoint into a free slot is then one launch and one wait: the bytes are in the slot when
  the flags are read, and a refused state leaves the slot free, unused. Where the readback is
  not mapped, the same pass is a graph of six nodes (a memset, the checksum and finite-check
  kernels, the two slot copies and the readback's copy). Before both, the pass was ~8-20 tiny
  torch kernels in a torch graph (28-70 us of waiting on the H200 for builtin:hybrid), then two
  more launches for the slot (42 us of host time; bench/capsule_probe.py).
- torch (the CPU, or CUDA without the kernels): a finite flag per span of neighbouring float
  regions (Arena.float_spans) and the checksum, captured as a torch graph on CUDA; a span with a
  non-finite value is checked again region by region, as its padding is not state.
"""

from __future__ import annotations

import weakref

import torch

from flashrt_ros.capsules.checksum import device_checksum, hex_of, kernel_ready, launch_checksum
from flashrt_ros.cuda import graphs, kernels
from flashrt_ros.cuda.copy import copy_io, issue_dtod, issue_dtoh
from flashrt_ros.cuda.driver import check, drv, ptr, stream
from flashrt_ros.runtime.graph import StepPlan

# the kernels' pass as one kernel where the pinned readback is mapped (bench/capsule_probe.py
# --six-nodes measures the older graph of six nodes, which stays as the fallback)
ONE_KERNEL = True


class CheckpointProbe:
    """One session's probe; `fused` says whether it is the kernels' (and can fill a slot)."""

    def __init__(self, s, regions: list[str], use_graph: bool):
        self.session = s
        self.regions = regions
        buf = self._buf = s.arena.buf
        rows = {r.name: r for r in s.arena.rows}
        # regions with bytes, as the kernel checks them (an empty one holds no NaN)
        self._checked = [n for n in regions if rows[n].nbytes > 0]
        dtypes = [s.views[n].dtype for n in self._checked]
        self.fused = bool(
            use_graph
            and buf.is_cuda
            and graphs.available()
            and kernel_ready(buf)  # builds the checksum and finite kernels (one compile)
            and kernels.finite_ready(buf.get_device())
            and all(dt in kernels.FINITE_KINDS for dt in dtypes)
        )
        if self.fused:
            table = [
                (rows[n].offset, rows[n].nbytes // dt.itemsize, kernels.FINITE_KINDS[dt])
                for n, dt in zip(self._checked, dtypes, strict=True)
            ]
            self._most = max((c for _, c, _ in table), default=0)
            self._table = torch.tensor(table, dtype=torch.int64, device=buf.device).view(-1, 3)
            n_flags = len(table)
        else:
            self._spans = s.arena.float_spans(regions)
            n_flags = len(self._spans)
        self.out = out = torch.zeros(2 + n_flags, dtype=torch.int64, device=buf.device)
        self.digest = out[:2]
        # on the CPU the device buffer is the host buffer: nothing to copy
        on_cuda = buf.is_cuda
        self.host = torch.zeros(out.shape, dtype=torch.int64, pin_memory=True) if on_cuda else out
        self._host_np = self.host.numpy()  # the same memory: read without a torch op (result)
        self._graphs: dict[int, object] = {}  # slot address (0: none) -> its graph
        # the pass as one kernel (kernels.frt_probe) writing its results straight into the
        # pinned readback: one graph node instead of six (memset, checksum, finite, two copies
        # and the readback's copy), so less to launch and to wait for
        self._one = None
        if self.fused and ONE_KERNEL and kernels.probe_ready(buf.get_device()):
            host_ptr = kernels.host_device_pointer(self.host)
            if host_ptr is not None:
                acc = torch.zeros(out.numel() + 1, dtype=torch.int64, device=buf.device)
                self._one = (acc, host_ptr)
        if self.fused:
            weakref.finalize(self, graphs.release, self._graphs, buf.get_device()).atexit = False
        else:
            self._capture_torch(use_graph)

    # -- issuing -----------------------------------------------------------------------------------
    def issue(self, slot: torch.Tensor | None = None, row: torch.Tensor | None = None) -> None:
        """The pass and the readback, queued on the current stream (the caller waits once, then
        calls result()). With the kernels, `slot` (uint8, the arena's size) and `row` (its
        16-byte digest row) also receive the arena and its digest, in the same graph."""
        if not self.fused:
            if slot is not None:
                raise ValueError("only the kernels' probe fills a slot")
            self.plan.replay()
            if not self.whole:
                device_checksum(self._buf, out=self.digest)
                copy_io(self.host, self.out)
            return
        at = 0 if slot is None else slot.data_ptr()
        index = self._buf.get_device()
        exe = self._graphs.get(at)
        if exe is None:
            # this probe's own graphs, freed with it (graphs.owned says why not graphs.run's
            # cache by address); one per slot it has filled, and one without a slot
            fn = self._pass(slot, row)
            exe = graphs.owned(fn, index)
            if exe is None:  # no graphs here: the same work issued directly
                fn(stream(index))
                return
            self._graphs[at] = exe
        graphs.launch(exe, index)

    def _pass(self, slot, row):
        buf, out, host, table, most = self._buf, self.out, self.host, self._table, self._most
        if self._one is not None:
            acc, host_ptr = self._one

            def one(h) -> None:
                kernels.launch_probe(buf, table, most, acc, out, host_ptr, slot, row, h)

            return one
        digest, flags, n_out = self.digest, out[2:], out.numel() * 8

        def fn(h) -> None:
            check(drv.cuMemsetD8Async(ptr(out.data_ptr()), 0, n_out, h), "cuMemsetD8Async")
            launch_checksum(buf, digest, h)
            if flags.numel():
                kernels.launch_finite(buf, table, most, flags, h)
            if slot is not None:
                issue_dtod(slot, buf, h)
                issue_dtod(row, digest.view(torch.uint8), h)
            issue_dtoh(host, out, h)

        return fn

    def _capture_torch(self, use_graph: bool) -> None:
        buf, out, host, digest, views = self._buf, self.out, self.host, self.digest, self._spans
        flags, on_cuda = out[2:], buf.is_cuda

        def scan() -> None:
            if views:
                flags.copy_(torch.stack([torch.isfinite(v).all() for v in views]))
            if whole:
                if not (captured and launch_checksum(buf, digest)):
                    device_checksum(buf, out=digest)
                if on_cuda:
                    copy_io(host, out)

        self.plan = StepPlan(scan, buf.device, use_graph)
        captured = self.plan.use_graph
        # A graph takes the kernel's checksum (one launch, no temporaries) but not torch's: its
        # state-sized temporaries would stay in the graph's pool; that one runs after the replay.
        self.whole = whole = not captured or kernel_ready(buf)  # digest and readback in scan
        self.plan.capture([])  # it reads the arena and writes only its own buffers

    # -- reading -----------------------------------------------------------------------------------
    def result(self) -> tuple[list[str], str]:
        """(the floating-point regions holding NaN/Inf, the hex checksum), once the pass is
        done (after the caller's wait)."""
        vals = self._host_np.tolist()
        checksum = hex_of(vals[:2])
        if self.fused:
            if not any(vals[2:]):  # every region finite: the usual answer, made at once
                return [], checksum
            return [n for n, f in zip(self._checked, vals[2:], strict=True) if f], checksum
        if all(vals[2:]):  # a finite flag per span
            return [], checksum
        # a span is not finite: which regions (a rare, slower path); padding is not state
        views = self.session.views
        return [n for n in self.regions if not bool(torch.isfinite(views[n]).all())], checksum
