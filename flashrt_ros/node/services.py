"""The capsule services. Each handler takes the engine lock, so it lands between two steps;
a failure answers success=false with a message that says what to do, and changes nothing."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np

from flashrt_ros.capsules.names import check_session_name
from flashrt_ros.node.convert import capsule_msg
from flashrt_ros.srv import (
    Branch,
    Checkpoint,
    DropCapsule,
    DropSession,
    ListCapsules,
    Restore,
    Rollout,
)

# a rollout holds the single executor thread: in observation mode no joint_states are handled
# meanwhile, so it is bounded (10,000 steps: ~1 s on CUDA, ~15 s on a CPU)
MAX_ROLLOUT_STEPS = 10_000
SCRATCH = "_rollout"  # the session Rollout forks into; hidden from users


class CapsuleServices:
    def __init__(self, node, group):
        self.node = node
        self._rollout_lock = threading.Lock()
        # Logs of served requests are written by a thread of their own, after the reply: a log
        # line also publishes on /rosout and must not add to round trips. (A periodic flush on
        # the executor would wake it, and take the GIL from the control thread, ten times a
        # second.)
        self._pending: queue.SimpleQueue[tuple[bool, str] | None] = queue.SimpleQueue()
        self._logger = threading.Thread(target=self._log_forever, name="flashrt-log", daemon=True)
        self._logger.start()
        for srv, name, fn in (
            (Checkpoint, "~/checkpoint", self.checkpoint),
            (Restore, "~/restore", self.restore),
            (Branch, "~/branch", self.branch),
            (ListCapsules, "~/list_capsules", self.list_capsules),
            (DropCapsule, "~/drop_capsule", self.drop_capsule),
            (DropSession, "~/drop_session", self.drop_session),
            (Rollout, "~/rollout", self.rollout),
        ):
            node.create_service(srv, name, self._guarded(fn), callback_group=group)

    def _guarded(self, fn):
        """Last resort: an unexpected exception answers success=false instead of killing the
        node's only executor thread."""

        def handler(req, resp):
            t0 = time.perf_counter()
            try:
                return fn(req, resp)
            except Exception as e:
                self.node.get_logger().error(f"{fn.__name__}: unexpected {type(e).__name__}: {e}")
                if hasattr(resp, "success"):
                    resp.success = False
                    resp.message = f"{fn.__name__} failed unexpectedly: {type(e).__name__}: {e}"
                return resp
            finally:
                st = self.node.stats
                with st.lock:
                    st.service_us.add((time.perf_counter() - t0) * 1e6)

        return handler

    def _target_session(self, eng, name: str) -> None:
        """A session a request may create or overwrite: valid, not reserved, within the limit."""
        check_session_name(name)
        if name == SCRATCH:
            raise ValueError(f"session {SCRATCH!r} is reserved for rollouts")
        existing = [s for s in eng.sessions() if s != SCRATCH]
        if name not in existing and len(existing) >= self.node.cfg.max_sessions:
            raise RuntimeError(
                f"max_sessions={self.node.cfg.max_sessions} reached; "
                "use an existing session, drop one, or raise max_sessions"
            )

    def _engine(self):
        eng = self.node.engine
        if eng is None:
            raise ValueError("node is not configured: configure it (lifecycle) first")
        return eng

    def _session(self, eng, name: str) -> str:
        s = name or self.node.live
        if s == SCRATCH:
            raise ValueError(f"session {SCRATCH!r} is reserved for rollouts")
        eng.session(s)
        return s

    def _fail(self, resp, what: str, e: Exception):
        resp.success = False
        resp.message = f"{what} failed: {e}"
        self._pending.put((True, resp.message))
        return resp

    def _said(self, text: str) -> None:
        self._pending.put((False, text))

    def _log_forever(self) -> None:
        log = self.node.get_logger()
        while (item := self._pending.get()) is not None:
            warn, text = item
            if warn:  # rclpy ties a severity to each call site: two calls, not one
                log.warning(text)
            else:
                log.info(text)

    def close(self) -> None:
        """Write what is queued and end the log thread."""
        self._pending.put(None)
        self._logger.join(timeout=2.0)

    # -- handlers ----------------------------------------------------------------------------------
    def checkpoint(self, req, resp):
        with self.node.engine_lock:
            try:
                eng = self._engine()
                session = self._session(eng, req.session)
                info = eng.checkpoint(
                    session, name=req.name or None, pin=req.pin, persist=req.persist
                )
            except (ValueError, RuntimeError) as e:
                return self._fail(resp, "checkpoint", e)
        resp.success, resp.capsule = True, capsule_msg(info)
        resp.message = f"capsule {info.id} of {session!r} at step {info.step}"
        self._said(f"checkpoint: {resp.message}")
        return resp

    def restore(self, req, resp):
        with self.node.engine_lock:
            try:
                eng = self._engine()
                session = self._session(eng, req.session)
                info = eng.restore(req.capsule, session, verify=req.verify)
                step = eng.session_step(session)
            except (ValueError, RuntimeError) as e:
                return self._fail(resp, "restore", e)
        resp.success, resp.capsule, resp.step = True, capsule_msg(info), step
        resp.message = f"restored {info.id} into {session!r}: step {step}"
        self._said(f"restore: {resp.message}")
        return resp

    def branch(self, req, resp):

        with self.node.engine_lock:
            try:
                eng = self._engine()
                self._target_session(eng, req.session)
                goal = list(req.goal) if len(req.goal) else None
                info = eng.branch(req.capsule, req.session, goal=goal)
                step = eng.session_step(req.session)
                if req.activate:
                    self.node.live = req.session
            except (ValueError, RuntimeError) as e:
                return self._fail(resp, "branch", e)
        resp.success, resp.session, resp.step = True, req.session, step
        resp.message = f"session {req.session!r} forked from {info.id} at step {step}" + (
            " and made live" if req.activate else ""
        )
        self._said(f"branch: {resp.message}")
        return resp

    def list_capsules(self, req, resp):
        with self.node.engine_lock:
            eng = self.node.engine
            if eng is None:
                return resp
            resp.capsules = [capsule_msg(i) for i in eng.capsules()]
            resp.sessions = [s for s in eng.sessions() if s != SCRATCH]
            resp.live_session = self.node.live
            resp.pool_bytes_used = eng.pool.bytes_used()
            resp.pool_bytes_total = eng.pool.bytes_total()
        return resp

    def drop_capsule(self, req, resp):
        with self.node.engine_lock:
            try:
                info = self._engine().drop(req.capsule)
            except ValueError as e:
                return self._fail(resp, "drop", e)
        resp.success, resp.message = True, f"dropped {info.id}"
        self._said(f"drop: {resp.message}")
        return resp

    def drop_session(self, req, resp):
        with self.node.engine_lock:
            try:
                eng = self._engine()
                if not req.session:
                    raise ValueError("name a session to drop")
                self._session(eng, req.session)
                if req.session == self.node.live:
                    raise ValueError(f"{req.session!r} is the live session; activate another first")
                eng.drop_session(req.session)
            except ValueError as e:
                return self._fail(resp, "drop_session", e)
        resp.success, resp.message = True, f"dropped session {req.session!r}"
        self._said(f"drop_session: {resp.message}")
        return resp

    def rollout(self, req, resp):
        """Step a session, or a scratch fork, on given observations; the robot sees nothing.

        Each step takes the engine lock on its own, so a long rollout interleaves with the
        live control loop instead of stalling it.
        """
        with self._rollout_lock:
            try:
                eng = self._engine()
                n, width = int(req.n_steps), eng.obs_dim
                if not 0 < n <= MAX_ROLLOUT_STEPS:
                    raise ValueError(f"n_steps={n}: must be within 1 .. {MAX_ROLLOUT_STEPS}")
                if len(req.observations) != n * width:
                    raise ValueError(
                        f"{len(req.observations)} observation values; n_steps={n} rows of "
                        f"obs_dim={width} need {n * width}"
                    )
                # every row checked (size, NaN/Inf, float32 range) before any state moves
                rows = eng.check_observations(
                    np.asarray(req.observations, dtype=np.float64).reshape(n, width)
                )
                with self.node.engine_lock:
                    target = self._prepare_rollout(eng, req, SCRATCH)
                actions = np.empty((n, eng.action_dim))
                for i in range(n):
                    with self.node.engine_lock:
                        if self.node.engine is not eng:
                            raise RuntimeError("node was cleaned up during the rollout")
                        actions[i] = eng.step(rows[i], session=target)
            except (ValueError, RuntimeError) as e:
                return self._fail(resp, "rollout", e)
        resp.success, resp.actions, resp.action_dim = True, actions.ravel().tolist(), eng.action_dim
        resp.message = f"{n} steps on {'scratch fork' if target == SCRATCH else repr(target)}"
        return resp

    def _prepare_rollout(self, eng, req, scratch: str) -> str:
        if req.commit:
            if not req.session:
                raise ValueError("commit needs a named session (never the live one)")
            target = self._session(eng, req.session) if not req.capsule else req.session
            if target == self.node.live:
                raise ValueError(f"commit into the live session {target!r} is not allowed")
            if req.capsule:
                self._target_session(eng, target)
                eng.branch(req.capsule, target)
            return target
        if req.capsule:
            eng.branch(req.capsule, scratch)
        else:
            src = self._session(eng, req.session)
            eng.copy_session(src, scratch)
        return scratch
