"""The fused step compiled ahead of time and kept on disk, so a warm start loads it instead of
tracing and compiling it again.

torch.compile with warm inductor caches still traces the step with Dynamo and looks every graph
up on each start: 6.6 s for builtin:hybrid's first call on the H200, where loading the same step
saved by `torch.compile(...).aot_compile(...)` took 2.4 s and stepped bit for bit alike
(bench/precompile_probe.py). AOTInductor, the other way to skip the compiler, crashed its loader
on that machine (bench/aot_probe.py).

What guards against a stale artifact:
- its folder is keyed by the engine fingerprint (policy, weights, state layout, device type) and
  by what the compiled code depends on beyond it: torch and Python versions, the GPU's name and
  compute capability (on the CPU its capability level and its instruction-set flags: inductor
  builds for the machine it runs on), the source of this package and of the policy's module
  classes;
- its file name by the shapes, strides, dtypes, devices and constants of the call, and the
  plain attributes (numbers, strings) of the policy's modules;
- the source of every module whose code the compiler inlined is recorded at save time and
  compared at load time (helpers in other files, libraries such as lerobot after an upgrade);
- a loaded step is called twice on zeroed copies of its arguments and must give the bytes
  recorded when it was compiled both times;
- nothing is saved or loaded when a file the key reads, or an inlined module's file, changed
  after this process started (the code in memory is then not the code on disk, which is what
  torch records of an inlined module);
- the record names the step file's digest, so a load never pairs a record and a step saved by
  two processes at once.
A failed load or check is logged, the file removed, and the step compiled and saved again. Not
covered: a module-level global changed at run time (torch drops guards on globals when it
saves), and a file replaced after the process started by a copy that keeps an older mtime
(`cp -p`, `rsync -a`): its source then looks unchanged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import io
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FORMAT = 3  # bump when what is saved, or how it is checked, changes (3: the step's digest)
_PACKAGE = Path(__file__).resolve().parents[1]  # flashrt_ros/


def _process_start() -> float:
    """When this process started (wall clock; Linux /proc), else now: files changed after it
    may not be the code the process runs (a module imported before this one was, then edited,
    counts too). /proc's boot time has 1 s steps: the result is early rather than late, which
    only ever declines a cache."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        btime = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return btime + ticks / os.sysconf("SC_CLK_TCK") - 1.0
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


_STARTED = _process_start()  # files changed after this are not the code this process runs


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


def _cpu_flags() -> str:
    """Digest of this CPU's instruction-set flags: inductor builds its C++ for the machine it
    runs on (-march=native), so two CPUs of one capability level (AVX512) but other extensions
    (AMX, VNNI) must not share a compiled step (it would die of an illegal instruction)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):  # x86, ARM
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                return hashlib.sha256(flags.encode()).hexdigest()[:16]
    except OSError:
        pass
    return "unknown"


def step_key(fingerprint: str, policy: torch.nn.Module, device: torch.device) -> str | None:
    """The folder name of a policy's compiled steps on this machine (see the module's doc);
    None when the policy's code cannot be read, or changed on disk after this process started
    (nothing is then saved or loaded)."""
    sources = _sources(policy)
    if sources is None:
        return None
    h = hashlib.sha256()
    for f in sources:
        if f.stat().st_mtime > _STARTED:
            return None
        h.update(str(f).encode())
        h.update(f.read_bytes())
    dev = torch.device(device)
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        machine = [props.name, props.major, props.minor]
    else:  # inductor's CPU code uses the instruction set it was compiled on
        machine = [torch.backends.cpu.get_cpu_capability(), _cpu_flags()]
    blob = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": dev.type,
        "machine": machine,
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
        return ["T", list(x.shape), list(x.stride()), str(x.dtype), str(x.device)]
    if isinstance(x, dict):
        return {str(k): _describe(v) for k, v in sorted(x.items())}
    if isinstance(x, list | tuple):
        return [_describe(v) for v in x]
    if isinstance(x, torch.nn.Module):  # its plain attributes, which guards may test
        plain = (bool, int, float, str, type(None))

        def kept(v) -> bool:
            return isinstance(v, plain) or (dataclasses.is_dataclass(v) and not isinstance(v, type))

        return {  # an address in a repr would make every process's name another
            name: {
                k: r
                for k, v in sorted(vars(m).items())
                if kept(v) and " at 0x" not in (r := repr(v))
            }
            for name, m in x.named_modules()
        }
    return repr(x)


def signature(args: tuple) -> str:
    return hashlib.sha256(json.dumps(_describe(args)).encode()).hexdigest()[:24]


def _zeroed(args: tuple, keep: tuple[int, ...]) -> tuple:
    """The arguments with every tensor replaced by a zeroed copy (dicts and tuples rebuilt),
    except the arguments at the positions in `keep`, passed as they are."""

    def z(x):
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        if isinstance(x, dict):
            return {k: z(v) for k, v in x.items()}
        if isinstance(x, tuple) and not hasattr(x, "_fields"):
            return tuple(z(v) for v in x)
        return x

    return tuple(a if i in keep else z(a) for i, a in enumerate(args))


def check_digest(fn: Callable, args: tuple, keep: tuple[int, ...] = ()) -> str:
    """Digest of the tensor arguments after one call of `fn` on zeroed copies of them: the
    same compiled kernels give the same bytes, so a loaded step must reproduce it. The
    arguments at `keep` (a flight ring: up to 100,000 states) are used as they are and not
    digested; the call may write them."""
    zs = _zeroed(args, keep)
    with torch.no_grad():
        fn(*zs)
    h = hashlib.sha256()
    for t in _tensors(tuple(a for i, a in enumerate(zs) if i not in keep)):
        h.update(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _repeats(fn: Callable, args: tuple, keep: tuple[int, ...], check: str) -> None:
    """A second check call must give the same bytes. A compiled step that cannot be called
    again (a policy that changes a Python attribute in its step: the saved guards fail, where
    torch.compile would compile again) raises here, and the engine uses torch.compile."""
    if check_digest(fn, args, keep) != check:
        raise RuntimeError("a second call of the compiled step gave other bytes")


def _inlined(compiled) -> dict[str, str] | None:
    """Digest of the source of each module the compiler inlined code from (None where this
    torch does not say)."""
    try:
        got = compiled.source_info().inlined_sources
        return {s.module: hashlib.sha256(s.content.encode()).hexdigest() for s in got}
    except Exception:  # noqa: BLE001 - an older torch: the key alone then guards the code
        return None


def _own_temp(folder: Path, prefix: str) -> Path:
    """An empty file of our own in `folder`, with the mode a plain create would give it (the
    cache may be shared: mkstemp's 0600 would keep other users' processes out)."""
    fd, name = tempfile.mkstemp(dir=folder, prefix=prefix)
    os.close(fd)
    os.chmod(name, 0o666 & ~_umask())
    return Path(name)


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would change it for every
    thread for a moment: the node's other threads create files too)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _edited_since_start(modules) -> str | None:
    """The first of `modules` (names) whose file changed after this process started: the code
    in memory is then not the source on disk, which is what torch records of an inlined module
    (an artifact saved so would hold the old code under the new source)."""
    for module in modules or ():
        f = getattr(sys.modules.get(module), "__file__", None)
        try:
            if f and os.stat(f).st_mtime > _STARTED:
                return module
        except OSError:
            return module
    return None


def _changed_source(recorded: dict[str, str] | None) -> str | None:
    """The first inlined module whose source is not the one recorded, or None."""
    for module, digest in (recorded or {}).items():
        try:
            now = inspect.getsource(importlib.import_module(module))
        except Exception:  # noqa: BLE001 - gone or unreadable: not the recorded code
            return module
        if hashlib.sha256(now.encode()).hexdigest() != digest:
            return module
    return None


class PrecompiledSteps:
    """The compiled steps of one engine under `folder/aot/<step_key>`; `events` says, per step,
    whether it was loaded or compiled and how long that took (the node logs them)."""

    def __init__(self, folder: Path, key: str):
        self.folder = Path(folder) / "aot" / key
        self.events: list[str] = []
        self._fns: dict[str, Callable] = {}

    def step(
        self,
        fn: Callable,
        args: tuple,
        fallback: Callable[[], Callable],
        keep: tuple[int, ...] = (),
        loaded_only: bool = False,
    ) -> Callable:
        """`fn` compiled for `args` (its example call): loaded from disk when a checked
        artifact is there, else compiled, saved and returned. Sessions called with the same
        shapes and constants share one. Where torch cannot compile it ahead of time (e.g. a
        policy class defined inside a function, which its guards cannot name), `fallback()`
        (torch.compile's function, compiled on first call) is returned instead. `keep`: see
        check_digest. The step keeps a grad-mode guard: call it under torch.no_grad().
        `loaded_only`: RuntimeError unless this process already has it (loading checks a step
        by calling it, which writes the arguments at `keep`: never a live session's)."""
        name = "step-" + signature(args)
        got = self._fns.get(name)
        if got is None and loaded_only:
            raise RuntimeError(f"precompiled {name} is not loaded in this process")
        if got is None:
            got = self._load(name, args, keep)
            if got is None:
                try:
                    got = self._compile(name, fn, args, keep)
                except Exception as e:  # noqa: BLE001 - torch.compile's usual path still works
                    why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                    log.warning("step not compiled ahead of time (%s); torch.compile instead", why)
                    self.events.append(f"{name}: not compiled ahead of time ({why}), torch.compile")
                    got = fallback()
            self._fns[name] = got
        return got

    def _load(self, name: str, args: tuple, keep: tuple[int, ...]) -> Callable | None:
        path, meta = self.folder / f"{name}.bin", self.folder / f"{name}.json"
        # the record is written first and the step last, each atomically: a step without its
        # record is one being saved by another process right now, not a broken one
        if not path.exists() or not meta.exists():
            return None
        t = time.perf_counter()
        why, keep_files = None, False
        try:
            record = json.loads(meta.read_text())
            changed = _changed_source(record.get("sources"))
            edited = _edited_since_start(record.get("sources"))
            if changed is not None:
                why = f"the source of {changed} changed since it was compiled"
            elif edited is not None:  # the files are right for processes started since
                why, keep_files = f"{edited} changed on disk after this process started", True
            else:
                blob = path.read_bytes()
                if hashlib.sha256(blob).hexdigest() != record.get("bin_sha256"):
                    raise RuntimeError("the step file is not the one its record describes")
                fn = torch.compiler.load_compiled_function(io.BytesIO(blob))
                if check_digest(fn, args, keep) != record["check"]:
                    why = "its check step gives other bytes than when it was compiled"
                else:
                    _repeats(fn, args, keep, record["check"])
        except Exception as e:  # noqa: BLE001 - any failure means: compile again
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if why is not None:
            log.warning("precompiled step %s not used (%s); compiling it again", path, why)
            self.events.append(f"{name}: not used ({why}), compiled again")
            for p in () if keep_files else (path, meta):
                try:
                    p.unlink(missing_ok=True)
                except OSError as e:  # a read-only cache: the step is compiled, nothing saved
                    log.warning("cannot remove %s (%s)", p, e)
            return None
        self.events.append(f"{name}: loaded in {time.perf_counter() - t:.2f} s")
        return fn

    def _compile(self, name: str, fn: Callable, args: tuple, keep: tuple[int, ...]) -> Callable:
        t = time.perf_counter()
        cfg = torch._dynamo.config
        flag = {"enable_aot_compile": True} if hasattr(cfg, "enable_aot_compile") else {}
        with cfg.patch(**flag), torch.no_grad():  # off by default in torch 2.11
            compiled = torch.compile(fn, fullgraph=True, dynamic=False).aot_compile((args, {}))
        check = check_digest(compiled, args, keep)
        _repeats(compiled, args, keep, check)
        record = {
            "check": check,
            "sources": _inlined(compiled),
            "torch": torch.__version__,
            "saved": time.time(),
        }
        edited = _edited_since_start(record["sources"])
        try:  # a cache only saves time: a folder or a step that cannot be written is no failure
            if edited is not None:  # torch recorded the disk's source, not the code it compiled
                raise RuntimeError(f"{edited} changed on disk after this process started")
            self.folder.mkdir(parents=True, exist_ok=True)
            # files of our own (two processes, or two containers with one pid, may save at
            # once); the record names the step's digest, so a load never pairs one process's
            # record with another's step; the record goes in first, the step last
            tmps = [_own_temp(self.folder, f".{name}.") for _ in "ab"]
            try:
                compiled.save_compiled_function(str(tmps[0]))
                record["bin_sha256"] = hashlib.sha256(tmps[0].read_bytes()).hexdigest()
                tmps[1].write_text(json.dumps(record))
                os.replace(tmps[1], self.folder / f"{name}.json")
                os.replace(tmps[0], self.folder / f"{name}.bin")
            finally:
                for tmp in tmps:
                    tmp.unlink(missing_ok=True)
            where = f"saved to {self.folder}"
        except Exception as e:  # noqa: BLE001
            where = f"not saved ({type(e).__name__}: {e})".splitlines()[0][:300]
            log.warning("precompiled step %s %s", name, where)
        self.events.append(f"{name}: compiled in {time.perf_counter() - t:.2f} s, {where}")
        return compiled
