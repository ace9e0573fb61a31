"""The fused step compiled ahead of time and kept on disk, so a warm start loads it instead of
tracing and compiling it again.

torch.compile with warm inductor caches still traces the step with Dynamo and looks every graph
up on each start: 6.6 s for builtin:hybrid's first call on the H200, where loading the same step
saved by `torch.compile(...).aot_compile(...)` took 2.4 s and stepped bit for bit alike
(bench/precompile_probe.py). AOTInductor, the other way to skip the compiler, crashed its loader
on that machine (bench/aot_probe.py).

An artifact is only used by a process that would compile the very same thing: its folder is
keyed by the engine fingerprint (policy, weights, state layout, device type) and by what the
compiled code depends on beyond it (torch and Python versions, the GPU's name and compute
capability, the source of this package and of the policy's module classes); its file name by
the shapes, dtypes and constants the step is called with. Before a loaded step is used it runs
once on zeroed copies of its arguments, and the result's digest must equal the one recorded when
it was compiled; anything else (a failed load, another digest, a guard that no longer holds) is
logged, the file is removed, and the step is compiled and saved again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what is saved, or how it is checked, changes
_PACKAGE = Path(__file__).resolve().parents[1]  # flashrt_ros/


def _sources(policy: torch.nn.Module) -> list[Path] | None:
    """This package's Python files, and the files defining the policy's module classes that
    live outside it and outside torch (a user policy loaded as "package.module:factory");
    None when one of those classes has no source file (defined in `python -c` code or a
    notebook): nothing could tell when its code changed."""
    files = set(_PACKAGE.rglob("*.py"))
    torch_root = Path(torch.__file__).resolve().parent
    classes = {cls for m in policy.modules() for cls in type(m).__mro__}
    for cls in sorted(classes, key=lambda c: f"{c.__module__}.{c.__qualname__}"):
        if cls is object or cls.__module__.split(".")[0] == "torch":
            continue
        try:
            inspect.getsource(cls)  # the definition is really in that file
            f = inspect.getsourcefile(cls)
        except (TypeError, OSError):
            f = None
        p = Path(f).resolve() if f else None
        if p is None or not p.is_file():
            return None
        if torch_root not in p.parents:
            files.add(p)
    return sorted(files)


def step_key(fingerprint: str, policy: torch.nn.Module, device: torch.device) -> str | None:
    """The folder name of a policy's compiled steps on this machine (see the module's doc);
    None when the policy's code cannot be read (nothing is then saved or loaded)."""
    sources = _sources(policy)
    if sources is None:
        return None
    h = hashlib.sha256()
    for f in sources:
        h.update(str(f).encode())
        h.update(f.read_bytes())
    dev = torch.device(device)
    gpu = None
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        gpu = [props.name, props.major, props.minor]
    blob = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": dev.type,
        "gpu": gpu,
        "code": h.hexdigest(),
    }
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()[:32]


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in _tensors(x[k])]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _tensors(v)]
    return []


def _describe(x) -> object:
    """What a compiled step is specialised on: tensor metadata and constant values (a module is
    covered by the folder's key)."""
    if isinstance(x, torch.Tensor):
        return ["T", list(x.shape), list(x.stride()), str(x.dtype), x.device.type]
    if isinstance(x, dict):
        return {str(k): _describe(v) for k, v in sorted(x.items())}
    if isinstance(x, list | tuple):
        return [_describe(v) for v in x]
    if isinstance(x, torch.nn.Module):
        return "module"
    return repr(x)


def signature(args: tuple) -> str:
    return hashlib.sha256(json.dumps(_describe(args)).encode()).hexdigest()[:24]


def _zeroed(args: tuple) -> tuple:
    """The arguments with every tensor replaced by a zeroed copy (dicts and tuples rebuilt)."""

    def z(x):
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        if isinstance(x, dict):
            return {k: z(v) for k, v in x.items()}
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(z(v) for v in x)
        return x

    return tuple(z(a) for a in args)


def check_digest(fn: Callable, args: tuple) -> str:
    """Digest of every tensor argument after one call of `fn` on zeroed copies of them: the
    same compiled kernels give the same bytes, so a loaded step must reproduce it."""
    zs = _zeroed(args)
    with torch.no_grad():
        fn(*zs)
    h = hashlib.sha256()
    for t in _tensors(zs):
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


class PrecompiledSteps:
    """The compiled steps of one engine under `folder/aot/<step_key>`; `events` says, per step,
    whether it was loaded or compiled and how long that took (the node logs them)."""

    def __init__(self, folder: Path, key: str):
        self.folder = Path(folder) / "aot" / key
        self.events: list[str] = []
        self._fns: dict[str, Callable] = {}

    def step(self, fn: Callable, args: tuple, fallback: Callable) -> Callable:
        """`fn` compiled for `args` (its example call): loaded from disk when a checked
        artifact is there, else compiled, saved and returned. Sessions called with the same
        shapes and constants share one. Where torch cannot compile it ahead of time (e.g. a
        policy class defined inside a function, which its guards cannot name), `fallback`
        (torch.compile's function, compiled on first call) is returned instead."""
        name = "step-" + signature(args)
        got = self._fns.get(name)
        if got is None:
            got = self._load(name, args)
            if got is None:
                try:
                    got = self._compile(name, fn, args)
                except Exception as e:  # noqa: BLE001 - torch.compile's usual path still works
                    why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    log.warning("step not compiled ahead of time (%s); torch.compile instead", why)
                    self.events.append(f"{name}: not compiled ahead of time ({why}), torch.compile")
                    got = fallback
            self._fns[name] = got
        return got

    def _load(self, name: str, args: tuple) -> Callable | None:
        path, meta = self.folder / f"{name}.bin", self.folder / f"{name}.json"
        if not path.exists():
            return None
        t = time.perf_counter()
        why = None
        try:
            want = json.loads(meta.read_text())["check"]
            with path.open("rb") as f:
                fn = torch.compiler.load_compiled_function(f)
            if check_digest(fn, args) != want:
                why = "its check step gives other bytes than when it was compiled"
        except Exception as e:  # noqa: BLE001 - any failure means: compile again
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if why is not None:
            log.warning("precompiled step %s not used (%s); compiling it again", path, why)
            self.events.append(f"{name}: not used ({why}), compiled again")
            for p in (path, meta):
                p.unlink(missing_ok=True)
            return None
        self.events.append(f"{name}: loaded in {time.perf_counter() - t:.2f} s")
        return fn

    def _compile(self, name: str, fn: Callable, args: tuple) -> Callable:
        t = time.perf_counter()
        cfg = torch._dynamo.config
        if hasattr(cfg, "enable_aot_compile"):  # off by default in torch 2.11
            cfg.enable_aot_compile = True
        with torch.no_grad():
            compiled = torch.compile(fn, fullgraph=True, dynamic=False).aot_compile((args, {}))
        check = check_digest(compiled, args)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.folder / f".{name}.{os.getpid()}.tmp"
            compiled.save_compiled_function(str(tmp))
            os.replace(tmp, self.folder / f"{name}.bin")
            (self.folder / f"{name}.json").write_text(
                json.dumps({"check": check, "torch": torch.__version__, "saved": time.time()})
            )
            where = f"saved to {self.folder}"
        except OSError as e:  # a cache only saves time: a read-only folder is no failure
            where = f"not saved ({e})"
            log.warning("precompiled step %s %s", name, where)
        self.events.append(f"{name}: compiled in {time.perf_counter() - t:.2f} s, {where}")
        return compiled
