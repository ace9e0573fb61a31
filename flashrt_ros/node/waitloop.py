"""A thread that waits on an rcl wait set built once, outside rclpy's executor.

rclpy's SingleThreadedExecutor rebuilds its wait set in Python over every entity of its nodes at
each wake-up, wraps each callback in a Task and wakes itself again after it, all under the GIL
that the control thread needs at each tick (host.py has the numbers). `WaitLoop` is the loop
both the services (host.ServiceHost) and the inputs (inputs.InputLoop) use instead: the
entities are fixed when the thread starts, their handles are held for as long as it waits (so
none is destroyed under the wait: rcl defers it), and a stop guard condition of its own wakes
it at once. A subclass says what to wait on (`_entities`) and what to do with what is ready
(`_on_ready`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from rclpy.guard_condition import GuardCondition
from rclpy.impl.implementation_singleton import rclpy_implementation as _rclpy

from flashrt_ros.node.loop import name_os_thread, precise_sleeps

WAKE_NS = 1_000_000_000  # with nothing ready the loop looks at the context once a second


class WaitLoop:
    """Start, stop and the wait itself; subclasses give the entities and the handling."""

    thread_name = "flashrt-wait"

    def __init__(self, context, log) -> None:
        self.context = context
        self.log = log
        # Poll instead of sleeping in the wait (the `busy_wait` parameter, for the thread that
        # steps while the node is active; loop.TimerLoop says why): set_busy().
        self.busy = False
        self._stop = threading.Event()
        # on no node: an executor never sees it (a node's guard conditions would wake it)
        self._stop_guard = GuardCondition(None, None, context=context)
        self._thread: threading.Thread | None = None

    def _entities(self) -> tuple[list, list, list]:
        """(subscriptions, guard conditions, services) to wait on; read once per start()."""
        return [], [], []

    def _on_ready(self, ws, stop: Callable[[], bool] | None = None) -> None:
        """Handle what the wait found ready (`ws.get_ready_entities(kind)`); `stop()`, when
        given, says to leave what is still queued for the next wait (its entity stays ready)."""

    def _on_skipped(self, ws) -> None:
        """The wait found `ws` ready, but `stop()` said not to handle it now. A subscription or
        a service stays ready until taken; a guard condition's trigger is spent by the wait that
        saw it, so a subclass whose guards mean work to do triggers them again here."""

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    START_WAIT_S = 10.0  # how long start() waits for a thread a timed-out stop() left behind

    def start(self) -> threading.Thread:
        """Run the loop on a thread of its own (`thread_name`) until stop(); returns it. A
        thread still in a handler after a stop() that timed out ends first: both share the stop
        event that start() clears, so the old one would otherwise serve on beside the new."""
        old = self._thread
        if old is not None and old.is_alive():
            old.join(timeout=self.START_WAIT_S)
            if old.is_alive():
                raise RuntimeError(
                    f"{self.thread_name} is still in a handler {self.START_WAIT_S:g} s after its "
                    "stop; not starting a second one beside it"
                )
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name=self.thread_name, daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float = 1.0) -> bool:
        """End the loop (the stop guard wakes it); False when it is still busy after `timeout`
        (a handler still runs): it ends after that handler, still holding what it waits on."""
        self._stop.set()
        with contextlib.suppress(Exception):  # already destroyed: the loop has ended anyway
            self._stop_guard.trigger()
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                self.log.warning(f"{self.thread_name} still busy after {timeout} s; it ends after")
                return False
            self._thread = None
        return True

    def close(self) -> None:
        """stop(), and free the stop guard (deferred by rcl while a busy loop still holds it)."""
        self.stop()
        self._stop_guard.destroy()

    def stopping(self) -> bool:
        return self._stop.is_set() or not self.context.ok()

    def run(self) -> None:
        """The loop; returns once stop() is called or the context is shut down."""
        name_os_thread()
        try:
            self._wait_loop()
        except Exception as e:  # the context went away under the wait: ending anyway
            if not self.stopping():
                self.log.error(f"{self.thread_name} stopped: {type(e).__name__}: {e}")

    def set_busy(self, busy: bool) -> None:
        """Poll (True) or sleep in the wait from now on; a wait in progress ends at once."""
        self.busy = busy
        self.wake()

    def wake(self) -> None:
        """End the current wait (of this loop's thread, or of one serving in its place) now."""
        with contextlib.suppress(Exception):  # destroyed: nobody waits any more
            self._stop_guard.trigger()

    def _wait_loop(self) -> None:
        # A wait of 0 (busy) still sleeps for the thread's timer slack in the middleware (50 us
        # by default: 91 us a look on Fast DDS, 63 % of it asleep) against 25 us awake with 1 ns
        # (2-core CPU machine, ad hoc, not committed).
        precise_sleeps()
        with self.waiting() as wait:
            while not self.stopping():
                ns = self._wait_ns()  # every look, busy too: a due watch is not put off
                wait(0 if self.busy else ns, self.stopping)

    def _wait_ns(self) -> int:
        """How long the next wait may sleep when nothing comes."""
        return WAKE_NS

    @contextlib.contextmanager
    def waiting(self) -> Iterator[Callable[..., None]]:
        """Hold the entities and a wait set over them; yields `wait(timeout_ns, stop=None)`,
        which waits once and handles what is ready (unless `stop()` says so by then). Used by
        this loop's own thread, or by another that serves in its place (host.ServiceHost.lent);
        the wait set is one thread's at a time."""
        subs, guards, services = self._entities()
        guards = [*guards, self._stop_guard]
        ctx = self.context
        ws = _rclpy.WaitSet(len(subs), len(guards), 0, 0, len(services), 0, ctx.handle)
        with contextlib.ExitStack() as held:  # nothing waited on is destroyed under the wait
            for entity in (*subs, *guards, *services):
                held.enter_context(entity.handle)
            held.enter_context(ctx.handle)

            def wait(timeout_ns: int, stop: Callable[[], bool] | None = None) -> None:
                ws.clear_entities()
                for sub in subs:
                    ws.add_subscription(sub.handle)
                for gc in guards:
                    ws.add_guard_condition(gc.handle)
                for srv in services:
                    ws.add_service(srv.handle)
                ws.wait(timeout_ns)  # the GIL is free meanwhile
                if stop is None or not stop():
                    self._on_ready(ws, stop)
                else:  # what is ready waits for the next wait (a tick is due, or the end)
                    self._on_skipped(ws)

            yield wait
