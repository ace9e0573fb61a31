"""Regenerate or check the golden command bags: the shipped policy's commands for each fixture bag.

    python tools/make_golden.py [--force]       # write test/fixtures/golden (offline, CPU)
    python tools/make_golden.py --check         # replay here, print max |diff| per bag

Run after changing the policy, its weights or the fixtures, and commit the result.

What the goldens promise (docs/design.md, "Determinism"): on one machine every replay is bit
identical (twice, after a checkpoint/restore, on a branch, offline or through the node), and
the tests compare those exactly. Across machines the float32 kernels differ in their last bits
(torch dispatches per CPU instruction set, oneDNN and MKL pick their own code paths), so the
tests compare a new run with the goldens within GOLDEN_ATOL. Measured worst case over every CPU
setting tried and the H200 (CUDA, fused graph): 4.8e-7; a behaviour change (a weight off by 1e-3,
weights stored as float16, a one-step delay, another seed) moves commands by 2e-5 or more.
`--check` prints the numbers for this machine: run it where a golden comparison fails.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashrt_ros.replay.replay_cli import main as replay  # noqa: E402

FIXTURES = ROOT / "test" / "fixtures"
GOLDEN = FIXTURES / "golden"
BAGS = ("arm_sqlite3", "arm_mcap", "messy_sqlite3", "messy_mcap")
# Absolute tolerance of a golden comparison made on another machine (commands are radians,
# |x| < 1.5): 20x the largest difference measured across CPUs and the GPU, 1/2 of the smallest
# behaviour change tried. Within one machine nothing is tolerated.
GOLDEN_ATOL = 1e-5


def check(atol: float = GOLDEN_ATOL) -> int:
    """Replay every fixture offline here and compare with its golden: 0 when all are within
    `atol`, 1 otherwise; prints max |diff| and the number of differing values per bag."""
    import numpy as np

    from flashrt_ros.replay.bags import read_commands

    worst, rc = 0.0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in BAGS:
            out = Path(tmp) / name
            quiet = io.StringIO()
            with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
                rc_replay = replay([str(FIXTURES / name), str(out), "--offline"])
            if rc_replay:
                print(quiet.getvalue(), file=sys.stderr)
                return 2
            got = np.array([v for _, v in read_commands(out)])
            want = np.array([v for _, v in read_commands(GOLDEN / f"{name}_commands")])
            if got.shape != want.shape:
                print(f"{name}: {len(got)} commands, golden has {len(want)}")
                rc = 1
                continue
            d = np.abs(got - want)
            worst = max(worst, float(d.max()))
            ok = bool((d <= atol).all())
            rc |= not ok
            print(
                f"{name}: max |diff| {float(d.max()):.3g}, {int((d > 0).sum())} of {d.size} "
                f"values differ{'' if ok else f'  BEYOND atol {atol:g}'}"
            )
    print(f"worst {worst:.3g} (atol {atol:g}): {'ok' if rc == 0 else 'FAIL'}")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--force", action="store_true", help="replace existing golden bags")
    ap.add_argument(
        "--check", action="store_true", help="compare a replay made here with the goldens"
    )
    ap.add_argument("--atol", type=float, default=GOLDEN_ATOL, help="for --check")
    a = ap.parse_args()
    if a.check:
        return check(a.atol)
    GOLDEN.mkdir(exist_ok=True)
    for name in BAGS:
        out = GOLDEN / f"{name}_commands"
        if out.exists():
            if not a.force:
                print(f"{out} exists (use --force)", file=sys.stderr)
                return 2
            shutil.rmtree(out)
        rc = replay([str(FIXTURES / name), str(out), "--offline"])
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
