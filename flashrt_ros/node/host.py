"""The services' node and the loop that serves it, on a thread of its own.

`ServiceHost` is the node the services are created on, beside the flashrt node (same context
and namespace), under the names they always had (`/<ns>/flashrt/<service>`). It has no
parameter services and no /rosout publisher: it only serves, and it is not spun by an rclpy
executor but by a loop over a wait set built once for its services and guard conditions
(waitloop.WaitLoop, which the inputs' loop shares): wait, take each request, call its handler,
send the reply. That loop runs on a thread of its own (`start()`), or on the control thread
while the timer loop runs (`lent()`, below).

Why not rclpy's SingleThreadedExecutor: it rebuilds its wait set in Python over every entity
at each wake-up, wraps each callback in a Task, and wakes itself twice more after each callback
(its own guard condition) to rebuild it again; all of it holds the GIL, which the control
thread needs at each tick. A bare ListCapsules service answered in ~290 us p50 with this loop
against ~405 us with the executor on the 2-core CPU machine (same client); wake-up to handler
~22 us against ~60 us. (On the flashrt node itself, with 22 services, 2 subscriptions, a timer
and 12 waitables, the executor's wake-up to a callback took 420 us p50 against 271 us for a bare
node: the services left it for a node of their own first, then for this loop.)

Handlers are called as rclpy would call them, `handler(request, Response())`, on this one
thread in arrival order. An `async def` handler runs until it awaits an unfinished
rclpy.task.Future; it is resumed whenever the loop wakes, and the thread that completes the
future wakes it through a guard condition of this host (services.py: rollouts; flight_services:
dumps), so other requests are served meanwhile. A handler that raises gets no reply (as with
rclpy's executor) and is logged; the loop goes on serving.

Lent to the thread that steps: while the timer loop runs, its control thread serves the
requests in the slack between two ticks (`lent()`; loop.TimerLoop); in observation mode the
inputs' thread serves them between two observations (`borrowed()`; inputs.InputLoop). This
host's thread stays stopped meanwhile.
Two Python threads that both wake up often hand the GIL to each other at every wake-up, and a
request waited for the control thread's Python (and the tick for the request's) each time.
With the thread that steps serving, the handlers' p50 went from 144 to 50-66 us (ros_bench,
af76542 vs 52a3f6c, b54a91b). A ListCapsules round trip with the timer loop at 500 Hz was the
idle node's in one run on the H200 machine (bench/service_contention.py, 8a65c67: 251 vs 257 us
p50) and about twice it in two later ones (6d2af72: 512 and 541 vs 255 and 395 us).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Iterator

import rclpy
from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.qos import QoSProfile, qos_profile_services_default

from flashrt_ros.node.loop import set_affinity, set_realtime
from flashrt_ros.node.waitloop import WaitLoop

# rclpy's default service QoS keeps the last 10 requests: an 11th that arrives before the loop
# takes the first ones replaces the oldest, whose client then waits forever (40 checkpoints
# fired at once by one planner got 11 answers on the 2-core CPU machine). Every request queued
# is kept up to this many, and each gets its answer.
REQUEST_DEPTH = 1000
SERVICE_QOS = QoSProfile(
    history=qos_profile_services_default.history,
    depth=REQUEST_DEPTH,
    reliability=qos_profile_services_default.reliability,
    durability=qos_profile_services_default.durability,
)

# the replies to requests the node cannot finish because it is shutting down: one still
# queued (never started), one parked (started, awaiting work that did not come back)
NOT_STARTED = "not done: the node is shutting down (the request was never started)"
NOT_FINISHED = "not finished: the node is shutting down"


class ServiceHost(WaitLoop):
    """Names are resolved by the flashrt node (`~/checkpoint` -> `/<ns>/flashrt/checkpoint`,
    its remappings applied), so clients see the same names as before."""

    thread_name = "flashrt-services"

    def __init__(self, owner) -> None:
        self.owner = owner
        self.node = rclpy.create_node(
            f"{owner.get_name()}_services",
            namespace=owner.get_namespace(),
            context=owner.context,
            start_parameter_services=False,
            enable_rosout=False,
            # the command line's `-r __node:=flashrt` would rename this node too (two nodes
            # called flashrt): the name and namespace are given here, names resolved by owner
            use_global_arguments=False,
        )
        super().__init__(owner.context, owner.get_logger())
        self.group = ReentrantCallbackGroup()
        self._services: list = []
        self._names: dict = {}  # service -> its short name (create_service)
        self._guards: list = []
        self._parked: list = []  # (coroutine, service, header) awaiting a future
        self._hand = threading.Lock()  # who serves: this host's thread, or a borrower's
        self._wanted = False  # start() was called: the thread serves when no one borrows
        self._lent = False
        self.serving_thread = ""  # the thread that served last (/diagnostics: services_thread)
        # on_served(service, queued_s, reply_s), one of the times None: at each take, how long
        # the request waited in the middleware (from its reception stamp; not called where the
        # middleware stamps none), and at each reply, how long it took to send. `service` is
        # the name it was created under, without "~/" ("checkpoint").
        self.on_served: Callable[[str, float | None, float | None], None] | None = None
        # after_replies(): called by the serving thread once the replies of a wake-up are
        # sent (services.py writes its log lines there: after the reply, and without waking
        # another thread that would take the GIL from this one)
        self.after_replies: Callable[[], None] | None = None

    def _not_serving(self, what: str) -> None:
        # the wait set is built once, when the loop starts (on its thread or a borrower's)
        if self._thread is not None or self._lent:
            raise RuntimeError(f"{what} created after the service loop started: never waited on")

    def create_service(self, srv_type, name: str, callback, callback_group=None):
        """`callback_group` is ignored: this host's loop serves every service in turn. The
        request queue holds REQUEST_DEPTH requests, not rclpy's default 10 (SERVICE_QOS)."""
        self._not_serving(f"service {name}")
        srv = self.node.create_service(
            srv_type,
            self.owner.resolve_service_name(name),
            callback,
            qos_profile=SERVICE_QOS,
            callback_group=self.group,
        )
        self._services.append(srv)
        # on_served's name: the one asked for ("~/checkpoint" -> "checkpoint"), as the
        # handlers' own timings are named, whatever a remapping made of the full name
        self._names[srv] = name.rsplit("/", 1)[-1]
        return srv

    def create_guard_condition(self, callback, callback_group=None):
        """A guard condition that wakes the loop (which then calls `callback` and resumes the
        handlers awaiting a future)."""
        self._not_serving("a guard condition")
        gc = self.node.create_guard_condition(callback, callback_group=self.group)
        self._guards.append(gc)
        return gc

    # -- who serves --------------------------------------------------------------------------------
    def start(self) -> None:
        """Serve on this host's thread, now or when the borrower gives the serving back."""
        with self._hand:
            self._wanted = True
            if not self._lent:
                super().start()

    def stop(self, timeout: float = 1.0) -> bool:
        with self._hand:
            self._wanted = False
            return super().stop(timeout)

    @contextlib.contextmanager
    def _taken_over(self, wanted_only: bool) -> Iterator[bool]:
        """Stop this host's thread for the duration (a handler it is in finishes first) and
        start it again after, if it is wanted and the context still lives; yields False (and
        changes nothing) when someone else borrows already, or, with `wanted_only`, when
        start() was not called yet."""
        with self._hand:
            if self._lent or (wanted_only and not self._wanted):
                thread, taken = None, False
            else:
                thread, taken, self._lent = self._thread, True, True
                self._stop.set()
        if not taken:
            yield False
            return
        try:
            self.wake()  # the thread's wait ends; a handler in progress finishes first
            while thread is not None and thread.is_alive():
                thread.join(timeout=1.0)
                if thread.is_alive():
                    self.log.warning(
                        "the service thread is still in a handler; the services move to "
                        f"{threading.current_thread().name} once it is done",
                        throttle_duration_sec=5.0,
                    )
            with self._hand:
                self._thread = None
            self._resume_parked()
            yield True
        finally:
            if taken:
                with self._hand:
                    self._lent = False
                    if self._wanted and self.context.ok():
                        super().start()
                        # started by a thread that may run under SCHED_FIFO
                        # (realtime_priority) and on pinned CPUs (cpu_affinity), which a
                        # new thread inherits: the services run normally scheduled
                        set_realtime(self._thread, 0)
                        set_affinity(self._thread, None)
                        self._resume_parked()

    @contextlib.contextmanager
    def lent(self) -> Iterator[Callable[..., None] | None]:
        """Serve from the calling thread for the duration (the timer loop's control thread):
        yields `serve(timeout_s, stop=None)`, which waits up to `timeout_s` for requests (a
        wake() ends it early) and handles what came, unless `stop()` says so by then (it only
        sleeps until start() is called). Yields None when someone else borrows already."""
        with self._taken_over(wanted_only=False) as taken:
            if not taken:
                yield None
                return
            with self.waiting() as wait:

                def serve(timeout_s: float, stop: Callable[[], bool] | None = None) -> None:
                    if not self._wanted:  # main.py starts the serving after the autostart
                        time.sleep(timeout_s)
                        return
                    wait(max(int(timeout_s * 1e9), 0), stop)

                yield serve

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[tuple[list, list] | None]:
        """This host's (guard conditions, services) for the calling thread's own wait set, for
        the duration (the inputs' loop in observation mode, whose thread steps); what the wait
        finds ready goes to `_on_ready`. None, and nothing changes, when someone else borrows
        already or start() was not called yet."""
        with self._taken_over(wanted_only=True) as taken:
            yield (list(self._guards), list(self._services)) if taken else None

    def _resume_parked(self) -> None:
        """A handler's future may have completed while the serving changed hands (the wait
        that saw its guard was the one told to stop): trigger a guard again, so the new
        server resumes it at once, not at its next wake-up."""
        if self._parked and self._guards:
            with contextlib.suppress(Exception):
                self._guards[0].trigger()

    # -- the loop --------------------------------------------------------------------------------
    def _entities(self) -> tuple[list, list, list]:
        return [], list(self._guards), list(self._services)

    def _on_ready(self, ws, stop: Callable[[], bool] | None = None) -> None:
        try:
            try:
                self._handle(ws, stop)
            finally:
                if self.after_replies is not None:
                    self.after_replies()
        except Exception as e:  # whoever serves (a borrower steps too) goes on
            self.log.error(f"serving failed: {type(e).__name__}: {e}", throttle_duration_sec=1.0)

    def _on_skipped(self, ws) -> None:
        """A guard seen ready but not handled (a tick was due) is triggered again: it may be
        the wake-up of a parked handler whose work is done, and nothing else would resume it
        (its client would wait for a reply the loop never sends)."""
        ready = ws.get_ready_entities("guard_condition")
        for gc in self._guards:
            if gc.handle.pointer in ready:
                with contextlib.suppress(Exception):  # destroyed: nobody waits any more
                    gc.trigger()

    def _handle(self, ws, stop: Callable[[], bool] | None) -> None:
        ready = ws.get_ready_entities("guard_condition")
        if ready:
            for gc in self._guards:
                if gc.handle.pointer in ready and gc.callback is not None:
                    try:
                        gc.callback()
                    except Exception as e:  # one bad wake-up never ends the serving
                        self.log.error(f"guard callback raised {type(e).__name__}: {e}")
        if self._parked:
            parked, self._parked = self._parked, []
            for coro, srv, header in parked:
                self._run(coro, srv, header)
        ready = ws.get_ready_entities("service")
        if ready:
            served = False
            for srv in self._services:
                if srv.handle.pointer in ready:
                    if served and stop is not None and stop():
                        return  # the other services' requests wait for the next wait too
                    self._serve_one(srv, stop)
                    served = True

    def _serve_one(self, srv, stop: Callable[[], bool] | None = None) -> None:
        """The requests queued for `srv`, each answered (or parked) in turn, until `stop()`
        says otherwise (a tick is due, the loop is stopping): what is left stays queued, and
        the service is ready again at the next wait, whoever serves it then."""
        first = True
        while first or stop is None or not stop():
            first = False
            try:
                request, header = srv.handle.service_take_request(srv.srv_type.Request)
            except Exception as e:  # a request that does not deserialize: drop it, serve on
                self.log.error(f"{srv.srv_name}: request not taken: {type(e).__name__}: {e}")
                return
            if header is None:
                return
            self.serving_thread = threading.current_thread().name
            received = getattr(header, "received_timestamp", 0)  # 0: not stamped
            if received > 0 and self.on_served is not None:
                self.on_served(self._names[srv], (time.time_ns() - received) * 1e-9, None)
            try:
                result = srv.callback(request, srv.srv_type.Response())
            except Exception as e:
                self._failed(srv, e)
                continue
            if inspect.iscoroutine(result):
                self._run(result, srv, header)
            else:
                self._reply(srv, result, header)

    def _run(self, coro, srv, header) -> None:
        """Resume an `async def` handler: reply when it returns, park it while it awaits."""
        try:
            coro.send(None)
        except StopIteration as done:
            self._reply(srv, done.value, header)
        except Exception as e:
            self._failed(srv, e)
        else:
            self._parked.append((coro, srv, header))

    def _reply(self, srv, response, header) -> None:
        t0 = time.perf_counter()
        try:
            srv.send_response(response, header)
        except Exception as e:  # a handler's wrong type, a client gone: the loop goes on
            self.log.error(f"{srv.srv_name}: reply not sent: {type(e).__name__}: {e}")
            return
        if self.on_served is not None:
            self.on_served(self._names[srv], None, time.perf_counter() - t0)

    def _failed(self, srv, e: Exception) -> None:
        self.log.error(f"{srv.srv_name}: handler raised {type(e).__name__}: {e}; no reply")

    def destroy(self) -> None:
        self.close()
        with self._hand:  # no loop and no borrower: the parked and queued requests are ours
            mine = self._thread is None and not self._lent
        if mine:
            self._answer_leftovers()
        self.node.destroy_node()  # deferred by rcl while the loop still holds the handles

    def _answer_leftovers(self) -> None:
        """At exit, no client is left waiting for a server that goes away: a parked handler
        whose work is done replies as usual; the others, and every request still queued, get
        `success: False` and NOT_FINISHED or NOT_STARTED (a request never taken changed nothing). A
        service without a `success` field (list_capsules) has no way to say so: its clients
        see the server go."""
        parked, self._parked = self._parked, []
        for coro, srv, header in parked:
            self._run(coro, srv, header)  # done meanwhile: its own reply; else parked again
        parked, self._parked = self._parked, []
        for coro, srv, header in parked:
            with contextlib.suppress(Exception):
                coro.close()
            self._refuse(srv, header, NOT_FINISHED)
        for srv in self._services:
            while True:
                try:
                    _, header = srv.handle.service_take_request(srv.srv_type.Request)
                except Exception:  # noqa: BLE001 (one that does not deserialize: the rest wait)
                    break
                if header is None:
                    break
                self._refuse(srv, header, NOT_STARTED)

    def _refuse(self, srv, header, message: str) -> None:
        resp = srv.srv_type.Response()
        if hasattr(resp, "success") and hasattr(resp, "message"):
            resp.success, resp.message = False, message
            self._reply(srv, resp, header)
