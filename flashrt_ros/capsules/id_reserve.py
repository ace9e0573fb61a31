"""Capsule ids that stay unique across restarts of a capsule_dir's owner.

A planner keeps the ids the node gave it, and may outlive the node. Each new pool counted from
c0001, skipping only ids live or with a file, so after a restart (a kill -9 included) a
remembered id could name another capsule, and a restore by it succeeded with another state. So
the ids of one run come from a block reserved in `capsule_dir/.flashrt.ids` before the first is
issued: the file holds the first id no run has reserved yet. One small write at the start and
one per BLOCK ids; no fsync (a kill -9 keeps what was written; a power loss may lose the file,
and ids then start after the highest file, as before). A folder that cannot be written keeps
ids unique within the run only, with a warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("flashrt_ros.capsules")

FILE = ".flashrt.ids"
BLOCK = 1000  # ids reserved at a time


class IdReserve:
    """Reserves blocks of capsule id numbers in `folder` (Pool.reserve calls `extend`)."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / FILE
        self.ok = True  # False once a write failed: ids are then unique within the run only

    def read(self) -> int:
        """The first id number no earlier run reserved (1 without a reserve)."""
        return self._read()

    def start(self, at_least: int) -> int:
        """The first id number of this run: after every block an earlier run reserved, and at
        least `at_least` (the ids of the files just reloaded). Reserves BLOCK from it."""
        first = max(at_least, self._read())
        self._write(first + BLOCK)
        return first

    def extend(self, n: int) -> int:
        """The counter reached `n`: reserve up to n + BLOCK; returns that limit. Never lowers
        what the file holds (another engine of the Python API may share the folder)."""
        self._write(max(n + BLOCK, self._read()))
        return n + BLOCK

    def _read(self) -> int:
        try:
            text = self.path.read_text()[:40].strip()
        except FileNotFoundError:
            return 1
        except OSError as e:
            log.warning("capsule id reserve %s unreadable (%s): ignored", self.path, e)
            return 1
        if not (text.isascii() and text.isdigit()):
            log.warning("capsule id reserve %s holds %r, not a number: ignored", self.path, text)
            return 1
        return int(text)

    def _write(self, upto: int) -> None:
        if not self.ok:
            return
        tmp = self.path.with_name(f"{FILE}.{os.getpid()}.tmp")
        try:
            tmp.write_text(f"{upto}\n")
            os.replace(tmp, self.path)
        except OSError as e:
            self.ok = False
            log.warning(
                "capsule ids cannot be reserved in %s (%s): they are unique within this run "
                "only, and a restart may issue an id again",
                self.path.parent,
                e.strerror or e,
            )
            try:
                tmp.unlink()
            except OSError:
                pass
