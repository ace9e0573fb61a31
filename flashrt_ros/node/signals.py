"""Ctrl-C and SIGTERM for flashrt_node: the robot is told to hold before anything shuts down.

rclpy's own signal handler shuts the context down first and only then calls the Python
handler, so nothing can be published any more when the node learns it must stop: with
`output: joint_trajectory` a joint_trajectory_controller then ran the last chunk to its end,
up to seconds of motion after Ctrl-C. main.py therefore starts rclpy without its handlers and
installs `Interrupts`: on the first SIGINT or SIGTERM it runs `before_exit` (the node's hold)
while the context is still up, then raises KeyboardInterrupt in the main thread, which ends
the executor's spin and runs main.py's clean-up as before.

Python runs a signal's handler in the main thread only between two bytecodes, and the main
thread spends its time inside the executor's wait (native code) for as long as nothing is
due. `SignalWake` is a thread on Python's wakeup fd: the interpreter writes a byte there from
the signal itself, and the thread wakes the executor, whose return to Python runs the
handler. A kill -9 can do none of this.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator


class Interrupts:
    """SIGINT or SIGTERM: `before_exit()`, then KeyboardInterrupt, once; after that (shutdown
    under way, e.g. `ros2 launch` forwarding a second Ctrl-C while destroy_node runs) a signal
    is ignored, so the node still ends cleanly."""

    def __init__(self) -> None:
        self.stopping = False
        self.signalled = False  # a signal came (stopping is also set by main.py's clean-up)
        self._defer = False  # inside deferred(): a signal is kept for the block's end
        self._pending = False
        # set by main.py once the node exists: the hold (FlashrtNode.hold_for_exit)
        self.before_exit: Callable[[], None] | None = None
        self.log: Callable[[str], None] | None = None  # where a failed hold is reported

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A signal during the block ends the process at the block's end, not inside it. The
        imports of torch run Python called back from C++ (pybind11): a KeyboardInterrupt raised
        there met C++ that does not expect it, and the process aborted (std::terminate, status
        -6) instead of ending cleanly (a fresh-clone run's SIGTERM 1 s into a start)."""
        self._defer = True
        try:
            yield
        finally:
            self._defer = False
        if self._pending:  # raised here, in plain Python
            self._pending = False
            raise KeyboardInterrupt

    def __call__(self, signum, frame) -> None:
        if self.stopping:
            return
        if self._defer:
            self.stopping = self.signalled = self._pending = True
            return
        self.stopping = self.signalled = True
        hold = self.before_exit
        if hold is not None:
            try:
                hold()
            except Exception as e:  # noqa: BLE001 - the exit goes on; say why nothing was held
                if self.log is not None:
                    self.log(f"could not hold at exit: {type(e).__name__}: {e}")
        raise KeyboardInterrupt


class SignalWake:
    """Wakes `wake()` (the executor's) from a thread of its own whenever a signal arrives, so
    the main thread leaves the executor's native wait and runs the Python handler at once."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self._r, self._w = socket.socketpair()
        self._r.settimeout(None)
        self._w.setblocking(False)
        self._old = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="flashrt-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                if not self._r.recv(64):
                    return
            except OSError:  # closed by close()
                return
            try:
                self._wake()
            except Exception:  # noqa: BLE001 - an executor already shut down: nothing to wake
                pass

    def close(self) -> None:
        """Back to the previous wakeup fd (main thread only, as set_wakeup_fd requires)."""
        signal.set_wakeup_fd(self._old)
        self._w.close()  # the reader sees end of file, the thread ends
        self._thread.join(timeout=1.0)
        self._r.close()
