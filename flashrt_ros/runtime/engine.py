"""The Engine: sessions, steps and capsule operations, all at commit boundaries.

Every public method runs between two steps, so each one *is* a commit boundary: they are called
one at a time, whichever thread calls (calls.py; write_persist, the file of a persisted
checkpoint, is the one left out, so a disk write never holds a step up). This file holds its set-up,
sessions, late fusing and the step; the capsule verbs are in engine_capsules.py and the flight
recorder's in engine_flight.py (mixins: one Engine, one file per subject).

Errors (flashrt_ros/errors.py): every argument is checked up front, and a bad one raises a
BadRequest (a ValueError) that changed nothing; a limit raises CapacityError (a RuntimeError). A
step that fails on the device or returns a non-finite action raises StepFault and poisons its
session: it refuses to step or be checkpointed until a restore or branch into it, or reset().
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from flashrt_ros.capsules.checksum import device_checksum, to_hex
from flashrt_ros.capsules.id_reserve import BLOCK, IdReserve
from flashrt_ros.capsules.names import check_session_name
from flashrt_ros.capsules.pool import CapsulePool
from flashrt_ros.capsules.store import CapsuleStore
from flashrt_ros.cuda.copy import copy_io
from flashrt_ros.errors import (
    BadName,
    BadRequest,
    CapacityError,
    StepFault,
    UnknownReference,
    shown,
)
from flashrt_ros.policies.base import Policy
from flashrt_ros.runtime.arena import fingerprint, layout_table, plan_layout
from flashrt_ros.runtime.args import bool_arg, int_arg, limit_arg, ref_arg
from flashrt_ros.runtime.calls import serialize_calls
from flashrt_ros.runtime.engine_capsules import CapsuleVerbs
from flashrt_ros.runtime.engine_flight import FlightVerbs
from flashrt_ros.runtime.flight import check_ticks
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
from flashrt_ros.runtime.policy_checks import (
    check_declaration,
    check_inputs,
    warn_unregistered_tensors,
)
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


class Engine(CapsuleVerbs, FlightVerbs):
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
        self._calls = threading.RLock()  # one public call at a time (calls.py)
        if not isinstance(policy, Policy):
            raise BadRequest(f"policy must be a flashrt Policy, got {type(policy).__name__}")
        # the policies' noise keys take 31 bits (the node's `seed` parameter's range): a wider
        # seed would alias another (2**31 drew seed 0's noise) while its capsules said otherwise
        seed = int_arg(seed, "seed", 0, 2**31 - 1)
        capsule_slots = int_arg(capsule_slots, "capsule_slots", 1, 1 << 20)
        host_capsule_slots = int_arg(host_capsule_slots, "host_capsule_slots", 0, 1 << 20)
        max_sessions = int_arg(max_sessions, "max_sessions", 1, 1 << 16)
        use_graph = bool_arg(use_graph, "use_graph")
        if fuse is not None:
            fuse = bool_arg(fuse, "fuse")
        late_fuse = bool_arg(late_fuse, "late_fuse")
        if capsule_dir is not None and not isinstance(capsule_dir, str | Path):
            raise BadRequest(f"capsule_dir must be a path or None, got {capsule_dir!r}")
        self.obs_limit = limit_arg(obs_limit)
        spec = check_declaration(policy)  # its sizes and state_spec (policy_checks.py)
        try:
            self.inputs = list(policy.input_spec())
        except ValueError as e:  # an InputSpec that does not hold together
            raise BadRequest(f"policy inputs: {e}") from e
        check_inputs(policy, self.inputs)
        warn_unregistered_tensors(policy)
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
        self.spec = spec + engine_entries(policy)
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
        self.evicted_total = 0  # capsules evicted from the pool since the start, for good or not
        self._sessions: dict[str, Session] = {}
        self._poison: dict[str, str] = {}  # session -> why it may not step ("" never stored)
        self._scratch: torch.Tensor | None = None
        # the floating-point regions a checkpoint checks for NaN/Inf
        self._float_regions = [e.name for e in self.spec if e.dtype.is_floating_point]
        self._probes: dict[str, CheckpointProbe] = {}  # session name -> its checkpoint probe
        self.store = CapsuleStore(
            capsule_dir,
            fingerprint=self.fingerprint,
            fingerprint_v1=lambda: self.fingerprint_v1,
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
        ids = IdReserve(self.store.folder) if self.store.folder is not None else None
        if ids is not None:  # ids unique across restarts (id_reserve.py): fresh ids given to
            self.pool.skip_ids_below(ids.read())  # reloaded files come after the reserve too
        self._reloading = True  # reloaded files keep their own ids (_file_id)
        try:
            self.store.reload(self.load_capsule, room=self.pool.free_slots)
        finally:
            self._reloading = False
        if ids is not None:
            first = ids.start(self.pool.next_number())
            if ids.ok:
                self.pool.reserve, self.pool.reserved_to = ids.extend, first + BLOCK
            self.pool.skip_ids_below(first)
        self.build_s["reload"] = time.perf_counter() - t
        if late:
            self._late = LateFuse(
                self._fused_probe,
                lambda: list(self._sessions.values()),
                self.flight_ticks,
                self.device,
            )  # begun by the second step (_tick), so it never competes with the first

    @functools.cached_property
    def fingerprint_v1(self) -> str | None:
        """The fingerprint versions before derived_buffers wrote into capsule files (None: the
        same as `fingerprint`). Computed when a file of theirs is met, not at every start: the
        digest reads every weight again (a second of a large policy's start)."""
        v1 = getattr(self.policy, "weights_digest_v1", lambda: None)()
        return fingerprint(self.policy.policy_id, v1, self.layout, self.device.type) if v1 else None

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
        s = self._sessions.get(ref_arg(name, "session"))
        if s is None:
            raise UnknownReference(
                f"unknown session {shown(name)} (sessions: {', '.join(self.sessions())})"
            )
        return s

    def _user_name(self, name: str) -> str:
        """A name a user may create: the pattern, and no leading '_' (reserved for internals)."""
        if not isinstance(name, str):
            raise BadName(f"session name must be a string, got {type(name).__name__} {name!r}")
        if name.startswith("_"):
            raise BadName(f"session name {shown(name)}: names starting with '_' are reserved")
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
            check_pure=not self._sessions,
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
            cap = self.pool.get(ref_arg(capsule, "capsule"))
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

    def _cure(self) -> str:
        """What brings a poisoned session back, for its errors (rewind too, with a recorder)."""
        back = ", rewound to a tick before the fault" if self.flight_ticks else ""
        return f"a capsule is restored or branched into it{back}, or it is reset"

    def _live(self, name: str) -> Session:
        """The session, if it may step; StepFault (saying how to recover) when poisoned."""
        s = self.session(name)
        why = self._poison.get(s.name)
        if why:
            raise StepFault(
                f"session {s.name!r} is poisoned ({why}); it will not step until {self._cure()}"
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
                f"session {s.name!r}: {why}; the session is poisoned until {self._cure()}"
            ) from e
        s.steps += 1
        if not np.isfinite(s.action_np).all() or (chunk and not np.isfinite(s.chunk_np).all()):
            what = "action" if not np.isfinite(s.action_np).all() else "action chunk"
            why = (
                f"non-finite {what} at step {s.steps} (NaN/Inf from the policy, or elements "
                "its step left unwritten: each tick writes all of action and chunk)"
            )
            self._poison[s.name] = why
            raise StepFault(
                f"session {s.name!r}: {why}; the session is poisoned until {self._cure()}"
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


# every public call that reads or moves sessions, capsules or the pool (calls.py says why)
serialize_calls(
    Engine,
    (
        "sessions",
        "session_step",
        "poisoned",
        "reset",
        "fork_scratch",
        "create_session",
        "drop_session",
        "step",
        "step_with_chunk",
        "next_tick_kind",
        "prestage",
        "rollout",
        "set_goal",
        "get_goal",
        "state_bytes",
        "state_checksum",
        "checkpoint",
        "begin_persist",
        "end_persist",
        "abandon_persist",
        "restore",
        "branch",
        "copy_session",
        "capsules",
        "capsule",
        "drop",
        "pin",
        "save_capsule",
        "load_capsule",
        "flight",
        "rewind",
        "checkpoint_at",
        "save_flight_step",
    ),
)
