"""The import rules of the layers (docs/design.md, "Layers"), checked on the source with `ast`.

The core (runtime, capsules, policies, cuda, obs, errors.py, scheduling.py) must run where ROS
is not installed (the GPU benchmark machine, a training job): it never imports ROS, nor the
layers built on it. Inside the core, cuda/ is a toolkit that imports nothing of ours, policies/
never reach into the runtime that serves them, and errors.py and scheduling.py are leaves.
replay/ works without the node. Every import is checked, also the ones inside functions,
`from . import x` and `from flashrt_ros import Name` (resolved through the package's lazy
exports), and `importlib.import_module("literal")`.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "flashrt_ros"

CORE = ("runtime", "capsules", "policies", "cuda", "obs", "errors", "scheduling")
LEAVES = ("errors", "scheduling")  # top-level modules that import nothing of ours
ON_TOP = ("node", "replay", "sim", "demo")  # the layers built on the core
# top-level modules that are ROS (or, for rosbags, replay-only): never imported by the core
ROS_EXACT = {"rclpy", "builtin_interfaces", "rosbags", "message_filters", "tf2_ros"}
ROS_PREFIXES = ("rcl", "rmw", "rosidl", "launch", "ament", "rosgraph", "rosbag2", "ros2")
ROS_SUFFIXES = ("_msgs", "_srvs", "_interfaces")


@dataclass(frozen=True)
class Import:
    path: Path  # the importing file
    line: int
    module: str  # absolute dotted name of what is imported

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root.parent)}:{self.line}: imports {self.module}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def lazy_exports(root: Path) -> dict[str, str]:
    """Names the package root hands out lazily (`from flashrt_ros import Engine`) -> the module
    they come from, read from the imports inside its __init__.py."""
    out = {}
    for node in ast.walk(ast.parse((root / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                out[alias.asname or alias.name] = node.module
    return out


def _is_module(dotted: str, root: Path) -> bool:
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    base = root / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports_of(path: Path, root: Path, lazy: dict[str, str]) -> list[Import]:
    """Every import of one file, wherever it sits (module level, functions, try blocks)."""
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[Import] = []

    def add(line: int, mod: str) -> None:
        found.append(Import(path, line, mod))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            add(node.lineno, base)
            if base == PKG or base.startswith(PKG + "."):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if _is_module(sub, root):
                        add(node.lineno, sub)
                    elif base == PKG and alias.name in lazy:
                        add(node.lineno, lazy[alias.name])
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Name) and node.func.id == "__import__")
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
            )
        ):
            add(node.lineno, node.args[0].value)
    return found


def all_imports(root: Path) -> list[Import]:
    lazy = lazy_exports(root)
    out = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" not in path.parts:
            out += imports_of(path, root, lazy)
    return out


def layer_of(imp: Import, root: Path) -> str:
    """'runtime', 'errors', 'node', ... or '' for the package root (flashrt_ros/__init__.py)."""
    rel = imp.path.relative_to(root).parts
    return rel[0].removesuffix(".py") if rel[0] != "__init__.py" else ""


def is_ros(mod: str) -> bool:
    top = mod.split(".")[0]
    if top == PKG:
        return mod.split(".")[1:2] in (["msg"], ["srv"], ["action"])  # generated interfaces
    return top in ROS_EXACT or top.startswith(ROS_PREFIXES) or top.endswith(ROS_SUFFIXES)


def ours(mod: str, *layers: str) -> bool:
    """Whether `mod` is flashrt_ros itself, or (with layers) one of those layers or below."""
    if not layers:
        return mod == PKG or mod.startswith(PKG + ".")
    return any(mod == f"{PKG}.{x}" or mod.startswith(f"{PKG}.{x}.") for x in layers)


def violations(root: Path) -> list[str]:
    """Every broken rule as 'file:line: imports X (rule)'."""
    bad = []
    for imp in all_imports(root):
        layer, mod = layer_of(imp, root), imp.module
        rules = []
        if layer in CORE or layer == "":
            if is_ros(mod):
                rules.append("the core never imports ROS")
            if ours(mod, *ON_TOP):
                rules.append("the core never imports node/replay/sim/demo")
        if layer == "cuda" and ours(mod) and not ours(mod, "cuda"):
            rules.append("cuda/ imports nothing of flashrt_ros")
        if layer == "policies" and (ours(mod, "runtime", "capsules", *ON_TOP)):
            rules.append("policies/ never import runtime, capsules or the layers above")
        if layer in LEAVES and ours(mod):
            rules.append(f"{layer}.py imports nothing of flashrt_ros")
        if layer == "replay" and ours(mod, "node"):
            rules.append("replay/ never imports node/")
        bad += [f"{imp.where(root)} ({r})" for r in rules]
    return bad


# -- the tests ---------------------------------------------------------------------------------
def test_the_checker_sees_every_layer_and_imports_inside_functions():
    """Guards the guard: a renamed folder or a missed kind of import would make the rules
    vacuous."""
    imps = all_imports(ROOT / PKG)
    layers = {layer_of(i, ROOT / PKG) for i in imps}
    assert set(CORE) | {"node", "replay", "sim"} <= layers, layers
    # replay_cli imports rclpy inside a function only, and flashrt_ros.Engine lazily
    cli = [i.module for i in imps if i.path.name == "replay_cli.py"]
    assert "rclpy" in cli and "flashrt_ros.runtime.engine" in cli
    rel = [i.module for i in imps if i.path == ROOT / PKG / "capsules" / "store.py"]
    assert "flashrt_ros.capsules.diskfmt" in rel  # `from flashrt_ros.capsules import diskfmt`


def test_the_tree_keeps_the_import_rules():
    bad = violations(ROOT / PKG)
    assert not bad, "import rules broken (see docs/design.md, Layers):\n" + "\n".join(bad)


def test_a_forbidden_import_is_reported_with_file_and_line(tmp_path):
    """The rules fail when broken: a copy of the tree with ROS pulled into a policy (inside a
    function) and the runtime into cuda/ is reported at those lines."""
    copy = tmp_path / PKG
    shutil.copytree(ROOT / PKG, copy, ignore=shutil.ignore_patterns("__pycache__", "*.pt"))
    rng = copy / "policies" / "rng.py"
    src = rng.read_text()
    rng.write_text(src + "\n\ndef _oops():\n    import rclpy  # noqa\n")
    line_rclpy = len(src.splitlines()) + 4
    drv = copy / "cuda" / "driver.py"
    dsrc = drv.read_text()
    drv.write_text(dsrc + "\nfrom ..runtime import arena  # noqa\n")
    line_rt = len(dsrc.splitlines()) + 2
    bad = violations(copy)
    assert any(f"policies/rng.py:{line_rclpy}: imports rclpy" in b for b in bad), bad
    assert any(f"cuda/driver.py:{line_rt}: imports flashrt_ros.runtime.arena" in b for b in bad), (
        bad
    )
    assert len(bad) == 3, bad  # rclpy (core, ROS) + runtime (cuda rule) twice: module and package


def test_the_core_imports_where_no_ros_is_installed():
    """Import every core module in a fresh interpreter in which any ROS import fails, then check
    that no ROS module got loaded: what the GPU machine without ROS relies on."""
    core = sorted(
        module_name(p, ROOT / PKG)
        for layer in CORE
        for p in (
            [ROOT / PKG / f"{layer}.py"]
            if layer in LEAVES
            else sorted((ROOT / PKG / layer).rglob("*.py"))
        )
        if "__pycache__" not in p.parts
    )
    code = f"""
import importlib, sys
ROS_EXACT, PRE, SUF = {sorted(ROS_EXACT)!r}, {ROS_PREFIXES!r}, {ROS_SUFFIXES!r}
def is_ros(name):
    top = name.split(".")[0]
    return top in ROS_EXACT or top.startswith(PRE) or top.endswith(SUF) or (
        top == "flashrt_ros" and name.split(".")[1:2] in (["msg"], ["srv"], ["action"]))
class NoRos:
    def find_spec(self, name, path=None, target=None):
        if is_ros(name):
            raise ImportError("ROS is not installed here: " + name)
sys.meta_path.insert(0, NoRos())
for m in {core!r}:
    importlib.import_module(m)
loaded = sorted(m for m in sys.modules if is_ros(m))
assert not loaded, loaded
print("imported", {len(core)}, "core modules")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"imported {len(core)} core modules" in r.stdout
