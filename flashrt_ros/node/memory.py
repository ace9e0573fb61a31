"""Large blocks stay in the heap: no fresh pages for every camera image.

Taking a 921,600-byte image from rclpy (raw or as a message) allocates buffers of its size
and frees them again, several per message. With glibc's defaults the freed top of the heap is
given back to the kernel each time (brk, about four calls per message) and the next message
faults its pages in afresh, zeroed: on the 2-core CPU machine the take of one 640x480 rgb8
image took 1.6 ms this way and 0.27 ms with the thresholds below (an ad hoc probe, not
committed; bench/README.md has the committed figures). Keeping large freed blocks is the usual
memory setting of a real-time ROS process; the price is that up to TRIM_THRESHOLD of freed
memory stays with the process.

`FLASHRT_MALLOC=default` leaves the C library's settings alone.
"""

from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # blocks up to 32 MiB (a 4K rgb8 frame is 24.9 MB) from the heap
TRIM_THRESHOLD = 128 << 20  # the heap's free top is given back only beyond 128 MiB
ENV = "FLASHRT_MALLOC"


def tune_malloc(environ: dict | None = None) -> str:
    """Set the thresholds (glibc only); returns what was done, for the start-up log."""
    env = os.environ if environ is None else environ
    if env.get(ENV, "") == "default":
        return f"malloc: the C library's defaults ({ENV}=default)"
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
    except (AttributeError, OSError):
        return "malloc: not glibc, its defaults kept"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and ok
    if not ok:
        return f"malloc: glibc {version} refused the thresholds, its defaults kept"
    return (
        f"malloc: blocks up to {MMAP_THRESHOLD >> 20} MiB from the heap, which keeps up to "
        f"{TRIM_THRESHOLD >> 20} MiB freed (glibc {version}; {ENV}=default turns this off)"
    )
