"""The Engine: sessions, steps and capsule operations, all at commit boundaries.

Every public method runs between two steps, so each one *is* a commit boundary. The Engine is
not thread safe: one thread (the node's control loop) drives it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from flashrt_ros.capsules.checksum import device_checksum, to_hex
from flashrt_ros.capsules.info import CapsuleInfo
from flashrt_ros.capsules.names import check_capsule_name, check_session_name
from flashrt_ros.capsules.pool import Capsule, CapsulePool
from flashrt_ros.capsules.store import CapsuleStore
from flashrt_ros.cuda.copy import copy_bytes, copy_io
from flashrt_ros.policies.base import Policy
from flashrt_ros.runtime.arena import fingerprint, layout_table, plan_layout
from flashrt_ros.runtime.session import Session, engine_entries

log = logging.getLogger(__name__)

SPIN_WAIT_S = 0.002  # a step's wait polls (holding the GIL) up to this long, then blocks


def resolve_device(device: str) -> torch.device:
    """'auto' picks CUDA when present; a CUDA request on a machine without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"bad device {device!r}: use auto, cpu, cuda or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r}: use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _vector(x, n: int, what: str) -> np.ndarray:
    """A finite float32 vector of length n, or ValueError; never touches a device buffer."""
    try:
        a = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} is not numeric: {e}") from None
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{what} must have shape ({n},), got {a.shape}")
    if not np.isfinite(a).all():
        raise ValueError(f"{what} has NaN or Inf at index {int(np.argmin(np.isfinite(a)))}")
    with np.errstate(over="ignore"):
        f = a.astype(np.float32)
    if not np.isfinite(f).all():
        raise ValueError(f"{what} overflows float32")
    return f


class Engine:
    """Serves one policy: sessions of static state, captured steps, a capsule pool."""

    def __init__(
        self,
        policy: Policy,
        device: str = "auto",
        seed: int = 0,
        capsule_slots: int = 16,
        host_capsule_slots: int = 0,
        capsule_dir: str | Path | None = None,
        max_sessions: int = 4,
        use_graph: bool = True,
        fuse: bool | None = None,
    ):
        """`use_graph` captures the step as a CUDA graph (CUDA only); `fuse` compiles it with
        inductor before capture (default: on CUDA when capturing) so the graph holds fewer,
        fused kernels."""
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self.device = resolve_device(device)
        if self.device.type == "cpu" and torch.get_num_threads() > 1:
            # A step is a few hundred tiny ops: intra-op threads only add handoffs (measured on
            # 2 cores: 1.4 ms per step with one thread, 29 ms with two).
            torch.set_num_threads(1)
        self.policy = policy.to(self.device).eval()
        for p in self.policy.parameters():
            p.requires_grad_(False)
        self.seed = int(seed)
        self.max_sessions = int(max_sessions)
        self.use_graph = use_graph
        on_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.current_stream(self.device) if on_cuda else None
        self._done = torch.cuda.Event() if on_cuda else None
        self.fuse = bool(use_graph and on_cuda if fuse is None else fuse and on_cuda)
        self.spec = list(policy.state_spec()) + engine_entries(policy)
        rows, self.state_nbytes = plan_layout(self.spec)
        self.layout = layout_table(rows)
        self.fingerprint = fingerprint(
            policy.policy_id, policy.weights_digest(), self.layout, self.device.type
        )
        self.pool = CapsulePool(self.state_nbytes, self.device, capsule_slots, host_capsule_slots)
        self._sessions: dict[str, Session] = {}
        self._scratch: torch.Tensor | None = None
        self.store = CapsuleStore(
            capsule_dir,
            fingerprint=self.fingerprint,
            layout=self.layout,
            nbytes=self.state_nbytes,
            policy_id=policy.policy_id,
        )
        main = self.create_session("main")
        if on_cuda:  # build the checksum kernel now, not during the first checkpoint request
            device_checksum(main.arena.buf)
        self.store.reload(self.load_capsule)

    # -- sessions ----------------------------------------------------------------------------------
    @property
    def obs_dim(self) -> int:
        return self.policy.obs_dim

    @property
    def action_dim(self) -> int:
        return self.policy.action_dim

    @property
    def goal_dim(self) -> int:
        return self.policy.goal_dim

    def sessions(self) -> list[str]:
        return list(self._sessions)

    def session(self, name: str) -> Session:
        s = self._sessions.get(name)
        if s is None:
            raise ValueError(f"unknown session {name!r} (sessions: {', '.join(self._sessions)})")
        return s

    def create_session(self, name: str) -> Session:
        """A fresh session (initial state, its own captured step)."""
        check_session_name(name)
        if name in self._sessions:
            raise ValueError(f"session {name!r} already exists")
        if len(self._sessions) >= self.max_sessions:
            raise RuntimeError(
                f"max_sessions={self.max_sessions} reached; drop a session or raise max_sessions"
            )
        s = Session(name, self.policy, self.spec, self.device, self.seed, self.use_graph, self.fuse)
        self._sessions[name] = s
        return s

    def drop_session(self, name: str) -> None:
        if name == "main":
            raise ValueError("session 'main' cannot be dropped")
        self.session(name)
        del self._sessions[name]

    def session_step(self, session: str = "main") -> int:
        return self.session(session).steps

    # -- stepping ----------------------------------------------------------------------------------
    def step(self, obs, session: str = "main") -> np.ndarray:
        """One replay of the session's step; returns the action (float64 copy)."""
        s = self.session(session)
        self._tick(s, _vector(obs, self.obs_dim, "observation"), chunk=False)
        return s.action_np.astype(np.float64)

    def step_with_chunk(self, obs, session: str = "main") -> tuple[np.ndarray, np.ndarray]:
        """step() plus the action chunk of this step, (chunk_len, action_dim), in one sync."""
        s = self.session(session)
        self._tick(s, _vector(obs, self.obs_dim, "observation"), chunk=True)
        return s.action_np.astype(np.float64), s.chunk_np.astype(np.float64)

    def check_observations(self, observations) -> np.ndarray:
        """Rows of observations as float32 (n, obs_dim), or ValueError naming the bad row."""
        try:
            rows = np.asarray(observations, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"observations are not numeric: {e}") from None
        if rows.ndim != 2 or rows.shape[1] != self.obs_dim or rows.shape[0] == 0:
            raise ValueError(
                f"observations must have shape (n>0, {self.obs_dim}), got {rows.shape}"
            )
        return np.stack(
            [_vector(r, self.obs_dim, f"observation row {i}") for i, r in enumerate(rows)]
        )

    def rollout(self, observations, session: str = "main") -> np.ndarray:
        """Step through rows of observations; every row is checked before the first step."""
        s = self.session(session)
        rows = self.check_observations(observations)
        out = np.empty((len(rows), self.action_dim), dtype=np.float64)
        for i, x in enumerate(rows):
            self._tick(s, x, chunk=False)
            out[i] = s.action_np
        return out

    def _tick(self, s: Session, x: np.ndarray, chunk: bool) -> None:
        """Stage a checked observation, replay, and bring the outputs to the host buffers."""
        np.copyto(s.obs_np, x)
        if self._stream is None:
            s.plan.replay()
        elif s.io_in_graph:  # the graph uploads obs and downloads action and chunk itself
            s.plan.replay()
            self._wait()
        else:
            copy_io(s.obs, s.host_obs)
            s.plan.replay()
            copy_io(s.host_action, s.action)
            if chunk:
                copy_io(s.host_chunk, s.chunk)
            self._wait()
        s.steps += 1

    def _wait(self) -> None:
        """Wait for the stream, first by polling an event while holding the GIL.

        Stream.synchronize releases the GIL; in the node, getting it back after a step can take
        a whole switch interval behind rclpy's executor thread, which showed up as publish
        jitter. A step is ~0.1 ms: polling costs one core for that long. Beyond SPIN_WAIT_S
        (long steps) the wait blocks as usual."""
        self._done.record(self._stream)
        t_end = time.perf_counter() + SPIN_WAIT_S
        while not self._done.query():
            if time.perf_counter() > t_end:
                self._done.synchronize()
                return

    def set_goal(self, goal, session: str = "main") -> None:
        """Swap the goal buffer (this call is a commit boundary: the next step sees it)."""
        s = self.session(session)
        g = _vector(goal, self.goal_dim, "goal")
        s.views["goal"][0].copy_(torch.from_numpy(g))

    def get_goal(self, session: str = "main") -> np.ndarray:
        return self.session(session).views["goal"][0].cpu().numpy().astype(np.float64)

    def state_bytes(self, session: str = "main") -> bytes:
        """Host copy of the session's whole arena (tests, debugging)."""
        return self.session(session).arena.snapshot_bytes()

    def state_checksum(self, session: str = "main") -> str:
        return to_hex(device_checksum(self.session(session).arena.buf))

    # -- capsules ----------------------------------------------------------------------------------
    def checkpoint(
        self,
        session: str = "main",
        name: str | None = None,
        pin: bool = False,
        persist: bool = False,
    ) -> CapsuleInfo:
        """Freeze the session's state with one device copy into the pool."""
        s = self.session(session)
        name = name or ""
        cid, path, stamp = None, None, None
        if persist:
            # the file is written first: a failed write leaves the pool exactly as it was
            self.store.require_folder()
            if name:
                check_capsule_name(name)
                self.pool.check_name_free(name)
            cid, stamp = self._fresh_id(), time.time()
            info = CapsuleInfo(
                id=cid,
                name=name,
                session=s.name,
                parent_id=s.parent_id,
                step=s.steps,
                nbytes=self.state_nbytes,
                tier="disk",
                checksum=to_hex(device_checksum(s.arena.buf)),
                pinned=pin,
                stamp=stamp,
            )
            path = self.store.persist(info, s.arena.buf)
        try:
            cap = self.pool.put(
                s.arena.buf,
                name=name,
                session=s.name,
                parent_id=s.parent_id,
                step=s.steps,
                pinned=pin,
                cid=cid,
                stamp=stamp,
            )
        except (ValueError, RuntimeError):
            if path is not None:
                self.store.discard(path)
            raise
        if self.pool.evicted:
            log.info("capsule pool evicted %s", ", ".join(self.pool.evicted))
            self.pool.evicted.clear()
        return self.pool.info(cap)

    def restore(self, capsule: str, session: str = "main", verify: bool = True) -> CapsuleInfo:
        """Bring a capsule back into a session with one copy; the continuation is identical."""
        s = self.session(session)
        cap = self.pool.get(capsule)
        self._copy_in(cap, s, verify)
        return self.pool.info(cap)

    def branch(self, capsule: str, session: str, goal=None) -> CapsuleInfo:
        """Fork a capsule into `session`, creating it (up to max_sessions) or overwriting it."""
        check_session_name(session)
        cap = self.pool.get(capsule)
        g = None if goal is None or len(goal) == 0 else _vector(goal, self.goal_dim, "goal")
        s = self._sessions.get(session) or self.create_session(session)
        self._copy_in(cap, s, verify=False)
        if g is not None:
            s.views["goal"][0].copy_(torch.from_numpy(g))
        return self.pool.info(cap)

    def copy_session(self, src: str, dst: str) -> None:
        """Fork a session's current state into `dst` (created if needed) with one copy, without
        using a pool slot (a scratch fork must not evict anybody's capsule)."""
        a = self.session(src)
        check_session_name(dst)
        b = self._sessions.get(dst) or self.create_session(dst)
        if b is not a:
            copy_bytes(b.arena.buf, a.arena.buf)
            b.steps, b.parent_id = a.steps, a.parent_id

    def capsules(self) -> list[CapsuleInfo]:
        return self.pool.infos()

    def capsule(self, ref: str) -> CapsuleInfo:
        return self.pool.info(self.pool.get(ref))

    def drop(self, capsule: str) -> CapsuleInfo:
        """Drop a capsule; a persisted one loses its file in capsule_dir too (first, so a
        failing unlink leaves everything in place)."""
        cap = self.pool.get(capsule)
        self.store.remove(cap.info.id)
        return self.pool.drop(cap.info.id)

    def pin(self, capsule: str, pinned: bool = True) -> CapsuleInfo:
        return self.pool.set_pinned(capsule, pinned)

    def _copy_in(self, cap: Capsule, s: Session, verify: bool) -> None:
        """One copy into the arena; with verify, the arena's checksum after the copy must be the
        one taken at checkpoint (this catches corrupted stored bytes and a failed copy alike),
        else the previous state is put back."""
        if verify:
            if self._scratch is None:
                self._scratch = torch.empty_like(s.arena.buf)
            copy_bytes(self._scratch, s.arena.buf)
        self.pool.copy_out(cap, s.arena.buf)
        if verify and not self.pool.matches(cap, s.arena.buf):
            copy_bytes(s.arena.buf, self._scratch)
            raise ValueError(
                f"capsule {cap.info.id} is corrupted: its bytes no longer match the checksum "
                "taken at checkpoint; state left unchanged"
            )
        s.steps = cap.info.step
        s.parent_id = cap.info.id

    # -- disk tier ---------------------------------------------------------------------------------
    def save_capsule(self, capsule: str, path: str | Path) -> Path:
        """Write a capsule to a file (atomic); returns the path."""
        cap = self.pool.get(capsule)
        return self.store.write(Path(path), self.pool.info(cap), self.pool.source(cap))

    def _fresh_id(self) -> str:
        """An id free in the pool and, for persisted capsules, in capsule_dir."""
        while True:
            cid = self.pool.new_id()
            if not self.store.id_taken(cid):
                return cid

    def load_capsule(self, path: str | Path, name: str | None = None) -> CapsuleInfo:
        """Read a capsule file into the pool after checking every field against this engine."""
        header, host = self.store.read(path)
        label = header["name"] if name is None else name
        if label:
            check_capsule_name(label)
        cap = self.pool.put(
            host.to(self.device),
            name=label,
            session=header["session"],
            parent_id=header["parent_id"],
            step=header["step"],
            cid=header["id"],
            stamp=header["stamp"],
        )
        return self.pool.info(cap)
