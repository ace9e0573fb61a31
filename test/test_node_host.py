"""The services' own loop (flashrt_ros/node/host.py) and the cheap log lines (node/logs.py),
in-process over real rclpy and DDS (loopback): a plain rclpy node owns a ServiceHost whose loop
serves on its thread, called by the harness's client node.

No timings are asserted (the machine is noisy): bench/ros_bench.py shows the speed.
"""

from __future__ import annotations

import collections
import os
import threading
import time

import pytest

from test.conftest import require_rclpy


def _grows(items: list, n: int, timeout: float = 5.0) -> bool:
    """Whether `items` reaches `n` entries within `timeout` (polled: a loaded machine can
    starve a 200 Hz loop for a while; a loop that stopped never gets there)."""
    end = time.monotonic() + timeout
    while len(items) < n and time.monotonic() < end:
        time.sleep(0.01)
    return len(items) >= n


@pytest.fixture
def owner(ros):
    require_rclpy()
    import rclpy

    node = rclpy.create_node("flashrt", context=ros.context)
    yield node
    node.destroy_node()


def _call_async(ros, cli, request, timeout: float = 10.0):
    assert cli.wait_for_service(timeout_sec=timeout), cli.srv_name
    return cli.call_async(request)


def test_loop_serves_sync_async_and_failing_handlers_and_stops(ros, owner):
    from rclpy.task import Future

    from flashrt_ros.node.host import ServiceHost
    from flashrt_ros.srv import Checkpoint, ListCapsules, Rollout

    host = ServiceHost(owner)
    seen: list[str] = []
    release = threading.Event()
    failures = [RuntimeError("boom")]

    def list_capsules(req, resp):
        seen.append(threading.current_thread().name)
        resp.live_session = "served"
        return resp

    def checkpoint(req, resp):  # the first call raises: no reply, and the loop goes on
        if failures:
            raise failures.pop()
        resp.success, resp.message = True, f"named {req.name}"
        return resp

    wake = host.create_guard_condition(lambda: None)

    async def rollout(req, resp):  # completed by another thread, which wakes the loop
        done: Future = Future()

        def work():
            release.wait(10.0)
            done.set_result(req.n_steps * 2)
            wake.trigger()

        threading.Thread(target=work, daemon=True).start()
        resp.action_dim = await done
        resp.success = True
        return resp

    host.create_service(ListCapsules, "~/list_capsules", list_capsules)
    host.create_service(Checkpoint, "~/checkpoint", checkpoint)
    host.create_service(Rollout, "~/rollout", rollout)
    host.start()
    try:
        ls = ros.client(ListCapsules, "/flashrt/list_capsules")
        ck = ros.client(Checkpoint, "/flashrt/checkpoint")
        ro = ros.client(Rollout, "/flashrt/rollout")
        assert ros.call(ls, ListCapsules.Request()).live_session == "served"
        assert seen == ["flashrt-services"]  # on the host's own thread

        lost = _call_async(ros, ck, Checkpoint.Request(name="a"))
        ros.spin_until(lambda: not failures, 10.0)
        assert not failures  # the handler ran and raised
        ros.spin_for(0.3)
        assert not lost.done()  # no reply to a handler that raised
        r = ros.call(ck, Checkpoint.Request(name="b"))
        assert r.success and r.message == "named b"

        pending = _call_async(ros, ro, Rollout.Request(n_steps=21))
        ros.spin_for(0.3)
        assert not pending.done()
        # while the rollout awaits its future, other requests are answered
        assert ros.call(ls, ListCapsules.Request()).live_session == "served"
        release.set()
        assert ros.spin_until(pending.done, 10.0)
        assert pending.result().success and pending.result().action_dim == 42
    finally:
        release.set()
        thread = host._thread
        host.stop()
        assert thread is not None and not thread.is_alive()
        host.destroy()


def test_after_replies_runs_on_the_serving_thread_once_the_reply_is_sent(ros, owner):
    """What services.py writes its log lines with: after the reply (a client already has it),
    on the thread that served, with no thread of its own; and each service's take and reply
    are reported under its own name."""
    from flashrt_ros.node.host import ServiceHost
    from flashrt_ros.srv import ListCapsules

    host = ServiceHost(owner)
    events: list[tuple] = []

    def list_capsules(req, resp):
        events.append(("handler", threading.current_thread().name))
        resp.live_session = "served"
        return resp

    host.create_service(ListCapsules, "~/list_capsules", list_capsules)
    host.on_served = lambda name, queued, reply: events.append(
        ("reply" if reply is not None else "take", name)
    )
    host.after_replies = lambda: events.append(("after", threading.current_thread().name))
    host.start()
    try:
        ls = ros.client(ListCapsules, "/flashrt/list_capsules")
        assert ros.call(ls, ListCapsules.Request()).live_session == "served"
        assert ros.spin_until(lambda: ("after", "flashrt-services") in events, 5.0), events
        kinds = [e[0] for e in events]
        # a middleware without reception stamps reports no take; the order is the point
        assert kinds[kinds.index("handler") :] == ["handler", "reply", "after"], events
        assert ("reply", "list_capsules") in events
    finally:
        host.stop()
        host.destroy()


def _rosout(ros, got: list):
    """A subscription to /rosout appending each Log to `got` (latched, as rcl publishes it)."""
    from rcl_interfaces.msg import Log
    from rclpy.qos import QoSDurabilityPolicy, QoSProfile, QoSReliabilityPolicy

    qos = QoSProfile(
        depth=100,
        reliability=QoSReliabilityPolicy.RELIABLE,
        durability=QoSDurabilityPolicy.TRANSIENT_LOCAL,
    )
    return ros.node.create_subscription(Log, "/rosout", got.append, qos)


def test_fast_log_lines_reach_rosout_with_their_caller_and_level(ros, owner):
    from rcl_interfaces.msg import Log
    from rclpy.logging import LoggingSeverity

    from flashrt_ros.node.logs import FastLog

    got: list = []
    sub = _rosout(ros, got)
    try:
        pub_ready = ros.spin_until(lambda: sub.get_publisher_count() > 0, 10.0)
        assert pub_ready
        log = FastLog(owner.get_logger())
        line = _here() + 1
        log.info("fastlog one")
        log.warning("fastlog two")
        log.error("fastlog three")
        owner.get_logger().set_level(LoggingSeverity.WARN)
        log.info("fastlog dropped")  # below the logger's level: not written
        log.error("fastlog last")

        def mine():
            return [m for m in got if m.msg.startswith("fastlog")]

        assert ros.spin_until(lambda: any(m.msg == "fastlog last" for m in mine()), 10.0)
        msgs = mine()
        assert [m.msg for m in msgs] == [
            "fastlog one",
            "fastlog two",
            "fastlog three",
            "fastlog last",
        ]
        assert [m.level for m in msgs] == [Log.INFO, Log.WARN, Log.ERROR, Log.ERROR]
        first = msgs[0]
        assert first.name == owner.get_logger().name
        assert first.function == "test_fast_log_lines_reach_rosout_with_their_caller_and_level"
        assert first.file == __file__
        assert first.line == line
    finally:
        owner.get_logger().set_level(LoggingSeverity.INFO)
        ros.node.destroy_subscription(sub)


def test_log_lines_naming_a_file_that_is_not_utf8_still_reach_rosout(ros, owner, capfd):
    """A capsule file copied from a FAT stick has a name that is not UTF-8: Python keeps its
    bytes as surrogates, which rcutils' logger refused, so the core's "not loaded" warning
    became a "--- Logging error ---" traceback on stderr and never reached /rosout."""
    import logging

    from flashrt_ros.node.logs import FastLog, forward_core_logs

    got: list = []
    sub = _rosout(ros, got)
    undo = forward_core_logs(owner.get_logger())
    try:
        assert ros.spin_until(lambda: sub.get_publisher_count() > 0, 10.0)
        name = b"/caps/\xff\xfe.fcap".decode("utf-8", "surrogateescape")
        logging.getLogger("flashrt_ros.capsules.store").warning("capsule file %s not loaded", name)
        FastLog(owner.get_logger()).warning(f"refused: {name}")
        want = {
            "[capsules.store] capsule file /caps/\\udcff\\udcfe.fcap not loaded",
            "refused: /caps/\\udcff\\udcfe.fcap",
        }
        assert ros.spin_until(lambda: want <= {m.msg for m in got}, 10.0), [m.msg for m in got]
        assert "Logging error" not in capfd.readouterr().err
    finally:
        undo()
        ros.node.destroy_subscription(sub)


def _here() -> int:
    import sys

    return sys._getframe(1).f_lineno


def test_stop_ends_an_idle_loop_at_once(ros, owner):
    from flashrt_ros.node.host import ServiceHost
    from flashrt_ros.srv import ListCapsules

    host = ServiceHost(owner)
    host.create_service(ListCapsules, "~/list_capsules", lambda req, resp: resp)
    host.start()
    thread = host._thread
    time.sleep(0.2)  # waiting, nothing to serve
    t0 = time.monotonic()
    host.stop(timeout=5.0)  # the stop guard wakes it: no waiting for the loop's 1 s timeout
    took = time.monotonic() - t0
    assert thread is not None and not thread.is_alive()
    assert took < 0.5, f"stop() took {took:.2f} s: the loop waited for its timeout"
    host.destroy()


def _recording_host(owner):
    """A ServiceHost serving ~/list_capsules, and the names of the threads that answered it."""
    from flashrt_ros.node.host import ServiceHost
    from flashrt_ros.srv import ListCapsules

    host = ServiceHost(owner)
    by: list[str] = []

    def list_capsules(req, resp):
        by.append(threading.current_thread().name)
        return resp

    host.create_service(ListCapsules, "~/list_capsules", list_capsules)
    return host, by


def _lend_to_loop(host, rate_hz: float, tick, ticks: list):
    from flashrt_ros.node.loop import TimerLoop

    loop = TimerLoop(
        rate_hz,
        tick,
        on_timing=lambda *_: None,
        on_error=lambda e: ticks.append(("error", e)),
        serving=host.lent,
        wake=host.wake,
    )
    loop.start()
    t_end = time.monotonic() + 5.0
    while not host._lent and time.monotonic() < t_end:  # the loop's thread borrows at its start
        time.sleep(0.005)
    assert host._lent
    return loop


def test_a_running_timer_loop_serves_between_its_ticks_and_hands_back(ros, owner):
    """While the timer loop runs, its control thread answers the requests (the host's thread is
    stopped) and keeps ticking; an async handler parked then is finished by the host's thread
    once the loop stops and the serving is handed back."""
    from rclpy.task import Future

    from flashrt_ros.node.host import ServiceHost
    from flashrt_ros.srv import ListCapsules, Rollout

    host = ServiceHost(owner)
    served: list[str] = []
    ticks: list = []
    done: Future = Future()
    wake = host.create_guard_condition(lambda: None)

    def list_capsules(req, resp):
        served.append(threading.current_thread().name)
        return resp

    async def rollout(req, resp):
        resp.action_dim = await done
        resp.success = True
        return resp

    def tick(deadline: float) -> None:
        ticks.append(deadline)
        time.sleep(0.001)  # a tick with the GIL free: a request may come meanwhile

    host.create_service(ListCapsules, "~/list_capsules", list_capsules)
    host.create_service(Rollout, "~/rollout", rollout)
    host.start()
    loop = _lend_to_loop(host, 200.0, tick, ticks)
    try:
        ls = ros.client(ListCapsules, "/flashrt/list_capsules")
        ro = ros.client(Rollout, "/flashrt/rollout")
        for _ in range(20):
            ros.call(ls, ListCapsules.Request())
        assert host._thread is None and host._lent  # the host's own thread is stopped
        assert served == ["flashrt-control"] * 20  # by the loop's thread
        n = len(ticks)
        assert _grows(ticks, n + 10)  # the loop keeps ticking
        assert not [t for t in ticks if isinstance(t, tuple)]
        pending = _call_async(ros, ro, Rollout.Request(n_steps=3))
        ros.spin_for(0.3)
        assert not pending.done()  # parked on the control thread
    finally:
        loop.stop()
    assert host._thread is not None and host._thread.is_alive() and not host._lent
    done.set_result(7)
    wake.trigger()  # the host's own thread resumes the parked handler
    assert ros.spin_until(pending.done, 10.0)
    assert pending.result().success and pending.result().action_dim == 7
    ros.call(ls, ListCapsules.Request())
    assert served[-1] == "flashrt-services"
    host.destroy()


def test_ticks_that_leave_little_room_still_let_requests_through(ros, owner):
    """Ticks that take nearly their whole period (4.4 of 5 ms) leave ~400 us before the final
    spin: the requests are answered in those gaps, on the control thread, and the ticks go
    on."""
    from flashrt_ros.srv import ListCapsules

    host, by = _recording_host(owner)
    host.start()
    period = 1.0 / 200.0
    ticks: list = []

    def busy(deadline: float) -> None:  # leaves 400 us before the next deadline's spin
        ticks.append(deadline)
        end = deadline + period - 0.0006
        while time.monotonic() < end:
            pass

    loop = _lend_to_loop(host, 200.0, busy, ticks)
    try:
        ls = ros.client(ListCapsules, "/flashrt/list_capsules")
        for _ in range(5):
            ros.call(ls, ListCapsules.Request(), timeout=10.0)
        assert by == ["flashrt-control"] * 5 and host._lent
        n = len(ticks)
        assert _grows(ticks, n + 6)  # still ticking
    finally:
        loop.stop()
    host.destroy()


def test_serving_waits_for_start_and_a_second_borrower_gets_nothing(ros, owner):
    """Before start() (main.py starts the serving after the autostart transitions) a borrower
    only sleeps: no request is answered. One borrower at a time."""
    from flashrt_ros.srv import ListCapsules

    host, by = _recording_host(owner)
    ticks: list = []
    loop = _lend_to_loop(host, 200.0, lambda d: None, ticks)
    try:
        ls = ros.client(ListCapsules, "/flashrt/list_capsules")
        assert ls.wait_for_service(timeout_sec=10.0)
        early = ls.call_async(ListCapsules.Request())
        ros.spin_for(0.3)
        assert not early.done() and by == []
        with host.lent() as second:
            assert second is None
        host.start()  # the borrower serves now; the host's thread stays stopped
        assert ros.spin_until(early.done, 10.0)
        assert host._thread is None and by == ["flashrt-control"]
    finally:
        loop.stop()
    assert host._thread is not None  # wanted: handed back to the host's thread
    host.destroy()


@pytest.mark.exclusive
def test_the_inputs_loop_borrows_the_services_and_serves_between_its_messages(ros, owner):
    """In observation mode the inputs' loop answers the services in its own wait set while its
    thread runs, between two messages: a request is answered while a backlog of observations
    is still being stepped. Before start() it does not borrow them; after it ends the host's
    own thread serves again."""
    from std_msgs.msg import Float64MultiArray

    from flashrt_ros.node.inputs import InputLoop
    from flashrt_ros.node.polled import PolledGroup
    from flashrt_ros.srv import ListCapsules

    host, by = _recording_host(owner)
    got: list[tuple[str, float]] = []

    def step(msg, age: float = 0.0) -> None:  # an observation that takes 2 ms to step
        got.append((threading.current_thread().name, msg.data[0]))
        time.sleep(0.002)

    sub = owner.create_subscription(Float64MultiArray, "x", step, 200, callback_group=PolledGroup())
    pub = ros.node.create_publisher(Float64MultiArray, "/x", 200)
    ls = ros.client(ListCapsules, "/flashrt/list_capsules")
    assert ls.wait_for_service(timeout_sec=10.0)
    loops = []
    try:
        loops.append(InputLoop(owner.context, owner.get_logger(), [], sub, host))
        loops[-1].start()  # the host was not started: nothing to borrow, nothing served yet
        pending = ls.call_async(ListCapsules.Request())
        ros.spin_for(0.3)
        assert not pending.done() and by == []
        loops[-1].close()

        host.start()
        loops.append(InputLoop(owner.context, owner.get_logger(), [], sub, host))
        loops[-1].start()
        assert ros.spin_until(pending.done, 10.0)  # the early request, answered now
        t_end = time.monotonic() + 5.0
        while loops[-1]._served is None and time.monotonic() < t_end:
            time.sleep(0.005)
        assert loops[-1]._served is not None and host._thread is None
        by.clear()
        for k in range(100):  # a backlog of 0.2 s of steps
            pub.publish(Float64MultiArray(data=[float(k)]))
        assert ros.spin_until(lambda: len(got) > 0, 10.0)
        ros.call(ls, ListCapsules.Request())
        stepped = len(got)
        assert by == ["flashrt-inputs"] and stepped < 100, stepped  # between two steps
        assert ros.spin_until(lambda: len(got) >= 100, 10.0)
        assert [v for _, v in got] == [float(k) for k in range(100)]  # none lost, in order
        assert {t for t, _ in got} == {"flashrt-inputs"} and host.serving_thread == "flashrt-inputs"
    finally:
        for loop in loops:
            loop.close()
    try:
        assert host._thread is not None and host._thread.is_alive()  # handed back
        ros.call(ls, ListCapsules.Request())
        assert by[-1] == "flashrt-services"
    finally:
        host.destroy()
        owner.destroy_subscription(sub)
        ros.node.destroy_publisher(pub)


def _thread_cpu_s(tid: int) -> float:
    fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.exclusive
def test_a_wait_loop_polls_only_while_busy_and_stops_either_way(ros, owner):
    """WaitLoop.set_busy (the `busy_wait` parameter while the node is active): the loop's
    thread polls from the moment it is set (a wait in progress ends at once) and sleeps again
    when cleared; stop() ends it promptly in both states."""
    from flashrt_ros.node.inputs import InputLoop

    loop = InputLoop(ros.context, owner.get_logger(), drained=[])
    tid = loop.start().native_id

    def share(seconds: float = 0.5) -> float:
        c0, t0 = _thread_cpu_s(tid), time.monotonic()
        time.sleep(seconds)
        return (_thread_cpu_s(tid) - c0) / (time.monotonic() - t0)

    try:
        # asleep, the thread uses well under 1 % of a core; polling, as much as it is given:
        # on a 2-core machine loaded to 3.5 runnable threads that was under 40 % in 3 windows
        assert share() < 0.05  # asleep in a 1 s wait
        loop.set_busy(True)  # ends that wait: polling now, not in up to a second
        assert any(share() > 0.15 for _ in range(5))
        loop.set_busy(False)
        time.sleep(0.05)  # the look in progress ends
        assert share() < 0.05
        loop.set_busy(True)
        t0 = time.monotonic()
    finally:
        stopped = loop.stop(timeout=2.0)
    assert stopped and time.monotonic() - t0 < 1.0 and not loop.running
    loop.close()


def test_the_inputs_loop_acknowledges_a_round_of_images_once_before_its_step(ros, owner):
    """The cameras' acknowledgement (cameras.py Cameras.acknowledge) is called after the inputs'
    loop has taken every queued message of its drained inputs and before the stepping message:
    two images queued together are acknowledged once, and before the step that uses them."""
    from std_msgs.msg import Float64MultiArray

    from flashrt_ros.node.inputs import InputLoop
    from flashrt_ros.node.polled import PolledGroup

    seq: list[str] = []
    subs, pubs = [], []
    for name in ("top", "wrist", "joint_states"):
        cb = lambda msg, age=0.0, name=name: seq.append(name)  # noqa: E731
        subs.append(
            owner.create_subscription(Float64MultiArray, name, cb, 10, callback_group=PolledGroup())
        )
        pubs.append(ros.node.create_publisher(Float64MultiArray, f"/{name}", 10))

    def acknowledge() -> None:  # as Cameras.acknowledge: only when images came since the last
        if seq and seq[-1] in ("top", "wrist"):
            seq.append("ack")

    loop = InputLoop(owner.context, owner.get_logger(), subs[:2], subs[2], acknowledge=acknowledge)
    try:
        t_end = time.monotonic() + 10.0
        while any(p.get_subscription_count() == 0 for p in pubs) and time.monotonic() < t_end:
            time.sleep(0.01)
        for p in pubs:  # all three queued before the loop's first wait
            p.publish(Float64MultiArray(data=[1.0]))
        time.sleep(1.5)  # delivered on loopback (the loop's first wait must find all three)
        loop.start()
        assert _grows(seq, 4), seq
        assert seq[:4] == ["top", "wrist", "ack", "joint_states"], seq
    finally:
        loop.close()
        for s in subs:
            owner.destroy_subscription(s)
        for p in pubs:
            ros.node.destroy_publisher(p)


def test_a_start_after_a_stop_that_timed_out_never_runs_two_serving_threads(ros, owner):
    """stop() gives up on a handler that runs on; the next start() cleared the stop event
    both threads share, so the old thread, once its handler returned, served beside the new.
    start() now lets the old thread end first."""
    from flashrt_ros.node.host import ServiceHost
    from flashrt_ros.srv import ListCapsules

    host = ServiceHost(owner)
    release, by = threading.Event(), []

    def slow(req, resp):
        by.append(threading.current_thread().ident)
        release.wait(5.0)
        return resp

    host.create_service(ListCapsules, "~/list_capsules", slow)
    host.start()
    first = host._thread
    cli = ros.node.create_client(ListCapsules, "/flashrt/list_capsules")
    fut = _call_async(ros, cli, ListCapsules.Request())
    assert _grows(by, 1)  # the handler runs
    assert host.stop(timeout=0.1) is False and first.is_alive()
    threading.Timer(0.3, release.set).start()
    host.start()  # waits for the old thread to end, then starts one
    second = host._thread
    assert not first.is_alive() and second.is_alive()
    assert ros.spin_until(fut.done, 10)
    alive = [t for t in threading.enumerate() if t.name == first.name and t.is_alive()]
    assert alive == [second]
    host.stop(timeout=5.0)
    host.destroy()


def _checkpoint_host(owner, seconds: float = 0.0, ticks: list | None = None):
    """A ServiceHost serving ~/checkpoint (each call takes `seconds`), and what the calls
    carried, in the order they were served: the name, or (name, ticks so far) with `ticks`."""
    from flashrt_ros.node.host import ServiceHost
    from flashrt_ros.srv import Checkpoint

    host = ServiceHost(owner)
    served: list = []

    def checkpoint(req, resp):
        time.sleep(seconds)
        served.append(req.name if ticks is None else (req.name, len(ticks)))
        resp.success = True
        return resp

    host.create_service(Checkpoint, "~/checkpoint", checkpoint)
    return host, served


def test_a_queue_of_requests_is_left_for_the_next_wait_when_stop_says_so(ros, owner):
    """The thread that serves takes the queued requests one at a time and asks its `stop()`
    before each next one: what is left stays queued, and the service is ready again at the
    next wait (the control thread leaves a burst for the gaps of later ticks)."""
    from flashrt_ros.srv import Checkpoint, ListCapsules

    host, served = _checkpoint_host(owner)
    by: list[str] = []

    def list_capsules(req, resp):
        by.append(threading.current_thread().name)
        return resp

    host.create_service(ListCapsules, "~/list_capsules", list_capsules)
    host.start()
    cli = ros.client(Checkpoint, "/flashrt/checkpoint")
    ls = ros.client(ListCapsules, "/flashrt/list_capsules")
    ros.call(cli, Checkpoint.Request(name="warm"))  # discovered both ways before the burst
    assert ls.wait_for_service(timeout_sec=10.0)
    with host.lent() as serve:  # the host's thread stops: the test's thread serves
        futures = [cli.call_async(Checkpoint.Request(name=f"c{i}")) for i in range(3)]
        ros.spin_for(0.5)  # all three queued at the server
        serve(2.0, lambda: len(served) >= 2)
        assert served == ["warm", "c0"]
        serve(2.0, lambda: len(served) >= 3)
        assert served == ["warm", "c0", "c1"]
        serve(2.0)
        assert served == ["warm", "c0", "c1", "c2"]
        # requests of two services: the second service's wait too once stop() says so
        listed = ls.call_async(ListCapsules.Request())
        futures.append(cli.call_async(Checkpoint.Request(name="c3")))
        ros.spin_for(0.5)
        serve(2.0, lambda: len(served) + len(by) >= 5)
        assert len(served) + len(by) == 5 and not (listed.done() and futures[-1].done())
        serve(2.0)
        assert served[-1] == "c3" and len(by) == 1
    assert ros.spin_until(lambda: all(f.done() for f in futures) and listed.done(), 10.0)
    assert all(f.result().success for f in futures)
    host.destroy()


def test_a_planner_firing_many_requests_at_once_gets_every_answer(ros, owner):
    """Fifty checkpoints sent at once by one client, each taking 2 ms to serve: rclpy's default
    service queue (the last 10 requests) dropped the oldest of those not yet taken, and their
    clients waited forever (11 of 40 answered through the node); every one is answered, in
    the order sent."""
    from flashrt_ros.srv import Checkpoint

    host, served = _checkpoint_host(owner, seconds=0.002)
    host.start()
    try:
        cli = ros.client(Checkpoint, "/flashrt/checkpoint")
        ros.call(cli, Checkpoint.Request(name="warm"))
        futures = [cli.call_async(Checkpoint.Request(name=f"c{i}")) for i in range(50)]
        assert ros.spin_until(lambda: all(f.done() for f in futures), 20.0), (
            f"{sum(f.done() for f in futures)} of 50 answered"
        )
        assert served == ["warm"] + [f"c{i}" for i in range(50)]
    finally:
        host.stop()
        host.destroy()


def test_the_control_thread_serves_a_burst_over_several_tick_gaps(ros, owner):
    """Ten requests of 3 ms each, sent at once to a 200 Hz loop that serves between its
    ticks: no request starts once the tick's final spin is due, so at most two of them fit
    in one 5 ms gap (they used to be served all in a row, 30 ms without a tick)."""
    from flashrt_ros.srv import Checkpoint

    ticks: list = []
    host, served = _checkpoint_host(owner, seconds=0.003, ticks=ticks)
    host.start()
    cli = ros.client(Checkpoint, "/flashrt/checkpoint")
    ros.call(cli, Checkpoint.Request(name="warm"))
    loop = _lend_to_loop(host, 200.0, ticks.append, ticks)
    try:
        futures = [cli.call_async(Checkpoint.Request(name=f"c{i}")) for i in range(10)]
        assert ros.spin_until(lambda: all(f.done() for f in futures), 10.0)
    finally:
        loop.stop()
    host.destroy()
    assert not [t for t in ticks if isinstance(t, tuple)]
    gaps = collections.Counter(n for name, n in served[1:])  # requests served per tick gap
    assert sum(gaps.values()) == 10 and max(gaps.values()) <= 2, served


def test_destroy_answers_what_is_parked_or_queued_instead_of_leaving_clients_waiting(ros, owner):
    """At exit: a parked handler whose work came back replies as usual; one still waiting,
    and every request still queued, get success False and a message that says why; a
    service with no `success` field (list_capsules) cannot say it, and gets no reply."""
    from rclpy.task import Future

    from flashrt_ros.node.host import NOT_FINISHED, NOT_STARTED, ServiceHost
    from flashrt_ros.srv import Checkpoint, ListCapsules, Rollout

    host = ServiceHost(owner)
    futures: dict[int, Future] = {}
    checkpoints: list[str] = []

    async def rollout(req, resp):
        futures[req.n_steps] = done = Future()
        resp.action_dim = await done
        resp.success = True
        return resp

    def checkpoint(req, resp):
        checkpoints.append(req.name)
        resp.success = True
        return resp

    host.create_service(Rollout, "~/rollout", rollout)
    host.create_service(Checkpoint, "~/checkpoint", checkpoint)
    host.create_service(ListCapsules, "~/list_capsules", lambda req, resp: resp)
    host.start()
    ro = ros.client(Rollout, "/flashrt/rollout")
    ck = ros.client(Checkpoint, "/flashrt/checkpoint")
    ls = ros.client(ListCapsules, "/flashrt/list_capsules")
    assert ros.call(ck, Checkpoint.Request(name="warm")).success
    ros.call(ls, ListCapsules.Request())
    stuck = _call_async(ros, ro, Rollout.Request(n_steps=1))
    finished = _call_async(ros, ro, Rollout.Request(n_steps=2))
    assert ros.spin_until(lambda: len(futures) == 2, 10.0)  # both parked
    assert host.stop()
    futures[2].set_result(9)  # its work is done, nobody resumed it yet
    queued = ck.call_async(Checkpoint.Request(name="late"))
    listing = ls.call_async(ListCapsules.Request())
    ros.spin_for(0.5)  # both queued at the server, which serves no more
    host.destroy()
    assert ros.spin_until(lambda: stuck.done() and finished.done() and queued.done(), 10.0)
    assert finished.result().success and finished.result().action_dim == 9
    assert not stuck.result().success and stuck.result().message == NOT_FINISHED
    assert not queued.result().success and queued.result().message == NOT_STARTED
    assert checkpoints == ["warm"]  # the queued request never ran
    ros.spin_for(0.3)
    assert not listing.done()


def test_a_wake_up_seen_as_a_tick_is_due_still_resumes_the_parked_handler(ros, owner):
    """The control thread's wait woke for a parked handler's guard just as a tick was due: it
    left what was ready for the next wait, but a guard's trigger is spent by the wait that saw
    it, so the handler was never resumed and its client waited forever (the demo's one-step
    rollouts hung within a few dozen calls). The guard is triggered again."""
    from rclpy.task import Future

    from flashrt_ros.node.host import ServiceHost
    from flashrt_ros.srv import Rollout

    host = ServiceHost(owner)
    done: Future = Future()
    wake = host.create_guard_condition(lambda: None)

    async def rollout(req, resp):
        resp.action_dim = await done
        resp.success = True
        return resp

    host.create_service(Rollout, "~/rollout", rollout)
    host.start()
    ro = ros.client(Rollout, "/flashrt/rollout")
    with host.lent() as serve:
        pending = _call_async(ros, ro, Rollout.Request(n_steps=1))
        ros.spin_for(0.3)
        serve(1.0)  # takes the request: the handler parks
        assert len(host._parked) == 1
        done.set_result(5)
        wake.trigger()
        serve(1.0, lambda: True)  # the wake-up comes as a tick is due: nothing handled now
        assert len(host._parked) == 1
        for _ in range(3):  # the next gaps between ticks, each until its spin is due
            spin_at = time.monotonic() + 0.2
            serve(0.2, lambda spin_at=spin_at: time.monotonic() >= spin_at)
        assert not host._parked  # resumed in the first gap
    assert ros.spin_until(pending.done, 10.0)
    assert pending.result().success and pending.result().action_dim == 5
    host.destroy()


def _held_back_persists(owner, folder):
    """In-process capsule services over a CPU engine on `folder` whose persisted checkpoints'
    file writes wait for an event (`release`) after saying so (`writing`)."""
    from flashrt_ros.node.host import ServiceHost
    from flashrt_ros.node.params import NODE_PARAMS
    from flashrt_ros.node.services import CapsuleServices, Control
    from flashrt_ros.node.stats import LoopStats
    from test.engine_util import make_engine

    cfg = NODE_PARAMS.config({"capsule_dir": str(folder)})
    ctl = Control(LoopStats(), owner.get_logger(), lambda: cfg)
    eng = ctl.engine = make_engine(capsule_dir=folder)
    host = ServiceHost(owner)
    services = CapsuleServices(ctl, host, host.group)
    writing, release = threading.Event(), threading.Event()
    write = eng.write_persist

    def held_back(p) -> None:
        writing.set()
        assert release.wait(10.0)
        write(p)

    eng.write_persist = held_back
    host.start()
    return ctl, host, services, writing, release


def test_a_persisted_checkpoint_writes_its_file_without_the_engine_lock(ros, owner, tmp_path):
    """The file of a persisted checkpoint (two fsyncs: milliseconds, tens on an SD card) was
    written by the thread that serves, holding the engine lock: the control loop, which serves
    between its ticks, lost ticks for it. Now only the checks and a host copy take the lock; the
    file is written on a thread of its own while the engine steps and other requests are
    answered, and the reply comes once the file and the capsule are both there.
    (The write is held back here by an event, so the test needs no slow disk.)"""
    from flashrt_ros.srv import Checkpoint, ListCapsules
    from test.engine_util import make_engine, observations

    ctl, host, services, writing, release = _held_back_persists(owner, tmp_path)
    eng = ctl.engine
    try:
        ck = ros.client(Checkpoint, "/flashrt/checkpoint")
        ls = ros.client(ListCapsules, "/flashrt/list_capsules")
        obs = observations(3)
        eng.step(obs[0])
        saved = _call_async(ros, ck, Checkpoint.Request(name="kept", persist=True))
        assert writing.wait(10.0)
        with ctl.lock:  # free while the file is written: the loop steps meanwhile
            second = eng.step(obs[1])
        plain = ros.call(ck, Checkpoint.Request(name="plain"))  # other requests are served
        assert plain.success and plain.capsule.step == 2, plain.message
        taken = ros.call(ck, Checkpoint.Request(name="kept", persist=True))  # name reserved
        assert not taken.success and "being written" in taken.message, taken.message
        assert not saved.done() and not (tmp_path / "kept.fcap").exists()
        release.set()
        assert ros.spin_until(saved.done, 10.0)
        r = saved.result()
        assert r.success and r.capsule.step == 1 and r.capsule.name == "kept", r.message
        assert (tmp_path / "kept.fcap").is_file()
        names = {c.name: c.step for c in ros.call(ls, ListCapsules.Request()).capsules}
        assert names == {"kept": 1, "plain": 2}
        # the file holds the state of step 1, as the reply says, not the session's now
        fresh = make_engine(capsule_dir=tmp_path)
        assert fresh.restore("kept").step == 1
        assert fresh.step(obs[1]).tolist() == second.tolist()
    finally:
        release.set()
        host.stop()
        services.close()
        host.destroy()


def test_a_persist_whose_node_is_reconfigured_meanwhile_keeps_its_file(ros, owner, tmp_path):
    """A cleanup and configure while the file is written: the new engine may have reloaded
    the file already, so it stays (it was removed, under the new engine's capsule); the
    reply says so."""
    from flashrt_ros.srv import Checkpoint
    from test.engine_util import make_engine

    ctl, host, services, writing, release = _held_back_persists(owner, tmp_path)
    try:
        ck = ros.client(Checkpoint, "/flashrt/checkpoint")
        saved = _call_async(ros, ck, Checkpoint.Request(name="kept", persist=True))
        assert writing.wait(10.0)
        with ctl.lock:
            ctl.engine = make_engine(capsule_dir=tmp_path)  # what cleanup + configure do
        release.set()
        assert ros.spin_until(saved.done, 10.0)
        r = saved.result()
        assert not r.success and "cleaned up" in r.message and "stays" in r.message, r.message
        assert (tmp_path / "kept.fcap").is_file()
    finally:
        release.set()
        host.stop()
        services.close()
        host.destroy()
