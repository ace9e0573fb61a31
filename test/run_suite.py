"""`make test`: the suite as two pytest runs at once, so a 2-core machine finishes it in time.

- The timed run: tests marked `exclusive` (their verdict rests on timing: a rate, a latency, a
  watchdog's period), one at a time, at normal priority.
- The shared run: every other test, on `--workers` pytest-xdist processes (a file per worker at
  a time), under SCHED_IDLE, which every process its tests start inherits. Linux runs an idle
  task only on a CPU nothing else wants, and preempts it at once when a normal task wakes, so
  the timed tests see a machine almost as quiet as when they ran alone, while the shared ones
  use the time they leave (most of it: their nodes wait on rates and replies).

Each run gets a band of ROS domains of its own (FLASHRT_TEST_DOMAINS, ros_helpers.py). The
shared run prints as it goes; the timed run's output follows it. The exit status is the first
failing run's (a run that selects no test, pytest's 5, is no failure).

    python test/run_suite.py [--workers N] [pytest arguments, test files among them ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: `test` importable as a package
    sys.path.insert(0, str(ROOT))
from test.ros_helpers import SHM_CLEAN, clean_stale_fastdds_shm  # noqa: E402

NO_TESTS = 5  # pytest's exit status when the selection is empty
SHARED_DOMAINS = "101-166"
TIMED_DOMAINS = "167-200"


def idle_priority() -> None:
    """In the child before exec: SCHED_IDLE for it and everything it starts."""
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="shared-run processes (2)")
    args, pytest_args = ap.parse_known_args(argv)
    if args.workers < 1:
        ap.error("--workers must be >= 1")
    base = [sys.executable, "-m", "pytest", "-q", *pytest_args]
    shared = [*base, "-n", str(args.workers), "--dist", "loadfile", "-m", "not exclusive"]
    timed = [*base, "-m", "exclusive", "-p", "no:cacheprovider"]
    # paths among the arguments choose the files; none: the whole suite
    paths = [a for a in pytest_args if not a.startswith("-") and (ROOT / a.split("::")[0]).exists()]
    where = [] if paths else ["test/"]
    # Fast DDS files of killed processes, cleared once here before either run starts a node
    # (conftest does it per pytest run otherwise): a run clearing them while the other's node
    # starts could take that node's files before it locked them. FLASHRT_TEST_SHM_CLEAN=0
    # skips it (a suite started inside a suite: test_run_suite.py)
    if os.environ.get(SHM_CLEAN, "1") != "0":
        clean_stale_fastdds_shm()
    env = dict(os.environ) | {SHM_CLEAN: "0"}
    # the timed run's compiles on one CPU: the other stays free for the shared run's nodes
    timed_env = env | {"FLASHRT_TEST_DOMAINS": TIMED_DOMAINS, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    t0 = time.monotonic()
    with tempfile.TemporaryFile(mode="w+") as timed_out:
        timed_proc = subprocess.Popen(
            [*timed, *where], cwd=ROOT, env=timed_env, stdout=timed_out, stderr=subprocess.STDOUT
        )
        shared_proc = subprocess.Popen(
            [*shared, *where],
            cwd=ROOT,
            env=env | {"FLASHRT_TEST_DOMAINS": SHARED_DOMAINS},
            preexec_fn=idle_priority,
        )
        try:
            shared_rc = shared_proc.wait()
            t_shared = time.monotonic() - t0
            timed_rc = timed_proc.wait()
        except KeyboardInterrupt:
            for p in (shared_proc, timed_proc):
                p.send_signal(signal.SIGINT)
            for p in (shared_proc, timed_proc):
                p.wait()
            return 130
        timed_out.seek(0)
        print("\n==== timed tests (marked exclusive, run beside the others) ====", flush=True)
        sys.stdout.write(timed_out.read())
    total = time.monotonic() - t0
    print(
        f"\nshared run: exit {shared_rc} after {t_shared:.0f} s; timed run: exit {timed_rc}; "
        f"{total:.0f} s in all",
        flush=True,
    )
    for rc in (shared_rc, timed_rc):
        if rc not in (0, NO_TESTS):
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
