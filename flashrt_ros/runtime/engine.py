"""The Engine: sessions, steps and capsule operations, all at commit boundaries.

Every public method runs between two steps, so each one *is* a commit boundary. The Engine is
not thread safe: one thread (the node's control loop) drives it.

Errors (flashrt_ros/errors.py): every argument is checked up front, and a bad one raises a
BadRequest (a ValueError) that changed nothing; a limit raises CapacityError (a RuntimeError). A
step that fails on the device or returns a non-finite action raises StepFault and poisons its
session: it refuses to step or be checkpointed until a restore or branch into it, or reset().
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from flashrt_ros.capsules import diskfmt
from flashrt_ros.capsules.checksum import (
    device_checksum,
    to_hex,
)
from flashrt_ros.capsules.info import CapsuleInfo
from flashrt_ros.capsules.names import (
    CAPSULE_NAME,
    check_capsule_name,
    check_session_name,
    is_issued_id,
)
from flashrt_ros.capsules.pool import Capsule, CapsulePool
from flashrt_ros.capsules.store import CapsuleStore, check_path
from flashrt_ros.cuda.copy import copy_bytes, copy_io
from flashrt_ros.errors import (
    BadName,
    BadRequest,
    CapacityError,
    CorruptCapsule,
    StepFault,
    UnknownReference,
)
from flashrt_ros.policies.base import Policy
from flashrt_ros.runtime.arena import fingerprint, layout_table, plan_layout
from flashrt_ros.runtime.flight import (
    check_int,
    check_ticks,
    held_step,
    nonfinite_regions,
    require_past,
)
from flashrt_ros.runtime.inputs import (
    check_dict,
    image,
    immutable,
    numeric,
    resolve_encodings,
    vector,
    wire_shape,
)
from flashrt_ros.runtime.latefuse import LateFuse
from flashrt_ros.runtime.precompiled import PrecompiledSteps, step_key
from flashrt_ros.runtime.probe import CheckpointProbe
from flashrt_ros.runtime.session import Session, engine_entries

log = logging.getLogger(__name__)

SPIN_WAIT_S = 0.002  # a step's wait polls (holding the GIL) up to this long, then blocks
# What a step that staged inputs does, while the device still runs it, for the next tick when that
# is of another kind (a chunked policy's queue tick after its infer tick): "check" runs the
# observation's checks again (pure), "upload" uploads the next kind's graph (Engine._warm);
# "after" does both again once the tick is done, before step() returns.
WARM_NEXT: tuple[str, ...] = ("check", "upload")


SCRATCH = "_scratch"  # the internal what-if session: not listed, not counted in max_sessions


def use_compile_cache(folder: str | Path | None, key: str) -> Path | None:
    """Point inductor's and Triton's on-disk caches at `folder/key` (created); None leaves
    them alone. Both read their environment variable when they first compile or look up, so
    this must run before the first compile in the process (the Engine calls it before it
    builds any session). Keyed by the engine fingerprint: another policy, weights or layout
    gets another folder."""
    if folder is None or folder == "":
        return None
    if not isinstance(folder, str | Path):
        raise BadRequest(f"compile_cache_dir must be a path or None, got {folder!r}")
    path = Path(folder).expanduser() / key
    try:
        path.mkdir(parents=True, exist_ok=True)
        for sub in (path, path / "inductor", path / "triton"):  # an existing folder may be
            if sub.is_dir():  # read-only (a mounted cache): inductor's lock files need writes
                tempfile.TemporaryFile(dir=sub).close()
    except OSError as e:  # a cache only saves time: never fail a start for it (read-only HOME)
        log.warning("compile cache off: cannot write %s (%s); torch's defaults apply", path, e)
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    return path


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' picks CUDA when present; a CUDA request on a machine without one is an error."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise BadRequest(f"device must be a string (auto, cpu, cuda or cuda:N), got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise BadRequest(f"bad device {device!r}: use auto, cpu, cuda or cuda:N") from e
    if dev.type not in ("cpu", "cuda"):
        raise BadRequest(f"unsupported device {device!r}: use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BadRequest(f"device {device!r} asked for, but CUDA is not available here")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cuda" and dev.index >= torch.cuda.device_count():
        raise BadRequest(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def _int(x, what: str, lo: int, hi: int = 2**63 - 1) -> int:
    """An int (numpy ints too, bools not: True is no slot count) in [lo, hi], or BadRequest."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise BadRequest(f"{what} must be an integer, got {type(x).__name__} {x!r}")
    if not lo <= int(x) <= hi:
        raise BadRequest(f"{what} must be in [{lo}, {hi}], got {int(x)}")
    return int(x)


def _bool(x, what: str) -> bool:
    """A bool (numpy's too); 0/1 or "true" are refused so a swapped argument is caught."""
    if not isinstance(x, bool | np.bool_):
        raise BadRequest(f"{what} must be True or False, got {type(x).__name__} {x!r}")
    return bool(x)


def _limit(x) -> float:
    """obs_limit: a finite positive real number (strings and bools refused)."""
    if isinstance(x, bool | np.bool_) or not isinstance(x, int | float | np.integer | np.floating):
        raise BadRequest(f"obs_limit must be a number, got {type(x).__name__} {x!r}")
    v = float(x)
    if not math.isfinite(v) or v <= 0:
        raise BadRequest(f"obs_limit must be finite and > 0, got {v}")
    return v


def _ref(x, what: str) -> str:
    """A session or capsule reference: a non-empty string (a list or None is a bad request, not
    a TypeError from a dict lookup)."""
    if not isinstance(x, str) or not x:
        raise BadRequest(f"{what} must be a non-empty string, got {type(x).__name__} {x!r}")
    return x


def _capsule_meta(s: Session, name: str, pin: bool, checksum: str) -> dict:
    """What a capsule of the session's current state records besides its id and stamp."""
    return dict(
        name=name,
        session=s.name,
        parent_id=s.parent_id,
        step=s.steps,
        pinned=pin,
        checksum=checksum,
    )


@dataclasses.dataclass(frozen=True)
class PendingPersist:
    """A persisted checkpoint begun (Engine.begin_persist): its info, file, state and digest."""

    info: CapsuleInfo
    path: Path
    state: torch.Tensor  # a host copy of the arena when it was begun
    digest: torch.Tensor  # that state's checksum lanes, on the device


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
        obs_limit: float = 1000.0,
        flight_ticks: int = 0,
        image_encodings: dict[str, str] | None = None,
        compile_cache_dir: str | Path | None = None,
        late_fuse: bool = False,
    ):
        """`use_graph` captures the step as a CUDA graph (CUDA only); `fuse` compiles it with
        inductor before capture (default: on CUDA when capturing) so the graph holds fewer,
        fused kernels. `obs_limit` bounds every observation and goal value (|x| <= obs_limit):
        a finite but huge input (1e30) would overflow the state to Inf/NaN for good, so it is
        refused like a NaN. `image_encodings` maps image inputs to their camera encoding
        ("rgb8" | "bgr8" | "mono8"; default rgb8 for 3 channels, mono8 for 1): the captured step
        converts each to the policy's RGB float layout, so the host only copies the bytes.
        `compile_cache_dir` (None: torch's defaults) points inductor's and Triton's on-disk caches
        at `<compile_cache_dir>/<fingerprint>` before anything is compiled, so a warm start
        reuses the kernels of this policy, weights and layout only; a
        fused step is then also compiled ahead of time and saved there (precompiled.py), and
        a warm start loads it instead of compiling it again (`precompiled.events` says which).
        `late_fuse` (with a fused step): serve the eager kernels from the first step and build
        the fused step in a background thread, begun once the first step is done (or by
        `finish_fusing()` or a new session), swapped in at a commit boundary once checked
        (latefuse.py; `fusing`, `finish_fusing()`): a start in a fraction of the time, at the
        price its module doc states; the build runs without full garbage collections and
        freezes the heap when it ends (latefuse.build_window). Every argument is checked
        before anything is allocated."""
        if not isinstance(policy, Policy):
            raise BadRequest(f"policy must be a flashrt Policy, got {type(policy).__name__}")
        # the policies' noise keys take 31 bits (the node's `seed` parameter's range): a wider
        # seed would alias another (2**31 drew seed 0's noise) while its capsules said otherwise
        seed = _int(seed, "seed", 0, 2**31 - 1)
        capsule_slots = _int(capsule_slots, "capsule_slots", 1, 1 << 20)
        host_capsule_slots = _int(host_capsule_slots, "host_capsule_slots", 0, 1 << 20)
        max_sessions = _int(max_sessions, "max_sessions", 1, 1 << 16)
        use_graph = _bool(use_graph, "use_graph")
        if fuse is not None:
            fuse = _bool(fuse, "fuse")
        late_fuse = _bool(late_fuse, "late_fuse")
        if capsule_dir is not None and not isinstance(capsule_dir, str | Path):
            raise BadRequest(f"capsule_dir must be a path or None, got {capsule_dir!r}")
        self.obs_limit = _limit(obs_limit)
        try:
            self.inputs = list(policy.input_spec())
        except ValueError as e:  # an InputSpec that does not hold together
            raise BadRequest(f"policy inputs: {e}") from e
        self.encodings = resolve_encodings(self.inputs, image_encodings)
        self._wire = {i.name: wire_shape(i, self.encodings.get(i.name)) for i in self.inputs}
        # the plain vector form (engine.step(vector)) serves a policy whose only input is a vector
        only = self.inputs[0] if len(self.inputs) == 1 else None
        self._vector_input = only.name if only is not None and only.kind == "vector" else None
        self.flight_ticks = check_ticks(flight_ticks)  # per user session; see flight()
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
        self._warming = True  # Engine._warm, until it fails once
        if fuse is None:  # by default only on CUDA: inductor's CPU code compiles slowly
            fuse = use_graph and on_cuda and getattr(policy, "fuse_default", True)
        self.fuse = bool(fuse)
        # A policy may compile parts of itself instead (Policy.compile_parts): the step is then
        # captured around them, not compiled whole.
        self._fuse_step = self.fuse and not policy.compile_parts()
        # Why the compiled step is not served ("" while it is, or was never asked for): the
        # first session checks it against the eager step (fusecheck.py).
        self.fused_mismatch = ""
        self._late: LateFuse | None = None
        self._ticked = False  # a tick began (late fusing begins its build at the second)
        self.late_fuse = ""  # what became of late fusing, once it ended ("" before, or never)
        self.spec = list(policy.state_spec()) + engine_entries(policy)
        rows, self.state_nbytes = plan_layout(self.spec)
        self.layout = layout_table(rows)
        self.fingerprint = fingerprint(
            policy.policy_id, policy.weights_digest(), self.layout, self.device.type
        )
        self.compile_cache = use_compile_cache(compile_cache_dir, self.fingerprint)
        # a fused step is compiled ahead of time and kept beside inductor's caches
        self.precompiled = None
        if self._fuse_step and self.compile_cache is not None:
            try:
                key = step_key(self.fingerprint, policy, self.device)
            except Exception as e:  # noqa: BLE001 - a cache only saves time
                log.warning("no precompiled step (%s: %s)", type(e).__name__, e)
                key = None
            if key is None:
                log.info(
                    "the step is not precompiled: its code has no source file here, or "
                    "changed since this process started"
                )
            else:
                self.precompiled = PrecompiledSteps(self.compile_cache, key)
        # late fusing: sessions start on the eager kernels, the fused step comes later
        late = late_fuse and self._fuse_step
        self._fuse_step = self._fuse_step and not late
        self.build_s: dict[str, float] = {}  # phase -> seconds, for the node's start-up log
        t_build = time.perf_counter()
        try:
            self.pool = CapsulePool(
                self.state_nbytes, self.device, capsule_slots, host_capsule_slots
            )
        except RuntimeError as e:  # out of (device or pinned) memory for the slabs
            raise CapacityError(
                f"cannot allocate {capsule_slots} + {host_capsule_slots} capsule slots of "
                f"{self.state_nbytes} bytes: {e}; lower capsule_slots or host_capsule_slots"
            ) from e
        self.last_evicted: list[str] = []  # what the last capsule added evicted (_report_evictions)
        self._sessions: dict[str, Session] = {}
        self._poison: dict[str, str] = {}  # session -> why it may not step ("" never stored)
        self._scratch: torch.Tensor | None = None
        # the floating-point regions a checkpoint checks for NaN/Inf
        self._float_regions = [e.name for e in self.spec if e.dtype.is_floating_point]
        self._probes: dict[str, CheckpointProbe] = {}  # session name -> its checkpoint probe
        self.store = CapsuleStore(
            capsule_dir,
            fingerprint=self.fingerprint,
            layout=self.layout,
            nbytes=self.state_nbytes,
            policy_id=policy.policy_id,
        )
        self._persisting: dict[str, str] = {}  # id -> name of each begun, unfinished persist
        # no new capsule takes the id of a file, or of a persist whose file is being written
        self.pool.id_taken = lambda cid: self.store.id_known(cid) or cid in self._persisting
        self.pool.missing_hint = self._file_hint
        t = time.perf_counter()
        self.build_s["arena_pool"] = t - t_build
        main = self.create_session("main")
        t, t0 = time.perf_counter(), t
        self.build_s["compile_capture"] = t - t0  # the main session: compile, warm-up, capture
        # build the checksum kernel and capture main's checkpoint probe now, not during the first
        # checkpoint request
        self._probe_of(main)
        t, t0 = time.perf_counter(), t
        self.build_s["checksum_kernel"] = t - t0
        self.store.reload(self.load_capsule, room=self.pool.free_slots)
        self.build_s["reload"] = time.perf_counter() - t
        if late:
            self._late = LateFuse(
                self._fused_probe,
                lambda: list(self._sessions.values()),
                self.flight_ticks,
                self.device,
            )  # begun by the second step (_tick), so it never competes with the first

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
        """The user sessions (the internal scratch session is not listed)."""
        return [n for n in self._sessions if not n.startswith("_")]

    def session(self, name: str) -> Session:
        s = self._sessions.get(_ref(name, "session"))
        if s is None:
            raise UnknownReference(
                f"unknown session {name!r} (sessions: {', '.join(self.sessions())})"
            )
        return s

    def _user_name(self, name: str) -> str:
        """A name a user may create: the pattern, and no leading '_' (reserved for internals)."""
        if not isinstance(name, str):
            raise BadName(f"session name must be a string, got {type(name).__name__} {name!r}")
        if name.startswith("_"):
            raise BadName(f"session name {name!r}: names starting with '_' are reserved")
        check_session_name(name)
        return name

    def _room_for(self, name: str) -> None:
        """CapacityError when creating user session `name` would exceed max_sessions."""
        if name not in self._sessions and len(self.sessions()) >= self.max_sessions:
            raise CapacityError(
                f"max_sessions={self.max_sessions} reached; drop a session or raise max_sessions"
            )

    def create_session(self, name: str) -> Session:
        """A fresh session (initial state, its own captured step)."""
        self._user_name(name)
        if name in self._sessions:
            raise BadName(f"session {name!r} already exists")
        self._room_for(name)
        return self._new_session(name)

    def _new_session(self, name: str) -> Session:
        # A new session waits for a late-fusing build (its capture could not overlap the
        # build's device syncs: latefuse.py) and is then built fused, like the others.
        if self._late is not None:
            self._late.start()
            self._late.wait()
            self._end_late_fuse()
        ticks = 0 if name.startswith("_") else self.flight_ticks  # no ring for internal sessions
        s = Session(
            name,
            self.policy,
            self.spec,
            self.device,
            self.seed,
            self.use_graph,
            self._fuse_step,
            ticks,
            self.encodings,
            self.precompiled,
            check_fused=self._fuse_step and not self._sessions,  # the first session
        )
        if s.fused_mismatch:  # every later session is built unfused too
            self._fuse_step, self.fused_mismatch = False, s.fused_mismatch
            self._log_mismatch()
        self._sessions[name] = s
        return s

    def _log_mismatch(self) -> None:
        log.error(
            "%s: the compiled (fused) step differs from the eager step (%s); serving the "
            "eager kernels, captured as a CUDA graph where there is one. An inductor fault "
            "(see docs/design.md, 'Checking the fused step'); fuse=False skips the compile.",
            self.policy.policy_id,
            self.fused_mismatch,
        )

    def drop_session(self, name: str) -> None:
        self.session(name)
        if name == "main":
            raise BadRequest("session 'main' cannot be dropped")
        if name.startswith("_"):
            raise BadName(f"session {name!r} is internal and cannot be dropped")
        del self._sessions[name]
        self._poison.pop(name, None)
        self._probes.pop(name, None)

    # -- late fusing (latefuse.py) ---------------------------------------------------------------
    @property
    def fusing(self) -> bool:
        """A fused step is being built in the background (or is ready and not yet swapped in,
        or waits for the second step to begin: `fusing_begun`)."""
        return self._late is not None

    @property
    def fusing_begun(self) -> bool:
        """Late fusing's build has begun (at the second step, or when asked for)."""
        return self._late is not None and self._late.started is not None

    @property
    def fused(self) -> bool:
        """The main session steps with the compiled (fused) step."""
        return self.session("main").fused

    def finish_fusing(self, timeout: float | None = None) -> bool:
        """Wait for late fusing to end and swap the fused step in; call it from the thread
        that steps (it is a commit boundary). A build not begun yet (no step so far) begins,
        unless `timeout` is 0: that only polls. True once the fused step is served; False when
        it will not be (`late_fuse` says why) or on timeout (still building)."""
        late = self._late
        if late is not None and timeout != 0:
            late.start()
        if late is not None and not late.wait(timeout):
            return False
        self._end_late_fuse()
        return self.fused

    def cancel_fusing(self) -> None:
        """Ask a late-fusing build to stop at its next phase (before a cleanup)."""
        if self._late is not None:
            self._late.cancel()

    def _fused_probe(self, ticks: int, check: bool) -> Session:
        """A fused session on an arena of its own, for LateFuse: compiled, checked, warmed up."""
        return Session(
            "_fuse",
            self.policy,
            self.spec,
            self.device,
            self.seed,
            self.use_graph,
            True,
            ticks,
            self.encodings,
            self.precompiled,
            check_fused=check,
        )

    def _end_late_fuse(self) -> None:
        """Swap the fused plans into every session if the background build is ready; once it
        has ended either way, say what came of it. Only at a commit boundary."""
        late = self._late
        if late is None or not late.done.is_set():
            return
        self._late = None
        if late.ready:
            for s in self._sessions.values():  # every plan set is made: only assignments here
                s.use_plans(late.prepared[s.name])
            self._fuse_step = True  # later sessions are built fused
            main = self._sessions["main"]
            self.late_fuse = (
                f"fused step in service from step {main.steps} of main, built in the background "
                f"in {late.built_s:.2f} s"
            )
            log.info("%s: %s", self.policy.policy_id, self.late_fuse)
            return
        self.late_fuse = f"eager kernels kept: {late.why_not}"
        if late.mismatch:
            self.fused_mismatch = late.mismatch
            self._log_mismatch()
        else:
            log.error("%s: %s", self.policy.policy_id, self.late_fuse)

    def session_step(self, session: str = "main") -> int:
        return self.session(session).steps

    def poisoned(self, session: str = "main") -> str:
        """Why the session may not step ("" when healthy): a step produced a non-finite action or
        failed on the device. A restore or branch into it, or reset(), clears it."""
        self.session(session)
        return self._poison.get(session, "")

    def reset(self, session: str = "main") -> None:
        """Put a session back to its initial state (as created: zeros, the policy's init with the
        engine's seed, the meta row, step 0, no parent) without recapturing; clears a poison."""
        s = self.session(session)
        with torch.no_grad():
            s.arena.buf.zero_()
            self.policy.init_state(s.views, self.seed)
            s.views["meta"][0, 0] = self.seed
        s.steps, s.parent_id = 0, ""
        self._replaced(s)

    def fork_scratch(self, session: str | None = None, capsule: str | None = None) -> str:
        """Copy a session's current state (default "main"), or a capsule, into the internal
        scratch session and return its name, for what-if rollouts: it is not listed by
        sessions(), does not count against max_sessions, and takes no pool slot. Its step is
        captured once, on first use."""
        if session is not None and capsule is not None:
            raise BadRequest("fork_scratch takes a session or a capsule, not both")
        if capsule is not None:
            cap = self.pool.get(_ref(capsule, "capsule"))
            s = self._sessions.get(SCRATCH) or self._new_session(SCRATCH)
            self._copy_in(cap, s, verify=False)
        else:
            self._copy(self.session("main" if session is None else session), SCRATCH)
        return SCRATCH

    def _replaced(self, s: Session) -> None:
        """The arena was rewritten by something other than a step: a new line of steps starts
        there, and whatever poisoned the old state is gone."""
        self._poison.pop(s.name, None)
        s.state_replaced()

    def _live(self, name: str) -> Session:
        """The session, if it may step; StepFault (saying how to recover) when poisoned."""
        s = self.session(name)
        why = self._poison.get(s.name)
        if why:
            raise StepFault(
                f"session {s.name!r} is poisoned ({why}); it will not step until a capsule is "
                "restored or branched into it, or it is reset"
            )
        return s

    # -- stepping ----------------------------------------------------------------------------------
    def step(self, obs, session: str = "main") -> np.ndarray:
        """One replay of the session's step; returns the action (float64 copy). `obs` is a dict
        name -> array with exactly the policy's inputs (observation_spec()), or, for a policy
        whose only input is a vector, that vector. A non-finite action, or a device failure,
        raises StepFault and poisons the session."""
        s = self._live(session)
        self._tick(s, self._obs(obs), chunk=False)
        return s.action_np.astype(np.float64)

    def step_with_chunk(self, obs, session: str = "main") -> tuple[np.ndarray, np.ndarray]:
        """step() plus the action chunk of this step, (chunk_len, action_dim), in one sync.
        For a chunked (LeRobot-shaped) policy the chunk is the plan from this tick on: row 0 is
        this tick's action, row k the action planned for k ticks later (see ChunkedPolicy)."""
        s = self._live(session)
        self._tick(s, self._obs(obs), chunk=True)
        return s.action_np.astype(np.float64), s.chunk_np.astype(np.float64)

    def observation_spec(self) -> dict[str, dict]:
        """What step() takes, per key: {"kind": "vector" | "image", "shape": wire shape (D,) or
        (H, W, C), "dtype": "float32" | "uint8", "encoding": camera encoding or None}."""
        return {
            i.name: {
                "kind": i.kind,
                "shape": self._wire[i.name],
                "dtype": "float32" if i.kind == "vector" else "uint8",
                "encoding": self.encodings.get(i.name),
            }
            for i in self.inputs
        }

    def next_tick_kind(self, session: str = "main") -> str:
        """The kind of the session's next tick (e.g. "infer" or "queue" for a chunked policy),
        from the host's step count: no sync."""
        return self.policy.tick_kinds[self.policy.tick_kind(self.session(session).steps)]

    def prestage(self, name: str, img: np.ndarray, session: str = "main") -> bool:
        """Copy one camera image into the session's pinned staging buffer now, between steps.

        A node calls it when an image arrives, in the wait for the joint_states that steps:
        the next step given this very array finds it staged and skips the copy (1.8 MB for two
        640x480 rgb8 images, ~0.25 ms of host time on the H200 machine), so the copy is no
        longer part of the step's latency. Only an immutable uint8 array (a view over a
        received message's bytes, inputs.immutable) on CUDA is kept: anything else returns
        False and changes nothing, and the step stages as usual. A name that is not an image
        input, or a wrong shape or dtype, raises BadRequest. Not during a step: the Engine is
        not thread-safe (the node holds its lock)."""
        s = self._live(session)
        spec = s.inputs.specs.get(name)
        if spec is None or spec.kind == "vector":
            images = [n for n, x in s.inputs.specs.items() if x.kind != "vector"]
            raise BadRequest(f"prestage: {name!r} is not an image input (images: {images})")
        x = image(img, self._wire[name], f"prestage[{name!r}]")
        if not s.inputs.keeps or not immutable(x):
            return False
        s.inputs.stage(name, x)
        return True

    def _obs(self, obs, what: str = "observation"):
        """A checked observation: a dict name -> array, or the float32 vector of the vector
        form. Nothing is staged here: a bad key changes nothing."""
        if isinstance(obs, Mapping):
            return check_dict(obs, self.inputs, self._wire, self.obs_limit)
        if self._vector_input is None:
            raise BadRequest(
                f"{what}: this policy takes a dict observation with keys "
                f"{[i.name for i in self.inputs]} (engine.observation_spec() gives shapes), "
                f"got {type(obs).__name__}"
            )
        return vector(obs, self.obs_dim, what, self.obs_limit)

    def check_observations(self, observations) -> np.ndarray | list[dict]:
        """Rows of observations as float32 (n, obs_dim), or, given a sequence of dicts, the
        list of checked dicts; BadRequest naming the bad row."""
        if (
            isinstance(observations, list | tuple)
            and observations
            and all(isinstance(r, Mapping) for r in observations)
        ):
            out = []
            for i, r in enumerate(observations):
                out.append(self._obs(r, f"observation row {i}"))
            return out
        if self._vector_input is None:
            raise BadRequest(
                f"observations: this policy takes dict observations with keys "
                f"{[i.name for i in self.inputs]}; pass a list of dicts"
            )
        if isinstance(observations, list | tuple):  # each row on its own (bools, strings):
            for i, r in enumerate(observations):  # mixed rows would be made floats together
                numeric(r, f"observation row {i}")
        rows = numeric(observations, "observations")
        if rows.ndim != 2 or rows.shape[1] != self.obs_dim or rows.shape[0] == 0:
            raise BadRequest(
                f"observations must have shape (n>0, {self.obs_dim}), got {rows.shape}"
            )
        return np.stack([self._obs(r, f"observation row {i}") for i, r in enumerate(rows)])

    def rollout(self, observations, session: str = "main") -> np.ndarray:
        """Step through rows of observations (or a list of dict observations); every row is
        checked before the first step."""
        s = self._live(session)
        rows = self.check_observations(observations)
        out = np.empty((len(rows), self.action_dim), dtype=np.float64)
        for i, x in enumerate(rows):
            self._tick(s, x, chunk=False)
            out[i] = s.action_np
        return out

    def _tick(self, s: Session, x, chunk: bool) -> None:
        """Stage a checked observation (the inputs this tick's kind reads), replay that kind's
        plan, and bring the outputs to the host buffers; then check the host action (and chunk)
        for NaN/Inf, which costs no sync: they are already on the host. A fault poisons the
        session, so nothing non-finite ever reaches a robot."""
        if self._late is not None:
            if self._late.done.is_set():
                self._end_late_fuse()  # between two steps: swap the fused plans in
            elif self._ticked:
                self._late.start()  # the first command is out: build the fused step now
            self._ticked = True
        kind = self.policy.tick_kind(s.steps) if len(s.plans) > 1 else 0
        names = s.tick_names[kind]
        if isinstance(x, dict):
            for n in names:
                s.inputs.stage(n, x[n])
        elif names:
            np.copyto(s.obs_np, x)
        plan = s.plans[kind]
        try:
            if self._stream is None:
                plan.replay()
            elif s.io_in_graph:  # the graph uploads the inputs and downloads the outputs itself
                plan.replay()
                warm = bool(names) and len(s.plans) > 1 and bool(WARM_NEXT) and self._warming
                self._wait((lambda: self._warm(s, x, kind, WARM_NEXT)) if warm else None)
                if warm and "after" in WARM_NEXT:
                    self._warm(s, x, kind, ("check", "upload"))
            else:
                for n in names:
                    copy_io(s.inputs.dev[n], s.inputs.host[n])
                plan.replay()
                copy_io(s.host_action, s.action)
                if chunk:
                    copy_io(s.host_chunk, s.chunk)
                self._wait()
        except Exception as e:  # CUDA error, out of memory, a failing policy: not a bad request
            why = f"step {s.steps + 1} failed: {type(e).__name__}: {e}"
            self._poison[s.name] = why
            raise StepFault(
                f"session {s.name!r}: {why}; the session is poisoned until a capsule is "
                "restored or branched into it, or it is reset"
            ) from e
        s.steps += 1
        if not np.isfinite(s.action_np).all() or (chunk and not np.isfinite(s.chunk_np).all()):
            what = "action" if not np.isfinite(s.action_np).all() else "action chunk"
            why = f"non-finite {what} at step {s.steps}"
            self._poison[s.name] = why
            raise StepFault(
                f"session {s.name!r}: {why}; the session is poisoned until a capsule is "
                "restored or branched into it, or it is reset"
            )

    def _warm(self, s: Session, x, kind: int, what: tuple[str, ...]) -> None:
        """Host work for the next tick (`what`: "check", "upload"), done while the device runs
        this one, or once it is done with WARM_NEXT's "after".

        The first queue tick after an infer tick took twice the others (bench/queue_probe.py):
        the infer tick's 1.8 MB image copy and long wait leave the host's caches cold for the
        next tick's checks and graph launch. Running the same checks again and uploading the
        next graph here, while the device is busy for milliseconds, brings them back."""
        nxt = self.policy.tick_kind(s.steps + 1)
        if nxt == kind:
            return
        try:
            if "check" in what:
                self._obs(x)
            if "upload" in what:
                s.plans[nxt].upload()
        except Exception as e:  # noqa: BLE001 - only time is at stake: never fail a step for it
            self._warming = False
            log.warning("warming the next tick failed (%s: %s); not trying again", type(e), e)

    def _wait(self, warm=None) -> None:
        """Wait for the stream, first by polling an event while holding the GIL.

        Stream.synchronize releases the GIL; in the node, getting it back after a step can take
        a whole switch interval behind rclpy's executor thread, which showed up as publish
        jitter. A step is ~0.1 ms: polling costs one core for that long. Beyond SPIN_WAIT_S
        (long steps) the wait blocks as usual. `warm`, when the device is still busy once the
        event is recorded, is called first (Engine._warm)."""
        self._done.record(self._stream)
        if warm is not None and not self._done.query():
            warm()
        t_end = time.perf_counter() + SPIN_WAIT_S
        while not self._done.query():
            if time.perf_counter() > t_end:
                self._done.synchronize()
                return

    def set_goal(self, goal, session: str = "main") -> None:
        """Swap the goal buffer (this call is a commit boundary: the next step sees it)."""
        s = self.session(session)
        g = self._goal(numeric(goal, "goal"))
        s.views["goal"][0].copy_(torch.from_numpy(g))

    def _goal(self, a: np.ndarray) -> np.ndarray:
        """The goal buffer's new value from checked numbers; BadRequest saying so when the
        policy takes no goal at all, rather than asking for shape (0,)."""
        if self.goal_dim == 0 and a.size:
            raise BadRequest(
                "goal: this policy takes no goal (goal_dim 0; a camera policy sees its target "
                f"in its images), got {a.size} values"
            )
        return vector(a, self.goal_dim, "goal", self.obs_limit)

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
        """Freeze the session's state with one device copy into the pool and one pass over it
        (the session's CheckpointProbe: NaN/Inf flags and checksum), then one wait. With our
        kernels and a free slot the pass itself copies the arena and its digest into the slot,
        which the pool then records; otherwise the pool copies after the pass, and takes the
        probe's digest for the slot. Nothing is computed or read back twice.
        A poisoned session, or a state holding NaN/Inf in a floating-point region, is refused:
        every capsule in the pool is finite by construction (files are checked on load), so a
        restore can never bring a non-finite state back unless the stored bytes changed, which
        verify catches."""
        s, name, pin = self._to_freeze(session, name, pin)
        persist = _bool(persist, "persist")

        def meta(checksum: str) -> dict:
            return _capsule_meta(s, name, pin, checksum)

        if not persist and self._probe_of(s).fused:
            slot = self.pool.free_slot()
            if slot is not None:  # one pass fills the slot: no copy after the wait
                self._check_new_name(name)
                _, checksum = self._probe_finite(s, slot)
                return self.pool.info(self.pool.adopt(slot, **meta(checksum)))
        if persist:  # checks, then the file, then the pool: a refused call changes nothing
            pending = self.begin_persist(s.name, name, pin)
            try:
                self.write_persist(pending)
            except BaseException:
                self.abandon_persist(pending)
                raise
            return self.end_persist(pending)
        self._check_new_name(name)
        probe, checksum = self._probe_finite(s)
        cap = self.pool.put(s.arena.buf, digest=probe.digest, **meta(checksum))
        self._report_evictions()
        return self.pool.info(cap)

    def begin_persist(self, session: str, name: str | None, pin: bool = False) -> PendingPersist:
        """A persisted checkpoint in three parts, so that the slow one (the file and its
        fsyncs) needs no engine lock: here (lock held) every check that can refuse, the id and
        name reserved, the state's host copy and digest; write_persist() (no lock) the file;
        end_persist() (lock held) the pool. checkpoint(persist=True) runs the three in a row."""
        s, name, pin = self._to_freeze(session, name, pin)
        self.store.require_folder()
        self._check_new_name(name)
        self.pool.require_room()
        probe, checksum = self._probe_finite(s)
        cid, stamp = self._fresh_id(), time.time()
        info = CapsuleInfo(
            id=cid,
            nbytes=self.state_nbytes,
            tier="disk",
            stamp=stamp,
            **_capsule_meta(s, name, pin, checksum),
        )
        path = self.store.free_path(info)  # BadName when the file exists
        state = s.arena.buf.detach().to("cpu", copy=True)  # the state now: the session moves on
        self._persisting[cid] = name
        return PendingPersist(info, path, state, probe.digest.clone())

    def _to_freeze(self, session: str, name: str | None, pin: bool) -> tuple[Session, str, bool]:
        """The session a checkpoint freezes, its capsule's name ("" for none) and pin, checked;
        a poisoned session is refused."""
        s = self.session(session)
        if name is not None and not isinstance(name, str):
            raise BadName(f"capsule name must be a string or None, got {name!r}")
        pin = _bool(pin, "pin")
        why = self._poison.get(s.name)
        if why:
            raise BadRequest(
                f"session {s.name!r} is poisoned ({why}): its state is not "
                "worth keeping; restore, branch into or reset it first"
            )
        return s, name or "", pin

    def _check_new_name(self, name: str) -> None:
        self.pool.check_new(name)
        if name and name in self._persisting.values():
            raise BadName(f"capsule name {name!r} is taken by a checkpoint being written")

    def write_persist(self, p: PendingPersist) -> None:
        """The file of a begun persist (no engine lock needed: it reads only `p`); BadName or
        BadRequest when it cannot be written (it exists now, disk full, permissions)."""
        self.store.write(p.path, p.info, p.state)

    def end_persist(self, p: PendingPersist) -> CapsuleInfo:
        """The pool takes a written persist's capsule (the state as begin_persist copied it);
        on any refusal its file is removed again."""
        try:
            self.store.own(p.info, p.path)
            try:
                cap = self.pool.put(
                    p.state,
                    cid=p.info.id,
                    stamp=p.info.stamp,
                    digest=p.digest,
                    name=p.info.name,
                    session=p.info.session,
                    parent_id=p.info.parent_id,
                    step=p.info.step,
                    pinned=p.info.pinned,
                    checksum=p.info.checksum,
                )
                self.pool.claim_id(p.info.id)
            except BaseException:
                self.store.discard(p.info)  # only the file this persist wrote
                raise
            self._report_evictions()
            return self.pool.info(cap)
        finally:
            self._persisting.pop(p.info.id, None)

    def abandon_persist(self, p: PendingPersist) -> None:
        """Undo a persist before end_persist, its file written or not: the file goes (when it
        is the one written for it), the reservation too."""
        with contextlib.suppress(Exception):  # not written, or not ours: left as it is
            header = diskfmt.read_capsule_header(p.path)
            if header.get("id") == p.info.id and header.get("stamp") == p.info.stamp:
                p.path.unlink()
        self._persisting.pop(p.info.id, None)

    def restore(self, capsule: str, session: str = "main", verify: bool = True) -> CapsuleInfo:
        """Bring a capsule back into a session with one copy; the continuation is identical.
        Clears a poison: the capsule was finite when taken (checkpoint refuses NaN/Inf) and
        verify proves its bytes are still the ones taken."""
        s = self.session(session)
        cap = self.pool.get(capsule)
        self._copy_in(cap, s, _bool(verify, "verify"))
        return self.pool.info(cap)

    def branch(self, capsule: str, session: str, goal=None) -> CapsuleInfo:
        """Fork a capsule into `session`, creating it (up to max_sessions) or overwriting it.
        Everything is checked before a session is created or a byte is copied."""
        self._user_name(session)
        cap = self.pool.get(capsule)
        g = None
        if goal is not None:
            a = numeric(goal, "goal")
            if not (a.ndim == 1 and a.size == 0):  # an empty goal means "keep the capsule's"
                g = self._goal(a)
        self._room_for(session)
        s = self._sessions.get(session) or self._new_session(session)
        self._copy_in(cap, s, verify=False)
        if g is not None:
            s.views["goal"][0].copy_(torch.from_numpy(g))
        return self.pool.info(cap)

    def copy_session(self, src: str, dst: str) -> None:
        """Fork a session's current state into `dst` (created if needed) with one copy, without
        using a pool slot (a scratch fork must not evict anybody's capsule)."""
        a = self.session(src)
        self._user_name(dst)
        self._room_for(dst)
        self._copy(a, dst)

    def _copy(self, a: Session, dst: str) -> None:
        """dst (created without limits: callers checked) <- a's arena; a poison goes along."""
        b = self._sessions.get(dst) or self._new_session(dst)
        if b is a:
            return
        copy_bytes(b.arena.buf, a.arena.buf)
        b.steps, b.parent_id = a.steps, a.parent_id
        self._replaced(b)
        if self._poison.get(a.name):
            self._poison[b.name] = self._poison[a.name]

    def _probe_of(self, s: Session) -> CheckpointProbe:
        """The session's checkpoint probe, captured on its first use (a session dropped and
        created again under the same name gets a new one)."""
        probe = self._probes.get(s.name)
        if probe is None or probe.session is not s:
            probe = self._probes[s.name] = CheckpointProbe(s, self._float_regions, self.use_graph)
        return probe

    def _probe_finite(self, s: Session, slot: int | None = None) -> tuple[CheckpointProbe, str]:
        """The probe (its `digest` is the arena's on the device) and the arena's hex checksum,
        after one pass and one wait; with `slot` (a free pool slot, the kernels' probe only)
        the same pass copies the arena and its digest there. BadRequest naming the
        floating-point regions that hold NaN/Inf, having changed nothing (the slot stays free)."""
        probe = self._probe_of(s)
        if slot is None:
            probe.issue()
        else:
            probe.issue(self.pool.slab[slot], self.pool.digest_row(slot))
        if self._stream is not None:
            self._wait()
        bad, checksum = probe.result()
        if bad:
            raise BadRequest(
                f"session {s.name!r} holds NaN or Inf in {', '.join(bad)}; refusing to "
                "checkpoint it (restore, branch into or reset the session)"
            )
        return probe, checksum

    def _report_evictions(self) -> None:
        """Log the capsules the pool evicted to make room (LRU), once each, and keep them in
        `last_evicted` until the next call that adds a capsule: a planner's checkpoint reply
        names what it cost (a capsule it still counts on may be among them)."""
        self.last_evicted = list(self.pool.evicted)
        if self.pool.evicted:
            log.warning("capsule pool full: evicted %s", ", ".join(self.pool.evicted))
            self.pool.evicted.clear()

    def capsules(self) -> list[CapsuleInfo]:
        return self.pool.infos()

    def _file_hint(self, ref: str) -> str:
        """An unknown capsule reference that names a file of capsule_dir: a persisted capsule
        evicted from the pool (its file stays), or one not loaded at start. Said, so that a
        planner that persisted `grasp` is not just told it is unknown."""
        folder = self.store.folder
        if folder is None or not isinstance(ref, str) or not CAPSULE_NAME.fullmatch(ref):
            return ""  # an id or a name only: never a path out of the folder
        path = folder / f"{ref}{diskfmt.SUFFIX}"
        if not os.path.isfile(path):
            return ""
        return (
            f"; capsule_dir holds {path.name}, a persisted capsule not in the pool (evicted, or "
            "not loaded at start): Engine.load_capsule brings it back, as does the node's next "
            "start when the pool has room"
        )

    def capsule(self, ref: str) -> CapsuleInfo:
        return self.pool.info(self.pool.get(ref))

    def drop(self, capsule: str) -> CapsuleInfo:
        """Drop a capsule; a persisted one loses its file in capsule_dir too (first, so a
        failing unlink leaves everything in place)."""
        cap = self.pool.get(capsule)
        self.store.remove(self.pool.info(cap))
        return self.pool.drop(cap.info.id)

    def pin(self, capsule: str, pinned: bool = True) -> CapsuleInfo:
        """Pin or unpin; a persisted capsule's file gets the new pin too (atomic rewrite), so
        a restart keeps it. A failed rewrite leaves the pin as it was (a host-tier capsule
        brought back into a slot for the pin stays there: only the tiers changed)."""
        pinned = _bool(pinned, "pinned")
        before = self.pool.get(capsule).info.pinned
        info = self.pool.set_pinned(capsule, pinned)
        if pinned != before:
            try:
                self.store.repin(info)
            except BaseException:
                self.pool.set_pinned(info.id, before)
                raise
        self._report_evictions()  # a host-tier capsule pinned back into a full pool
        return info

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
            raise CorruptCapsule(
                f"capsule {cap.info.id} is corrupted: its bytes no longer match the checksum "
                "taken at checkpoint; state left unchanged"
            )
        s.steps = cap.info.step
        s.parent_id = cap.info.id
        self._replaced(s)

    # -- disk tier ---------------------------------------------------------------------------------
    def save_capsule(self, capsule: str, path: str | Path | None = None) -> Path:
        """Write a capsule to a new file (atomic; an existing file is never replaced); returns
        the path."""
        if path is None:
            raise BadRequest("save_capsule needs the path of the file to write")
        path = check_path(path)
        cap = self.pool.get(_ref(capsule, "capsule"))
        return self.store.write(path, self.pool.info(cap), self.pool.readable(cap))

    def _fresh_id(self) -> str:
        """The next id free in the pool, in capsule_dir and among the persists being written.
        Not used up here: the caller claims it once the pool took the capsule."""
        return self.pool.peek_id(lambda cid: self.store.id_taken(cid) or cid in self._persisting)

    def _file_id(self, cid: object, path: Path) -> str:
        """The id a loaded file keeps: its own when it is one we could have issued, no live
        capsule has it and no other file of capsule_dir is named for it (drop would remove
        that file); else a fresh one."""
        if is_issued_id(cid) and cid not in self.pool.caps and self.store.may_keep_id(cid, path):
            return cid
        return self._fresh_id()

    def load_capsule(self, path: str | Path, name: str | None = None) -> CapsuleInfo:
        """Read a capsule file into the pool after checking every field against this engine;
        it keeps its pin. The file's id is kept when it is a free capsule id (else a fresh one);
        a file of capsule_dir is the capsule's file from now on (drop removes it)."""
        path = check_path(path)
        if name is not None and not isinstance(name, str):
            raise BadName(f"capsule name must be a string or None, got {name!r}")
        if name:
            check_capsule_name(name)
            self.pool.check_name_free(name)
        header, host = self.store.read(path)
        label = header["name"] if name is None else name
        if label:
            check_capsule_name(label)
            self.pool.check_name_free(label)
        if header["pinned"]:
            self.pool.require_room(f" ({path}: a pinned capsule needs a slot)")
        cid = self._file_id(header["id"], path)
        cap = self.pool.put(
            host.to(self.device),
            name=label,
            session=header["session"],
            parent_id=header["parent_id"],
            step=header["step"],
            pinned=header["pinned"],
            cid=cid,
            stamp=header["stamp"],
        )
        self.pool.claim_id(cid)
        self._report_evictions()
        info = self.pool.info(cap)
        self.store.adopt(path, info)
        return info

    # -- flight recorder (runtime/flight.py) -------------------------------------------------------
    def _flight_session(self, session: str) -> Session:
        """A user session (UnknownReference for an internal one: it has no ring)."""
        if isinstance(session, str) and session.startswith("_"):
            raise UnknownReference(f"unknown session {session!r} (sessions: {self.sessions()})")
        return self.session(session)

    def flight(self, session: str = "main") -> list[int]:
        """The steps whose state the session holds, oldest first; the last is the current step.
        With `flight_ticks`=N: the last N states of the session's current line of steps (a
        restore, branch, copy or reset starts a new line; a rewind keeps the older steps).
        With flight_ticks=0 only the current state."""
        return list(self._flight_session(session).flight_steps())

    def rewind(self, k: int, session: str = "main") -> int:
        """Bring the session back to its state k steps ago (1 <= k <= len(flight()) - 1) with one
        device copy from its flight ring, and clear a poison: that state stepped cleanly. The
        same observations then give bit-identical actions. Returns the step it landed at."""
        s = self._flight_session(session)
        k = check_int(k, "k")
        if s.flight is None:
            raise BadRequest("the flight recorder is off: create the Engine with flight_ticks > 0")
        held = s.flight_steps()
        require_past(held, s.name, self.flight_ticks)
        if not 1 <= k <= len(held) - 1:
            raise BadRequest(
                f"cannot rewind {k} step(s): session {s.name!r} holds steps "
                f"{held.start}..{held.stop - 1}, so k must be in [1, {len(held) - 1}]"
            )
        s.rewind_to(s.steps - k)
        self._poison.pop(s.name, None)
        return s.steps

    def checkpoint_at(
        self, step: int, session: str = "main", name: str | None = None, pin: bool = False
    ) -> CapsuleInfo:
        """Freeze a recorded step into an ordinary pool capsule (one device copy from its ring
        slot), so restore, branch and save_capsule work on it as on any checkpoint. Like
        checkpoint(), a state holding NaN/Inf is refused: the pool only holds finite states."""
        s = self._flight_session(session)
        t = held_step(s.flight_steps(), step, s.name)
        if t == s.steps:  # the current state: exactly a checkpoint
            return self.checkpoint(s.name, name=name, pin=pin)
        if name is not None and not isinstance(name, str):
            raise BadName(f"capsule name must be a string or None, got {name!r}")
        pin = _bool(pin, "pin")
        src = s.flight_state(t)
        bad = nonfinite_regions(src, s.table)
        if bad:
            raise BadRequest(
                f"step {t} of session {s.name!r} holds NaN or Inf in {', '.join(bad)}; "
                "refusing to checkpoint it (save_flight_step writes it to a file)"
            )
        cap = self.pool.put(
            src, name=name or "", session=s.name, parent_id=s.parent_id, step=t, pinned=pin
        )
        self._report_evictions()
        return self.pool.info(cap)

    def save_flight_step(self, step: int, path: str | Path, session: str = "main") -> Path:
        """Write one recorded step of a session to a capsule file (the usual format, checksum and
        fingerprint; id "<session>-<step>", which load_capsule replaces with a fresh capsule id),
        without touching the pool. Non-finite states are written too: the state a misbehaving
        policy acted from is what one wants to look at."""
        s = self._flight_session(session)
        t = held_step(s.flight_steps(), step, s.name)
        src = s.flight_state(t)
        info = CapsuleInfo(
            id=check_capsule_name(f"{s.name}-{t}"),
            name="",
            session=s.name,
            parent_id=s.parent_id,
            step=t,
            nbytes=self.state_nbytes,
            tier="disk",
            checksum=to_hex(device_checksum(src)),
            pinned=False,
            stamp=time.time(),
        )
        return self.store.write(path, info, src)

    def flight_bytes(self) -> int:
        """Device bytes held by the flight rings of all sessions."""
        return sum(s.flight.bytes for s in self._sessions.values() if s.flight is not None)
