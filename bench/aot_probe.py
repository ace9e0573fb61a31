"""Which way of loading an AOTInductor package works on this machine (runtime/aot.py's loader
crashed with a segmentation fault on the H200 machine, torch 2.11):

    python3 bench/aot_probe.py --out DIR [--device cuda]

Builds two toy packages (a step that writes its inputs in place, as ours does, and a pure one)
and loads each in fresh processes in several ways: torch's C++ loader with and without CUDA set
up first, with device index -1, and torch's own Python loader (`aoti_load_package`). Each child's
exit status, last lines of output, and (where gdb is installed) a native backtrace of the crash go
to DIR/aot_probe.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch


class InPlace(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, buf, obs, action):
        st = buf[0:8].view(1, 8)
        h = torch.tanh(self.lin(obs) + st)
        st.copy_(h)
        action.copy_(h * 2)


class Pure(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, obs):
        return torch.tanh(self.lin(obs)) * 2


LOAD = {
    "raw": "run = torch._C._aoti.AOTIModelPackageLoader(path, 'model', False, 1, idx).run",
    "raw_after_init": "torch.zeros(1, device=dev); sync()\n"
    "run = torch._C._aoti.AOTIModelPackageLoader(path, 'model', False, 1, idx).run",
    "raw_index_-1_after_init": "torch.zeros(1, device=dev); sync()\n"
    "run = torch._C._aoti.AOTIModelPackageLoader(path, 'model', False, 1, -1).run",
    "python_loader": "import torch._inductor\n"
    "m = torch._inductor.aoti_load_package(path)\n"
    "run = lambda a: m(*a)",
}

CHILD = """
import faulthandler, sys, torch
faulthandler.enable()
path, dev, kind = sys.argv[1], sys.argv[2], sys.argv[3]
idx = (torch.device(dev).index or 0) if dev.startswith('cuda') else -1
sync = torch.cuda.synchronize if dev.startswith('cuda') else (lambda: None)
{load}
print("LOADED", flush=True)
if kind == "inplace":
    a = [torch.zeros(9, device=dev), torch.ones(1, 8, device=dev), torch.zeros(1, 8, device=dev)]
    run(a)
    sync()
    print("RAN", a[0].sum().item() != 0, a[2].abs().sum().item() > 0, flush=True)
else:
    out = run([torch.ones(1, 8, device=dev)])
    sync()
    print("RAN", out[0].shape if isinstance(out, (list, tuple)) else out.shape, flush=True)
"""


def build(mod: torch.nn.Module, args: tuple, path: Path) -> float:
    import torch._inductor

    t = time.perf_counter()
    with torch.no_grad():
        ep = torch.export.export(mod, args, strict=False)
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
    return time.perf_counter() - t


def child(code: str, args: list[str], gdb: bool) -> dict:
    cmd = [sys.executable, "-c", code, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    row = {
        "rc": r.returncode,
        "stdout": r.stdout.strip().splitlines()[-3:],
        "stderr": r.stderr.strip().splitlines()[-12:],
    }
    if r.returncode != 0 and gdb and shutil.which("gdb"):
        g = subprocess.run(
            ["gdb", "-q", "-batch", "-ex", "run", "-ex", "bt 25", "--args", *cmd],
            capture_output=True,
            text=True,
            timeout=180,
        )
        row["gdb_bt"] = [x for x in g.stdout.splitlines() if x.startswith("#")][:25]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device(a.device)
    res: dict = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gcc": subprocess.run(
            ["gcc", "-dumpversion"], capture_output=True, text=True
        ).stdout.strip(),
        "gdb": bool(shutil.which("gdb")),
        "builds": {},
        "loads": {},
    }
    toys = {
        "inplace": (
            InPlace().to(dev),
            (
                torch.zeros(9, device=dev),
                torch.ones(1, 8, device=dev),
                torch.zeros(1, 8, device=dev),
            ),
        ),
        "pure": (Pure().to(dev), (torch.ones(1, 8, device=dev),)),
    }
    for kind, (mod, args) in toys.items():
        path = out / f"{kind}.pt2"
        try:
            res["builds"][kind] = round(build(mod, args, path), 1)
        except Exception as e:
            res["builds"][kind] = f"{type(e).__name__}: {e}"[:500]
            continue
        for name, load in LOAD.items():
            row = child(CHILD.format(load=load), [str(path), str(dev), kind], gdb=name == "raw")
            res["loads"][f"{kind}/{name}"] = row
            print(kind, name, row["rc"], row["stdout"], flush=True)
        path.unlink()
    (out / "aot_probe.json").write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
