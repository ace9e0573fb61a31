"""A bytecode cache for the node's process, so a warm start does not recompile torch.

Python keeps compiled bytecode (.pyc) beside each module, unless the environment forbids it
(PYTHONDONTWRITEBYTECODE=1, common in containers) or the site-packages folder is read-only.
Then every start compiles torch, dynamo and inductor from source again: measured on the H200
machine, whose environment sets PYTHONDONTWRITEBYTECODE=1, a cProfile run (not committed)
counted 7.7 s of compiling in a warm Engine build of about 12 s, and `import torch` took
3.9-4.7 s instead of 1.5 s. When torch has no bytecode of its own and none can be written
beside it, the node points `sys.pycache_prefix` at a folder of its own and lets Python write
there. Python checks each cached file against its source's size and
mtime, so an upgraded package is recompiled, never served stale.

FLASHRT_PYCACHE=0 turns this off; FLASHRT_PYCACHE=/some/dir chooses the folder (default
$XDG_CACHE_HOME/flashrt_ros/pycache, else ~/.cache/flashrt_ros/pycache). With the prefix set,
Python looks for every module's bytecode there only (rclpy's and numpy's too, whose own
__pycache__ folders it then ignores): the first start fills it, later ones read it. Child
processes (inductor's compile workers) do not inherit it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path


def default_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashrt_ros" / "pycache"


def has_bytecode(package: str = "torch") -> bool:
    """Whether `package` will load from bytecode: a .pyc of its __init__ exists beside it, or
    Python may write one there (then the first start writes it, as usual)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return True  # nothing to gain
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return True  # already cached (beside the source, or under an active prefix)
    folder = os.path.dirname(spec.origin)
    return not sys.dont_write_bytecode and os.access(folder, os.W_OK)


def enable(env: Mapping[str, str] | None = None, package: str = "torch") -> str:
    """Point Python's bytecode cache at our folder when `package` would otherwise be compiled
    from source at every start. Returns what was done, for the start-up log ("" = nothing)."""
    env = os.environ if env is None else env
    choice = env.get("FLASHRT_PYCACHE", "")
    if choice == "0" or sys.pycache_prefix is not None or has_bytecode(package):
        return ""
    folder = (Path(choice).expanduser() if choice else default_dir(env)).resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"no bytecode cache ({folder}: {e.strerror}); {package} compiles from source"
    if not os.access(folder, os.W_OK):
        return f"no bytecode cache ({folder} is not writable); {package} compiles from source"
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    return f"bytecode cache {folder} ({package} has none of its own)"
