"""flashrt_node whose first activation raises, as a bug in a transition would: everything else
is the real node (flashrt_ros.node.main). Run as the node's executable by test_folder_lock.py."""

from __future__ import annotations

import sys

import flashrt_ros.node.flashrt_node as node_module
from flashrt_ros.node.main import main

_real = node_module.FlashrtNode._reset_due
_left = [1]


def _reset_due(self) -> None:
    if _left[0]:
        _left[0] -= 1
        raise RuntimeError("injected: the first activation fails")
    _real(self)


node_module.FlashrtNode._reset_due = _reset_due

if __name__ == "__main__":
    sys.exit(main(sys.argv))
