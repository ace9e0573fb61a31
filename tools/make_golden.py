"""Regenerate the golden command bags: the shipped policy's commands for each fixture bag.

    python tools/make_golden.py [--force]

Run after changing the policy, its weights or the fixtures, and commit the result: the replay
tests compare new runs against these bags bit for bit.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flashrt_ros.replay.replay_cli import main as replay  # noqa: E402

FIXTURES = ROOT / "test" / "fixtures"
GOLDEN = FIXTURES / "golden"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--force", action="store_true", help="replace existing golden bags")
    a = ap.parse_args()
    GOLDEN.mkdir(exist_ok=True)
    for name in ("arm_sqlite3", "arm_mcap", "messy_sqlite3", "messy_mcap"):
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
