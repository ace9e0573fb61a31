"""flashrt_node with one fault injected, as a bug or a device error would bring it: everything
else is the real node (flashrt_ros.node.main). Run as the node's executable by the tests.

FLASHRT_TEST_FAULT picks the fault: `activate` (the default: the first activation raises, as a
bug in a transition would; test_folder_lock.py) or `ring_copy` (every copy out of the flight
recorder's ring raises, as a device error or a host allocation failing would;
test_flight_node.py)."""

from __future__ import annotations

import os
import sys

import flashrt_ros.node.flashrt_node as node_module
from flashrt_ros.node.main import main
from flashrt_ros.runtime.session import Session

FAULT = os.environ.get("FLASHRT_TEST_FAULT", "activate")
_real = node_module.FlashrtNode._reset_due
_left = [1]


def _reset_due(self) -> None:
    if _left[0]:
        _left[0] -= 1
        raise RuntimeError("injected: the first activation fails")
    _real(self)


def _flight_state(self, step: int):
    raise RuntimeError("injected: the ring copy fails")


if FAULT == "activate":
    node_module.FlashrtNode._reset_due = _reset_due
elif FAULT == "ring_copy":
    Session.flight_state = _flight_state
else:
    raise SystemExit(f"fault_node: unknown FLASHRT_TEST_FAULT={FAULT!r}")

if __name__ == "__main__":
    sys.exit(main(sys.argv))
