"""The capsule services, and `Control`: the part of the node they may touch.

Each request takes the engine lock, so it lands between two steps. A bad request (BadRequest,
a ValueError) or a reached bound (CapacityError) answers success=false with a message that says
what to do, and changes nothing. Anything else (a non-finite action, a CUDA error, out of
memory) is a fault: success=false too, and it is counted, logged at ERROR and shown in
/diagnostics. A rollout runs its steps on a worker thread that yields to the control loop
(loop.EngineLock.background) while the service loop awaits it, free for other requests.

The services live on a node of their own (host.ServiceHost), served by a loop of their own on
a thread of their own (host.py says why not rclpy's executor), under the names they always had
(`/<ns>/flashrt/<service>`): a request never queues behind joint_states, goals or the
diagnostics timer.
"""

from __future__ import annotations

import array
import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
from rclpy.task import Future

from flashrt_ros.errors import (
    BadName,
    BadRequest,
    CapacityError,
    DiskError,
    UnknownReference,
    shown,
)
from flashrt_ros.node.convert import capsule_msg, evictions
from flashrt_ros.node.logs import FastLog
from flashrt_ros.node.loop import EngineLock, name_os_thread
from flashrt_ros.node.stats import LoopStats
from flashrt_ros.srv import (
    Branch,
    Checkpoint,
    DropCapsule,
    DropSession,
    ListCapsules,
    ResetSession,
    Restore,
    Rollout,
)

FIRST_STEP_COST_S = 0.002  # a rollout step's cost before one is measured (CPU: ~1.5 ms)


def step_cost(measured: Sequence[float], prior: float = FIRST_STEP_COST_S) -> float:
    """What the next rollout step is expected to take: the median of `prior` (the live
    session's step time, the same engine's step), counted twice, and the last 15 steps' times.

    The first steps of a rollout are often slow (cold caches; a scratch session captured on
    first use), and the OS preempts one now and then. When the first measured step set the
    price (the median of a 2 ms seed and it), one slow step (17.6 ms) asked for a gap no 5 ms
    period has: the rollout waited 10 s and failed (9 of 1326 rollouts at 200 Hz on a loaded
    2-core machine). With the prior counted twice, one or two outliers move nothing, a policy
    slower than the period is priced so from the first step (its live steps are that slow
    too), and from the third step on the measured times decide."""
    return float(np.median([prior, prior, *list(measured)[-15:]]))


class Control:
    """What the services (and diagnostics) work with: the engine lock, the engine, the live
    session's name, the loop's stats, the config and the fault path; never the node itself."""

    def __init__(self, stats: LoopStats, logger, config: Callable[[], object]):
        self.lock = EngineLock()
        self.engine = None  # the Engine while configured
        self.live = "main"  # the session whose actions reach the robot
        self.finalized = False  # a lifecycle shutdown: no engine, and none ever again
        self.stats = stats
        self.log = logger  # rclpy's: for throttled lines
        self.fast_log = FastLog(logger)  # the same lines without rclpy's caller lookup (logs.py)
        self._config = config
        # Lines about served requests, held until the replies of the wake-up are sent and then
        # written by the serving thread itself (say(); host.after_replies = write_said): a
        # line also publishes on /rosout and must not add to round trips. A logging thread of
        # their own cost more: woken per request, it took the GIL when the serving thread next
        # waited, and the next request (or tick) waited for it (restore - list round trips
        # ~170 us against ~100 us without the line: 2-core CPU machine, 100 Hz timer, ad hoc,
        # not committed).
        self._said: collections.deque[tuple[bool, str]] = collections.deque()
        # told (engine lock held) when a request put a session's state elsewhere than its last
        # tick left it: the flight recorder forgets the stamps of steps past it, and a live
        # session's goal is echoed again (the node sets it)
        self.on_moved: Callable[[object, str], None] = lambda eng, session: None
        # told (engine lock held) when a session was dropped: what is kept per session goes
        self.on_dropped: Callable[[object, str], None] = lambda eng, session: None
        # writes to capsule_dir (persisted checkpoints, flight dumps) that failed, the last
        # one's error, and whether the latest write failed: a full or read-only disk only
        # answered its requester and logged, while /diagnostics said OK (an operator's review)
        self.disk_failures = 0
        self.disk_error = ""
        self.disk_failing = False
        self._disk_lock = threading.Lock()  # two writer threads: persists and flight dumps

    def wrote(self, error: str = "") -> None:
        """A write to capsule_dir ended: fine (""), or failed saying `error` (a DiskError)."""
        with self._disk_lock:
            if error:
                self.disk_failures += 1
                self.disk_error, self.disk_failing = error, True
            else:
                self.disk_failing = False

    def new_folder(self) -> None:
        """capsule_dir was (re)configured: an earlier folder's failing writes are not its own."""
        with self._disk_lock:
            self.disk_error, self.disk_failing = "", False

    def say(self, text: str, warn: bool = False) -> None:
        """A line about a request, written after the reply (write_said). For handlers, which
        the serving thread runs: a line said elsewhere waits for the next served wake-up."""
        self._said.append((warn, text))

    def write_said(self) -> None:
        """Write the held lines: the serving thread after its replies, and close() (which may
        overlap a handler still finishing at shutdown: each line is written once)."""
        said, log = self._said, self.fast_log
        while True:
            try:
                warn, text = said.popleft()
            except IndexError:
                return
            if warn:
                log.warning(text)
            else:
                log.info(text)

    @property
    def cfg(self):
        """The node's current NodeConfig (replaced, not mutated, on a parameter change)."""
        return self._config()

    def configured(self):
        """The Engine, or BadRequest when the node is not configured."""
        eng = self.engine
        if eng is None:
            if self.finalized:
                raise BadRequest(
                    "node is finalized (lifecycle shutdown): restart the process to serve again"
                )
            raise BadRequest("node is not configured: configure it (lifecycle) first")
        return eng

    def user_session(self, eng, name: str) -> str:
        """An existing user session ("" = the live one)."""
        s = name or self.live
        if s.startswith("_"):
            raise BadName(f"session {shown(s)} is reserved (internal)")
        eng.session(s)  # UnknownReference naming the sessions there are
        return s

    def timed(self, t0: float, service: str = "") -> None:
        """Record a served request's time (`service_p*_us` in /diagnostics, and
        `service_<name>_p50_us` per service)."""
        st = self.stats
        us = (time.perf_counter() - t0) * 1e6
        with st.lock:
            st.service_us.add(us)
            if service:
                st.service_ring(service).add(us)

    def fault(self, where: str, e: BaseException | None = None, step_error: bool = False) -> str:
        """Count and log a fault; returns its text. Not a bad request: the operator must look."""
        text = where if e is None else f"{where}: {type(e).__name__}: {e}"
        self.stats.add_fault(text, step_error)
        if step_error:  # from the control loop: at most one line per 2 s
            self.log.error(f"fault: {text}", throttle_duration_sec=2.0)
        else:
            self.fast_log.error(f"fault: {text}")
        return text


class _Locked:
    """CapsuleServices._locked, as a class: the generator context manager it replaced cost
    each request ~1-3 us more (every handler takes it once)."""

    __slots__ = ("_ctl", "_waited")

    def __init__(self, ctl: Control):
        self._ctl = ctl

    def __enter__(self) -> None:
        t0 = time.perf_counter()
        self._ctl.lock.__enter__()
        self._waited = time.perf_counter() - t0

    def __exit__(self, kind, *rest) -> None:
        self._ctl.lock.__exit__(kind, *rest)
        if kind is None:  # as before: a request refused inside is not counted
            st = self._ctl.stats
            with st.lock:
                st.lock_wait_us.add(self._waited * 1e6)


class CapsuleServices:
    def __init__(self, ctl: Control, node, group):
        """`node` is only used here, to create the services; the handlers see `ctl`."""
        self.ctl = ctl
        # Rollouts run one at a time on their own thread; the guard wakes the service loop when
        # one is done, so it resumes the awaiting service callback.
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # set by close(): a rollout in progress stops at its next step, so the process never
        # ends with this thread inside torch (a daemon thread still running native code at
        # interpreter exit aborted the node: "terminate called without an active exception")
        self._closing = threading.Event()
        self._stopped = ""  # what close() stopped, for its log line
        self._worker = threading.Thread(
            target=self._work_forever, name="flashrt-rollout", daemon=True
        )
        self._worker.start()
        # Files of persisted checkpoints are written on a thread of their own, without the
        # engine lock (Engine.begin_persist / write_persist / end_persist): their fsyncs wait
        # for the storage, which the control loop must not wait for.
        self._disk_jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._disk = threading.Thread(target=self._write_forever, name="flashrt-disk", daemon=True)
        self._disk.start()
        self._wake = node.create_guard_condition(lambda: None, callback_group=group)
        node.create_service(Checkpoint, "~/checkpoint", self.checkpoint, callback_group=group)
        for srv, name, fn in (
            (Restore, "~/restore", self.restore),
            (Branch, "~/branch", self.branch),
            (ListCapsules, "~/list_capsules", self.list_capsules),
            (DropCapsule, "~/drop_capsule", self.drop_capsule),
            (DropSession, "~/drop_session", self.drop_session),
            (ResetSession, "~/reset_session", self.reset_session),
        ):
            node.create_service(srv, name, self._guarded(fn), callback_group=group)
        node.create_service(Rollout, "~/rollout", self.rollout, callback_group=group)

    def _answer(self, what: str, resp, e: Exception):
        """success=false for what went wrong: a bad request/bound, or a fault."""
        if isinstance(e, ValueError | CapacityError):  # BadRequest is a ValueError
            message = f"{what} failed: {e}"
            self.ctl.say(message, warn=True)
        else:
            message = f"{what} failed: fault ({self.ctl.fault(f'{what} request', e)})"
        if hasattr(resp, "success"):  # list_capsules has no status fields: an empty reply
            resp.success, resp.message = False, message
        return resp

    def _guarded(self, fn):
        """Every exception becomes a success=false reply, never a request left unanswered."""

        def handler(req, resp):
            t0 = time.perf_counter()
            try:
                return fn(req, resp)
            except Exception as e:
                return self._answer(fn.__name__, resp, e)
            finally:
                self.ctl.timed(t0, fn.__name__)

        return handler

    def _locked(self) -> _Locked:
        """The engine lock, with the time waited for it recorded (`service_lock_wait_p*_us` in
        /diagnostics): what a request lost to control ticks and other requests."""
        return _Locked(self.ctl)

    def close(self, timeout: float = 5.0) -> None:
        """End the rollout thread (a rollout in progress stops at its next step, and so do the
        queued ones: their replies go out at exit, host.ServiceHost.destroy, and the log says
        where it stopped) and write what is held."""
        self._closing.set()
        self._jobs.put(None)
        self._disk_jobs.put(None)
        self._disk.join(timeout=timeout)  # a file being written is finished first
        self._worker.join(timeout=timeout)
        if self._worker.is_alive():
            self.ctl.log.warning(f"the rollout thread is still in a step after {timeout:g} s")
        elif self._stopped:
            self.ctl.log.warning(self._stopped)
        self.ctl.write_said()

    # -- handlers ----------------------------------------------------------------------------------
    def checkpoint(self, req, resp):
        """A plain checkpoint is answered at once, by a plain function (the service host runs no
        coroutine for it); a persisted one returns the coroutine whose file is written on the
        disk thread while the loop steps and other requests are served (ServiceHost resumes
        it; the class docstring)."""
        if req.persist:
            return self._checkpoint_persisted(req, resp)
        t0 = time.perf_counter()
        try:
            with self._locked():
                eng = self.ctl.configured()
                session = self.ctl.user_session(eng, req.session)
                info = eng.checkpoint(session, name=req.name or None, pin=req.pin)
                evicted = eng.last_evicted
        except Exception as e:
            return self._answer("checkpoint", resp, e)
        finally:
            self.ctl.timed(t0, "checkpoint")
        return self._checkpointed(resp, info, session, evicted)

    async def _checkpoint_persisted(self, req, resp):
        t0 = time.perf_counter()
        try:
            info, session, evicted = await self._persisted(req)
        except Exception as e:
            return self._answer("checkpoint", resp, e)
        finally:
            self.ctl.timed(t0, "checkpoint")
        return self._checkpointed(resp, info, session, evicted)

    def _checkpointed(self, resp, info, session: str, evicted: list[str]):
        resp.success, resp.capsule = True, capsule_msg(info)
        resp.message = f"capsule {info.id} of {session!r} at step {info.step}" + evictions(evicted)
        self.ctl.say(f"checkpoint: {resp.message}")
        return resp

    async def _persisted(self, req):
        """begin_persist under the lock, the file on the disk thread, end_persist under the
        lock; whatever refuses on the way leaves nothing behind (the file included), but for
        a node cleaned up meanwhile: a new configure may have reloaded the file already."""
        with self._locked():
            eng = self.ctl.configured()
            session = self.ctl.user_session(eng, req.session)
            pending = eng.begin_persist(session, req.name or None, req.pin)
        done: Future = Future()
        self._disk_jobs.put((eng, pending, done))
        try:
            await done  # the write's own error (an existing file, a full disk) is raised here
            with self._locked():
                if self.ctl.engine is eng:
                    return eng.end_persist(pending), session, eng.last_evicted
            # that engine is gone (cleaned up): no pool to fill, its reservations die with it
        except BaseException:  # GeneratorExit too: the node is shutting down
            with self._locked():
                eng.abandon_persist(pending)
            raise
        again = "the next start" if self.ctl.finalized else "a configure after it"
        raise BadRequest(
            f"the node was cleaned up while {pending.path} was written: the file stays in "
            f"capsule_dir ({again} reloads it)"
        )

    def _write_forever(self) -> None:
        name_os_thread()
        while (job := self._disk_jobs.get()) is not None:
            eng, pending, done = job
            try:
                eng.write_persist(pending)
            except Exception as e:
                if isinstance(e, DiskError):  # not a name or file taken meanwhile
                    self.ctl.wrote(f"persist {pending.path.name}: {e}")
                done.set_exception(e)
            else:
                self.ctl.wrote()
                done.set_result(None)
            try:
                self._wake.trigger()
            except Exception:  # the node is being destroyed: nobody awaits the reply
                return

    def restore(self, req, resp):
        with self._locked():
            eng = self.ctl.configured()
            session = self.ctl.user_session(eng, req.session)
            was = eng.poisoned(session)
            info = eng.restore(req.capsule, session, verify=req.verify)
            self.ctl.on_moved(eng, session)
            step = eng.session_step(session)
        resp.success, resp.capsule, resp.step = True, capsule_msg(info), step
        resp.message = f"restored {info.id} into {session!r}: step {step}" + (
            f" (no longer poisoned: {was})" if was else ""
        )
        self.ctl.say(f"restore: {resp.message}")
        return resp

    def branch(self, req, resp):
        with self._locked():
            eng = self.ctl.configured()
            goal = list(req.goal) if len(req.goal) else None
            info = eng.branch(req.capsule, req.session, goal=goal)
            if req.activate:
                self.ctl.live = req.session
            self.ctl.on_moved(eng, req.session)  # live first: its goal is echoed
            step = eng.session_step(req.session)
        resp.success, resp.session, resp.step = True, req.session, step
        resp.message = f"session {req.session!r} forked from {info.id} at step {step}" + (
            " and made live" if req.activate else ""
        )
        self.ctl.say(f"branch: {resp.message}")
        return resp

    def list_capsules(self, req, resp):
        with self._locked():
            eng = self.ctl.engine
            if eng is None:
                return resp
            resp.capsules = [capsule_msg(i) for i in eng.capsules()]
            resp.sessions = eng.sessions()
            resp.live_session = self.ctl.live
            resp.pool_bytes_used, resp.pool_bytes_total = pool_bytes(eng)
        return resp

    def drop_capsule(self, req, resp):
        with self._locked():
            try:
                info = self.ctl.configured().drop(req.capsule)
            except DiskError as e:  # capsule_dir refused the unlink: capsule and file stay
                self.ctl.wrote(f"drop: {e}")
                raise
        resp.success, resp.message = True, f"dropped {info.id}"
        self.ctl.say(f"drop: {resp.message}")
        return resp

    def drop_session(self, req, resp):
        with self._locked():
            eng = self.ctl.configured()
            if not req.session:
                raise BadRequest("name a session to drop")
            self.ctl.user_session(eng, req.session)
            if req.session == self.ctl.live:
                raise BadRequest(
                    f"{req.session!r} is the live session; make another one live first: "
                    "~/branch with activate (a session that is not live does not step, so a "
                    "pinned checkpoint of it, branched back into it with activate, makes it "
                    "live unchanged)"
                )
            eng.drop_session(req.session)
            self.ctl.on_dropped(eng, req.session)
        resp.success, resp.message = True, f"dropped session {req.session!r}"
        self.ctl.say(f"drop_session: {resp.message}")
        return resp

    def reset_session(self, req, resp):
        """Back to the initial state: how a poisoned session is recovered without a capsule."""
        with self._locked():
            eng = self.ctl.configured()
            session = self.ctl.user_session(eng, req.session)
            was = eng.poisoned(session)
            eng.reset(session)
            self.ctl.on_moved(eng, session)
            step = eng.session_step(session)
        resp.success, resp.step = True, step
        resp.message = f"session {session!r} reset to its initial state (step {step})" + (
            f"; it was poisoned: {was}" if was else ""
        )
        self.ctl.say(f"reset_session: {resp.message}")
        return resp

    # -- rollout -----------------------------------------------------------------------------------
    async def rollout(self, req, resp):
        """Step a session, or a scratch fork, on given observations; the robot sees nothing.

        Sizes are checked here, before anything of ours is allocated; the rows and the steps
        run on the rollout thread, each step yielding to the control loop, while the service
        loop is free for other requests."""
        t0 = time.perf_counter()
        try:
            eng = self.ctl.configured()
            n = self._check_sizes(eng, req)
            done: Future = Future()
            self._jobs.put((eng, req, n, done))
            actions = await done
            if not np.isfinite(actions).all():  # the engine raises first; never reply NaN
                raise RuntimeError("non-finite action in the rollout")
        except Exception as e:
            return self._answer("rollout", resp, e)
        finally:
            self.ctl.timed(t0, "rollout")
        resp.success, resp.action_dim = True, eng.action_dim
        resp.actions = array.array("d", actions.tobytes())
        resp.message = f"{n} steps on " + (
            "a scratch fork" if not req.commit else f"{req.session!r} (committed)"
        )
        self.ctl.say(f"rollout: {resp.message} in {time.perf_counter() - t0:.2f} s")
        return resp

    def _check_sizes(self, eng, req) -> int:
        images = [k for k, v in eng.observation_spec().items() if v["kind"] == "image"]
        if images:  # Rollout.srv carries rows of floats: no image fits in it
            raise BadRequest(
                f"~/rollout takes vector observations only, and this policy also reads "
                f"{', '.join(images)}; roll it out in Python (Engine.rollout with dict "
                "observations)"
            )
        limit, width = int(self.ctl.cfg.max_rollout_steps), eng.obs_dim
        n, got = int(req.n_steps), len(req.observations)
        if not 0 < n <= limit:
            raise BadRequest(
                f"n_steps={n}: must be within 1 .. max_rollout_steps={limit}; split the "
                "rollout, or raise the parameter"
            )
        if got > limit * width:
            raise BadRequest(
                f"{got} observation values: more than max_rollout_steps={limit} rows of "
                f"obs_dim={width}"
            )
        if got != n * width:
            raise BadRequest(
                f"{got} observation values; n_steps={n} rows of obs_dim={width} need {n * width}"
            )
        return n

    def _work_forever(self) -> None:
        name_os_thread()
        while (job := self._jobs.get()) is not None:
            eng, req, n, done = job
            try:
                done.set_result(self._run_rollout(eng, req, n))
            except Exception as e:
                if self._closing.is_set():  # the reply goes out at exit (host.py); logged too
                    self._stopped = f"rollout: {e}"
                done.set_exception(e)
            try:
                self._wake.trigger()
            except Exception:  # the node is being destroyed: nobody awaits the reply
                return

    def _run_rollout(self, eng, req, n: int) -> np.ndarray:
        ctl = self.ctl
        obs = req.observations
        flat = np.frombuffer(obs, np.float64) if isinstance(obs, array.array) else obs
        # every row checked (size, NaN/Inf, obs_limit, float32) before any state moves
        rows = eng.check_observations(np.asarray(flat, np.float64).reshape(n, eng.obs_dim))
        with ctl.lock:
            self._same_engine(eng)
            target = self._prepare_rollout(eng, req)
            ctl.on_moved(eng, target)  # a committed rollout's steps carry no observation stamp
            mine = eng.session(target)
            line = mine.generation
        recent: collections.deque[float] = collections.deque(maxlen=15)
        prior = self._step_prior()
        cost = step_cost(recent, prior)
        actions = np.empty((n, eng.action_dim))
        began = time.monotonic()

        def kept(i: int) -> str:
            return f"; {target!r} holds the state after {i} of them" if req.commit else ""

        def timed_out(i: int) -> CapacityError:
            return CapacityError(
                f"rollout_timeout_s={limit:g} reached: stopped after {i} of {n} steps{kept(i)} "
                "(the steps wait for room between control ticks); split the rollout, lower "
                "rate_hz, or raise the parameter"
            )

        for i in range(n):
            if self._closing.is_set():
                raise BadRequest(
                    f"the node is shutting down: stopped after {i} of {n} steps{kept(i)}"
                )
            with contextlib.ExitStack() as held:
                while True:  # the wait for room between ticks, at most until the deadline
                    # read at every wait: an operator lowering it stops a running rollout, and
                    # one lifting it (0) or raising it lets the rollout wait on
                    limit = float(ctl.cfg.rollout_timeout_s)
                    end = began + limit if limit > 0 else None
                    if end is not None and time.monotonic() > end:
                        raise timed_out(i)
                    give_up = 10.0 if end is None else min(10.0, max(end - time.monotonic(), 1e-3))
                    try:
                        held.enter_context(ctl.lock.background(cost, give_up_s=give_up))
                        break
                    except CapacityError as e:
                        if end is None or give_up >= 10.0:  # no room for 10 s: not the deadline's
                            why = f"{e}; stopped after {i} of {n} steps{kept(i)}"
                            raise CapacityError(why) from None
                self._same_engine(eng)
                if target == ctl.live:
                    raise BadRequest(f"{target!r} was made live during the rollout; stopped")
                if self._session_or_none(eng, target) is not mine or mine.generation != line:
                    raise BadRequest(
                        f"{target!r} was restored, reset, rewound, replaced or dropped by "
                        f"another request during the rollout: stopped after {i} of {n} steps"
                        + ("; the state it holds is that request's" if req.commit else "")
                    )
                t = time.perf_counter()
                actions[i] = eng.step(rows[i], session=target)
                dt = time.perf_counter() - t
            recent.append(dt)
            cost = step_cost(recent, prior)
        return actions

    def _step_prior(self) -> float:
        """The live session's median step time (s), or FIRST_STEP_COST_S before it stepped."""
        stats = self.ctl.stats
        with stats.lock:
            steps = stats.step_us.values().copy()
        return float(np.median(steps)) * 1e-6 if len(steps) else FIRST_STEP_COST_S

    @staticmethod
    def _session_or_none(eng, name: str):
        try:
            return eng.session(name)
        except UnknownReference:  # dropped
            return None

    def _same_engine(self, eng) -> None:
        if self.ctl.engine is not eng:
            raise BadRequest("the node was cleaned up during the rollout")

    def _prepare_rollout(self, eng, req) -> str:
        if req.commit:
            if not req.session:
                raise BadRequest("commit needs a named session (never the live one)")
            if req.session == self.ctl.live:
                raise BadRequest(f"commit into the live session {req.session!r} is not allowed")
            if req.capsule:
                eng.branch(req.capsule, req.session)
                return req.session
            return self._healthy(eng, self.ctl.user_session(eng, req.session))
        if req.capsule:
            return eng.fork_scratch(capsule=req.capsule)
        return eng.fork_scratch(session=self._healthy(eng, self.ctl.user_session(eng, req.session)))

    def _healthy(self, eng, session: str) -> str:
        """A poisoned session is no state to roll out from: the request is refused (no fault)."""
        why = eng.poisoned(session)
        if why:
            raise BadRequest(
                f"session {session!r} is poisoned ({why}); recover it with ~/reset_session, "
                "~/restore or ~/branch first, or roll out from a capsule"
            )
        return session


def pool_bytes(eng) -> tuple[int, int]:
    """(used, total) bytes of the capsule pool."""
    return eng.pool.bytes_used(), eng.pool.bytes_total()
