"""Large blocks stay in the heap: no fresh pages for every camera image.

Taking a 921,600-byte image from rclpy (raw or as a message) allocates buffers of its size
and frees them again, several per message. With glibc's defaults the freed top of the heap is
given back to the kernel each time (brk, about four calls per message) and the next message
faults its pages in afresh, zeroed: on the 2-core CPU machine the take of one 640x480 rgb8
image took 1.98-2.07 ms this way and 0.30-0.36 ms with the thresholds below (bench/take_probe.py;
the page faults are what test/test_memory.py counts; bench/results/latest.md, 2026-12-02 third
part, has the GPU machine's runs). Keeping large freed blocks is the usual memory setting of
a real-time process. The price: each malloc arena (the main heap, and one per thread that
allocates, up to 8 per core) may keep up to TRIM_THRESHOLD of freed memory at its top. At 128
MiB, a soak of mixed service traffic (checkpoints, branches, rollouts, flight dumps; 100 Hz on
the 2-core CPU machine) grew the node's RSS 35 MB a minute for 6 minutes without levelling off
(337 to 548 MB); in the same soak with glibc's defaults it went from 340 to 440 MB, and at 32
MiB from 370 to 448 MB, 3.7 MB a minute over its last three minutes. Longer soaks at 32 MiB
level off (bench/memory_soak.py: 320 MB after 8 minutes of mixed traffic, 0.12 MB a minute in
its last third; flight dumps of a 300-tick ring fill the arenas to ~623 MB, then flat). 32 MiB
still holds a take's buffers of a 640x480 or a 1080p frame (0.9 or 6.2 MB each, a few per
message).

`FLASHRT_MALLOC=default` leaves the C library's settings alone.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # blocks up to 32 MiB (a 4K rgb8 frame is 24.9 MB) from the heap
TRIM_THRESHOLD = 32 << 20  # an arena's free top is given back only beyond 32 MiB (a soak, below)
ENV = "FLASHRT_MALLOC"


def tune_malloc(environ: Mapping[str, str] | None = None) -> str:
    """Set the thresholds (glibc only); returns what was done, for the start-up log.

    Both or neither: setting either one ends glibc's own adjustment of the mmap threshold, so
    the trim threshold alone would leave 921 KB blocks mapped and unmapped for good."""
    env = os.environ if environ is None else environ
    if env.get(ENV, "") == "default":
        return f"malloc: the C library's defaults ({ENV}=default)"
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
    except (AttributeError, OSError, TypeError):  # not glibc; TypeError: CDLL(None) on Windows
        return "malloc: not glibc, its defaults kept"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # glibc refuses a threshold above its maximum (32 MiB on 64-bit, 512 KiB on 32-bit)
    mmap = min(MMAP_THRESHOLD, 4 * 1024 * 1024 * ctypes.sizeof(ctypes.c_long))
    if mallopt(M_MMAP_THRESHOLD, mmap) != 1:
        return f"malloc: glibc {version} refused an mmap threshold of {mmap} B, defaults kept"
    if mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return f"malloc: glibc {version} refused the trim threshold (mmap threshold {mmap} B set)"
    return (
        f"malloc: blocks up to {mmap >> 20} MiB from the heap, and each arena keeps up to "
        f"{TRIM_THRESHOLD >> 20} MiB freed (glibc {version}; {ENV}=default turns this off)"
    )
