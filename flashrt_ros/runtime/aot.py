"""The fused step built ahead of time (AOTInductor) and kept on disk, keyed by what it depends on.

Why: with `torch.compile` even a warm start imports dynamo and inductor and traces the step
again before its cached kernels can run: 3-4 s of a 5-6 s start on the H200 machine, with every
on-disk cache warm (bench/results/latest.md). An AOTInductor package holds the same inductor
kernels compiled into a shared library; torch's C++ loader opens it in milliseconds and never
imports the compiler. So with a compile cache folder the Engine builds each tick kind's fused
step once (`torch.export`, then `aoti_compile_and_package`), stores it under
`<compile_cache_dir>/<fingerprint>/aot/`, and every later start loads it.

The file name is a digest of everything the kernels depend on: the engine fingerprint (policy,
weights, layout, device type), the tick kind, the input and output shapes and dtypes, the image
conversions, whether the step records the flight ring itself, torch's and CUDA's versions and
the GPU's compute capability. Changed weights or another torch can never meet a stale package.
A package that does not load (truncated, from a crashed writer) is rebuilt; a step that cannot
be exported falls back to `torch.compile`, with a warning saying why. Packages are written to a
temporary name and renamed, so two nodes starting together never read half a file.

The step keeps its contract: it mutates the arena, the action and the chunk in place and
returns nothing (export records the in-place writes; the package applies them to the tensors
it is given), so a package step is captured into the session's CUDA graph like any other.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SCHEMA = 2  # bump when the wrapped step's calling convention or the decompositions change

# Run in a fresh process on a new package (AotSteps._try_in_child): load it, run it once on
# zeros of the right shapes.
TRY = r"""
import json, sys, torch
path, device, sigs = sys.argv[1], torch.device(sys.argv[2]), json.loads(sys.argv[3])
index = device.index if device.type == "cuda" else -1
run = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, index).run
run([torch.zeros(s, dtype=getattr(torch, d), device=device) for s, d in sigs])
if device.type == "cuda":
    torch.cuda.synchronize(device)
print("LOADED")
"""


def _gru_gates(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    """aten._thnn_fused_gru_cell (the gate math of a CUDA GRU cell, after its two matmuls) in
    plain ops: it has no C shim, so AOTInductor would call it through its proxy executor; as
    plain ops inductor fuses it with its neighbours. Gates r, z, n; the workspace as ATen's."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, iz, i_n = input_gates.chunk(3, 1)
    hr, hz, h_n = hidden_gates.chunk(3, 1)
    r = torch.sigmoid(ir + hr)
    z = torch.sigmoid(iz + hz)
    n = torch.tanh(i_n + r * h_n)
    return n + z * (hx - n), torch.cat([r, z, n, hx, h_n], 1)


DECOMPOSITIONS = {torch.ops.aten._thnn_fused_gru_cell.default: _gru_gates}


def _sig(t: torch.Tensor | None) -> list | None:
    return None if t is None else [list(t.shape), str(t.dtype)]


class _Step(torch.nn.Module):
    """arena_step with everything static bound, over a flat list of tensors (the order the
    package's run() takes): buf, action, chunk, the observation tensors, then the ring."""

    def __init__(self, step: Callable, policy, table, kind, conv, names, has_ring) -> None:
        super().__init__()
        self.policy = policy
        self._step = step
        self._table, self._kind, self._conv = table, kind, conv
        self._names, self._has_ring = names, has_ring

    def forward(self, buf, action, chunk, *rest):
        k = len(self._names)
        obs = dict(zip(self._names, rest[:k], strict=True)) if self._conv is not None else rest[0]
        ring = rest[k] if self._has_ring else None
        self._step(self.policy, buf, obs, action, chunk, self._table, ring, self._kind, self._conv)


class AotSteps:
    """Called like session.fused_step()'s function; each distinct step (tick kind, shapes) is
    loaded from its package, or compiled into one first. `built` and `loaded` count both."""

    def __init__(
        self, folder: Path, fingerprint: str, device: torch.device, fallback: Callable[[], Callable]
    ) -> None:
        self.folder = Path(folder) / "aot"
        self.fingerprint = fingerprint
        self.device = torch.device(device)
        self._fallback = fallback  # () -> torch.compile'd arena_step, when a step won't export
        self._runs: dict[tuple, Callable] = {}
        self.built = 0
        self.loaded = 0
        self.fell_back: list[str] = []

    def __call__(self, policy, buf, obs, action, chunk, table, ring, kind, conv) -> None:
        names = tuple(obs) if conv is not None else ()
        tensors = [obs[n] for n in names] if conv is not None else [obs]
        key = (id(policy), kind, table, conv, names, ring is not None)
        run = self._runs.get(key)
        if run is None:
            run = self._runner(policy, buf, tensors, action, chunk, table, ring, kind, conv, names)
            self._runs[key] = run
        run([buf, action, chunk, *tensors, *([ring] if ring is not None else [])])

    def path(self, policy_args: dict) -> Path:
        """The package file of one step, named by the digest of what its kernels depend on."""
        blob = {
            "schema": SCHEMA,
            "fingerprint": self.fingerprint,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "device": self.device.type,
            "capability": list(torch.cuda.get_device_capability(self.device))
            if self.device.type == "cuda"
            else None,
            **policy_args,
        }
        digest = hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:24]
        return self.folder / f"step-k{policy_args['kind']}-{digest}.pt2"

    def _runner(self, policy, buf, tensors, action, chunk, table, ring, kind, conv, names):
        args = {
            "kind": kind,
            "table": [[n, str(d), list(s), o, b] for n, d, s, o, b in table],
            "conv": [list(c) for c in conv] if conv is not None else None,
            "names": list(names),
            "inputs": [_sig(t) for t in (buf, action, chunk, *tensors, ring)],
        }
        path = self.path(args)
        if path.is_file():
            run = self._load(path)
            if run is not None:
                self.loaded += 1
                return run
            log.warning("fused step package %s does not load: rebuilding it", path)
            with contextlib.suppress(OSError):
                path.unlink()
        from flashrt_ros.runtime.session import arena_step

        module = _Step(arena_step, policy, table, kind, conv, names, ring is not None)
        example = (buf, action, chunk, *tensors, *([ring] if ring is not None else []))
        t = time.perf_counter()
        try:
            self._build(module, example, path)
        except Exception as e:  # a step export cannot take: torch.compile's way instead
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning(
                "fused step (kind %d) not built ahead of time (%s): torch.compile", kind, why
            )
            self.fell_back.append(why)
            fused = self._fallback()

            def compiled(flat: list) -> None:
                k = len(names)
                obs = (
                    dict(zip(names, flat[3 : 3 + k], strict=True)) if conv is not None else flat[3]
                )
                rng = flat[3 + max(k, 1)] if ring is not None else None
                fused(policy, flat[0], obs, flat[1], flat[2], table, rng, kind, conv)

            return compiled
        run = self._load(path)
        if run is None:
            raise RuntimeError(f"the fused step package just built does not load: {path}")
        self.built += 1
        log.info(
            "fused step (kind %d) built ahead of time in %.1f s: %s",
            kind,
            time.perf_counter() - t,
            path,
        )
        return run

    def _build(self, module: _Step, example: tuple, path: Path) -> None:
        """Export the step and compile it into a package, written under a temporary name and
        renamed: a reader never sees half a file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        import torch._inductor  # the compiler: only a start that builds imports it

        with torch.no_grad():
            ep = torch.export.export(module, example, strict=False)
            ep = ep.run_decompositions(DECOMPOSITIONS)
            fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".pt2", dir=path.parent)
            os.close(fd)
            os.chmod(tmp, 0o644)  # as any cache file (mkstemp makes it private)
            try:
                torch._inductor.aoti_compile_and_package(ep, package_path=tmp)
                self._try_in_child(tmp, example)
                os.replace(tmp, path)
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)

    def _try_in_child(self, tmp: str, example: tuple) -> None:
        """Load and run a new package once in another process before it is installed: a package
        that crashes its loader (seen: a segmentation fault) must never be what every later
        start of the node opens. RuntimeError when that process fails."""
        sigs = [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in example]
        r = subprocess.run(
            [sys.executable, "-c", TRY, tmp, str(self.device), json.dumps(sigs)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0 or "LOADED" not in r.stdout:
            tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(
                f"a test process could not run the package (exit {r.returncode}: {tail})"
            )

    def _load(self, path: Path) -> Callable | None:
        """The package's run(list of tensors), through torch's C++ loader (no compiler import);
        None when it does not load."""
        index = self.device.index if self.device.type == "cuda" else -1
        try:
            loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, index)
        except Exception as e:
            log.warning("cannot load %s: %s: %s", path, type(e).__name__, e)
            return None
        return loader.run
