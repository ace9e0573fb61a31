"""The flight recorder in the node: ~/rewind, ~/dump_flight, automatic dumps, tick stamps.

The Engine keeps, per session, the states the last `flight_ticks` steps started from
(runtime/flight.py). The node adds what only it knows: the time of each tick. For every step it
records, in a preallocated host ring, the stamp of the observation that step consumed (the
joint_states header stamp; its receive time when the header is zero). That stamp is what
~/rewind by time looks up, and what each dumped capsule carries in its header `stamp`: the
capsule of step t holds the state after the observation stamped `stamp` was consumed, so
`flashrt-replay --from-capsule` continues with the bag's messages after that stamp.

A dump asked for with ~/dump_flight copies the ring to host memory on the flight thread, a
batch of ticks per short hold of the engine lock sized to fit between two control ticks (the
live session goes on stepping: a tick overwritten before its turn is left out, and named), then
its files are written on a thread of their own. The automatic dumps (a step error, a
deactivate) are copied at once, in the hold of the lock that saw the fault or the deactivate:
the live session does not step then (poisoned, or the loop stopped), and a recovery request
right after it (a reset, rewind or restore, within milliseconds) cannot take away what led
there. Neither the control loop nor the inputs' loop (joint_states in observation mode) waits
for the disk.

A dump goes to a hidden folder that is renamed into place when complete,
`capsule_dir/flight/<session>-<UTC time>[-<n>]/`, one `<session>-<step>.fcap` per tick; the final
name is reserved first (an exclusive mkdir) and a taken one gets the next suffix: no dump ever
replaces or merges with another folder. `flight` and every dump folder must be real folders
(checked with lstat, never through a symbolic link) whenever one is created, written into or
bounded: anything else is refused, so nothing is written or removed outside capsule_dir.
Subfolders are never reloaded into the pool. Automatic dumps end in `-fault` / `-deactivate` /
`-stop` (a shutdown or signal while active), are throttled (`flight_dump_interval_s`) and kept
within `flight_dump_max_mb` by removing the oldest automatic dumps first; dumps asked for with
~/dump_flight are never removed by the node.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import queue
import shutil
import stat
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rclpy.task import Future

from flashrt_ros.capsules import diskfmt
from flashrt_ros.capsules.checksum import device_checksum, to_hex
from flashrt_ros.capsules.info import CapsuleInfo
from flashrt_ros.capsules.names import check_capsule_name
from flashrt_ros.errors import BadRequest, CapacityError, DiskError
from flashrt_ros.node.convert import capsule_msg, evictions
from flashrt_ros.node.loop import name_os_thread
from flashrt_ros.runtime.flight import nonfinite_regions, require_past
from flashrt_ros.srv import DumpFlight, Rewind

FLIGHT_DIR = "flight"  # subfolder of capsule_dir holding the dumps
AUTO_REASONS = ("fault", "deactivate", "stop")  # a stop: a shutdown or signal while active
FILE_SLACK = 8 * 1024  # per file, besides the state: magic, JSON header, digest (estimate)
BATCH_S = 0.002  # a ~/dump_flight copies about this long per hold of the engine lock
COPY_BPS = 2e9  # device -> pageable host bytes/s assumed when asking the lock for one tick's copy
MAX_SUFFIX = 1000  # dump folder names tried (`name`, `name-2`, ...) before giving up
TAKEN = (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR)  # a rename met a folder


def stamp_ns(stamp) -> int:
    """builtin_interfaces/Time as integer nanoseconds."""
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


def asked_stamp_ns(stamp) -> int:
    """A request's stamp as stamp_ns, or BadRequest for a time that is none (nanosec >= 1e9:
    4294967295 was taken as 4.29 s more)."""
    if not 0 <= int(stamp.nanosec) < 1_000_000_000:
        raise BadRequest(f"stamp.nanosec must be in [0, 999999999], got {int(stamp.nanosec)}")
    return stamp_ns(stamp)


class StampRing:
    """(step, line, stamp) of a session's last N ticks in preallocated slots: a tick writes three
    slots and allocates nothing. `line` is the session's parent_id at that tick, so a stamp of
    another line of steps (before a restore or a branch) is never taken for this one."""

    def __init__(self, n: int):
        self.n = n
        self.steps = np.full(n, -1, dtype=np.int64)
        self.stamps = np.zeros(n, dtype=np.int64)
        self.lines: list[str | None] = [None] * n

    def put(self, step: int, line: str, stamp: int) -> None:
        i = step % self.n
        self.steps[i] = step
        self.stamps[i] = stamp
        self.lines[i] = line

    def forget_after(self, step: int) -> None:
        """Drop the stamps of steps after `step`: the session is back there, and those step
        numbers will be reached again by other ticks (or by steps with no stamp)."""
        self.steps[self.steps > step] = -1

    def get(self, step: int, line: str) -> int | None:
        """The stamp of `step` in `line`, or None when it was not recorded."""
        i = step % self.n
        if self.steps[i] != step or self.lines[i] != line:
            return None
        return int(self.stamps[i])


@dataclass
class Snapshot:
    """A session's recorded steps copied to host memory: everything a dump writes."""

    session: str
    parent_id: str
    steps: list[int]
    stamps: list[float]  # seconds; 0.0 where no observation stamp is known
    states: torch.Tensor  # (len(steps), nbytes) uint8, host
    store: object  # the engine's CapsuleStore: headers carry its fingerprint and layout
    left_out: str = ""  # what a dump of a moving session could not copy, in words

    def write(self, folder: Path) -> list[Path]:
        """One capsule file per step into `folder` (an empty folder of ours), oldest first."""
        out = []
        for i, t in enumerate(self.steps):
            state = self.states[i]
            cid = check_capsule_name(f"{self.session}-{t}")
            info = CapsuleInfo(
                id=cid,
                name="",
                session=self.session,
                parent_id=self.parent_id,
                step=t,
                nbytes=int(state.numel()),
                tier="disk",
                checksum=to_hex(device_checksum(state)),
                pinned=False,
                stamp=self.stamps[i],
            )
            path = folder / f"{cid}{diskfmt.SUFFIX}"
            out.append(self.store.write(path, info, state))
        return out


@dataclass
class Wanted:
    """An automatic dump that passed its checks (FlightServices._wanted_dump): where and within
    what bound its copy, taken at once, is written."""

    wall: float  # time.time() when it was asked for: the folder's name
    fit: int  # the newest ticks that fit in the disk bound
    budget: int  # flight_dump_max_mb in bytes
    capsule_dir: str


@dataclass
class Asked:
    """A ~/dump_flight: the steps the session held when it was asked (engine lock held then),
    copied by the flight thread a batch at a time (_copy_asked), while the session may go on
    stepping."""

    engine: weakref.ref
    sref: weakref.ref
    session: str
    generation: int  # the session's then: a restore, branch, reset or rewind changes it
    held: list[int]
    stamps: list[float]
    parent_id: str
    newest: torch.Tensor  # the state of held[-1], copied in the request's own hold
    capsule_dir: str
    name: str
    done: Future


def spans(steps: list[int]) -> str:
    """Steps as ranges: [3, 4, 5, 9] -> "3..5, 9"."""
    out, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        out.append(str(steps[i]) if i == j else f"{steps[i]}..{steps[j]}")
        i = j + 1
    return ", ".join(out)


def utc_name(t: float) -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def real_dir(path: Path) -> bool:
    """A folder itself, not a symbolic link to one (lstat: the last component is not followed)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def require_real_dir(path: Path) -> None:
    if not real_dir(path):
        raise BadRequest(
            f"{path} is not a real folder (a symbolic link, a file or missing): flight dumps "
            "are only written into a folder of capsule_dir itself; remove it"
        )


def by_step(p: Path) -> int:
    return int(p.stem.rsplit("-", 1)[1])


def folder_bytes(folder: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for e in os.scandir(folder):
            with contextlib.suppress(OSError):
                total += e.stat(follow_symlinks=False).st_size
    return total


def auto_dumps(root: Path) -> list[Path]:
    """The automatic dump folders under `root` (real folders only), oldest first."""
    found = []
    with contextlib.suppress(OSError):
        for e in os.scandir(root):
            if (
                not e.name.startswith(".")
                and e.is_dir(follow_symlinks=False)
                and e.name.endswith(tuple(f"-{r}" for r in AUTO_REASONS))
            ):
                found.append((e.stat(follow_symlinks=False).st_mtime_ns, e.name, Path(e.path)))
    return [p for _, _, p in sorted(found)]


class FlightServices:
    """~/rewind and ~/dump_flight, the per-tick stamp record and the automatic dumps."""

    def __init__(self, ctl, node, group):
        """`ctl` is the node's services.Control; `node` is used only to create the services."""
        self.ctl = ctl
        self._pending_ns = 0  # stamp of the newest valid observation (see seen())
        self._engine = None
        self._rings: dict[str, StampRing] = {}
        self._last: dict[str, int] = {}  # per session: its step after the last tick or move
        self._last_auto: float | None = None
        self._warned_no_dir = False
        self.last_dump = ""
        self.dumps = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._work_forever, name="flashrt-flight", daemon=True
        )
        self._writer.start()
        # the files, on a thread of their own: a copy never waits for another dump's write (a
        # second dump asked for while the first was written found its ring overwritten, review)
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._disk = threading.Thread(
            target=self._write_forever, name="flashrt-flight-disk", daemon=True
        )
        self._disk.start()
        atexit.register(self.close)  # a dump queued at deactivate is written before exit
        self._wake = node.create_guard_condition(lambda: None, callback_group=group)
        node.create_service(Rewind, "~/rewind", self.rewind, callback_group=group)
        node.create_service(DumpFlight, "~/dump_flight", self.dump_flight, callback_group=group)

    # -- per tick (control path: no allocation, no lock of its own) -------------------------------
    def seen(self, stamp) -> None:
        """A valid joint_states was taken: its header stamp (or, unstamped, its receive time)
        is the time of the step that consumes it."""
        ns = stamp_ns(stamp)
        self._pending_ns = ns if ns > 0 else time.time_ns()

    def tick(self, eng, session: str) -> None:
        """After a step of `session` (engine lock held): remember its observation's stamp."""
        if not eng.flight_ticks:
            return
        self._follow(eng)
        ring = self._rings.get(session)
        if ring is None:  # once per session, not per tick
            ring = self._rings[session] = StampRing(eng.flight_ticks)
        s = eng.session(session)
        ring.put(s.steps, s.parent_id, self._pending_ns)
        self._last[session] = s.steps

    def _follow(self, eng) -> None:
        """A new configure: the stamps, moves and steps seen of the old engine mean nothing."""
        if eng is not self._engine:
            self._engine, self._rings, self._last = eng, {}, {}

    def release(self) -> None:
        """A cleanup: let go of the engine and its stamps, so its arenas, pool and rings are
        freed with it (the node said "engine and GPU memory freed" while this reference kept
        them until the next configure)."""
        self._engine, self._rings, self._last = None, {}, {}

    def forget(self, eng, session: str) -> None:
        """The session's state was put elsewhere by a request (restore, branch, reset, a
        committed rollout; engine lock held): stamps of the steps after where it stands now
        belong to a past that is gone."""
        if not eng.flight_ticks:
            return
        self._follow(eng)
        steps = eng.session(session).steps
        self._last[session] = steps
        ring = self._rings.get(session)
        if ring is not None:
            ring.forget_after(steps)

    def dropped(self, eng, session: str) -> None:
        """A session was dropped (engine lock held): its stamps and counts go with it, so a
        node that branches into ever new session names keeps a bounded record."""
        if eng is self._engine:
            for per_session in (self._rings, self._last):
                per_session.pop(session, None)

    def _stamp(self, eng, s, step: int) -> int | None:
        ring = self._rings.get(s.name) if eng is self._engine else None
        return None if ring is None else ring.get(step, s.parent_id)

    # -- shared -----------------------------------------------------------------------------------
    def _engine_or_refuse(self):
        eng = self.ctl.configured()
        if not eng.flight_ticks:
            raise BadRequest(
                "the flight recorder is off: start the node with flight_ticks > 0 "
                "(the number of ticks to keep per session)"
            )
        return eng

    def _answer(self, what: str, resp, e: Exception):
        if isinstance(e, ValueError | CapacityError):  # BadRequest is a ValueError
            resp.message = f"{what} failed: {e}"
            self.ctl.say(resp.message, warn=True)
        else:
            resp.message = f"{what} failed: fault ({self.ctl.fault(f'{what} request', e)})"
        resp.success = False
        return resp

    def _copy_asked(self, a: Asked) -> Snapshot:
        """The steps of a ~/dump_flight copied to host memory a few ticks at a time, each batch
        under a short background hold of the engine lock, as much as fits between two control
        ticks: the whole ring in one hold stopped the control loop (100 ticks of 2.1 MB: 144 ms
        without a command on the 2-core CPU machine, review), and batches of a fixed 2 ms never
        fitted between the ticks of a 500 Hz loop stepping for 1 ms, so no dump of a running
        node ever succeeded (review). The state the request found current was copied in the
        request's own hold (`Asked.newest`) and is always written. The session may step
        meanwhile, each step overwriting its oldest slot: the oldest ticks go first, and every
        tick overwritten before its turn is left out and named. A request that moved the
        session elsewhere (restore, branch, reset, rewind) or dropped it, or a loop that left
        no room for 10 s, ends the copy: what was copied is written, the rest named. A cleanup
        ends the dump (nothing written: capsule_dir is no longer the node's)."""
        lock, eng = self.ctl.lock, a.engine()
        older = a.held[:-1]
        nbytes = eng.state_nbytes if eng is not None else 0
        states = torch.empty((len(a.held), nbytes), dtype=torch.uint8)  # off the lock
        states[-1].copy_(a.newest)
        cost = nbytes / COPY_BPS + 1e-4
        kept: list[int] = []
        lo, stop = 0, ""
        while lo < len(older) and not stop:
            # ticks per hold: ~BATCH_S of copying, or half the room between two ticks
            batch = max(1, int(min(BATCH_S, lock.room_s() / 2) / cost))
            hi = min(lo + batch, len(older))
            try:
                with lock.background(cost * (hi - lo), what="copy"):
                    s = a.sref()
                    if eng is None or self.ctl.engine is not eng:
                        raise BadRequest("the node was cleaned up while the dump was being copied")
                    try:
                        same = s is not None and eng.session(a.session) is s
                    except ValueError:
                        same = False
                    if not same or s.generation != a.generation:
                        stop = (
                            f"session {a.session!r} was moved (restore, branch, reset, rewind) "
                            "or dropped while its ring was being copied"
                        )
                        break
                    now = s.flight_steps()
                    for i in range(lo, hi):
                        if older[i] in now:  # else overwritten by a step since the request
                            states[i].copy_(s.flight_state(older[i]))
                            kept.append(i)
            except CapacityError as e:
                stop = str(e)
                break
            lo = hi
        copied = set(kept)
        lost = [t for i, t in enumerate(older[:lo]) if i not in copied]
        rest = older[lo:]
        why = []
        if lost:
            why.append(
                f"{len(lost)} tick(s) overwritten by the running session before their copy "
                f"(steps {spans(lost)})"
            )
        if rest:
            why.append(f"{len(rest)} older tick(s) not copied (steps {spans(rest)}): {stop}")
        kept.append(len(a.held) - 1)
        return Snapshot(
            a.session,
            a.parent_id,
            [a.held[i] for i in kept],
            [a.stamps[i] for i in kept],
            states[kept] if len(kept) < len(a.held) else states,
            eng.store,
            left_out="; ".join(why),
        )

    @staticmethod
    def _root(base: Path) -> Path:
        """capsule_dir/flight, made here if missing; BadRequest unless it is a real folder."""
        base.mkdir(parents=True, exist_ok=True)  # capsule_dir itself is the operator's choice
        root = base / FLIGHT_DIR
        with contextlib.suppress(FileExistsError):  # mkdir never follows a link at `root`
            os.mkdir(root)
        require_real_dir(root)
        return root

    # -- ~/rewind ---------------------------------------------------------------------------------
    def rewind(self, req, resp):
        t0 = time.perf_counter()
        try:
            return self._rewind(req, resp)
        except Exception as e:
            return self._answer("rewind", resp, e)
        finally:
            self.ctl.timed(t0, "rewind")

    def _rewind(self, req, resp):
        by_stamp = asked_stamp_ns(req.stamp)
        with self.ctl.lock:
            eng = self._engine_or_refuse()
            session = self.ctl.user_session(eng, req.session)
            s = eng.session(session)
            held = s.flight_steps()  # a range: nothing built per held step under the lock
            cur = held[-1]
            if by_stamp:
                target = None
                for t in reversed(held):
                    st = self._stamp(eng, s, t)
                    if st is not None and st <= by_stamp:
                        target = t
                        break
                if target is None:
                    known = [st for t in held if (st := self._stamp(eng, s, t)) is not None]
                    raise BadRequest(
                        f"no recorded tick of {session!r} at or before {by_stamp} ns: it holds "
                        + (
                            f"ticks stamped {min(known)} .. {max(known)} ns"
                            if known
                            else "no stamped tick"
                        )
                    )
            else:
                k = int(req.steps_back)
                require_past(held, session, eng.flight_ticks)
                if not 1 <= k <= len(held) - 1:
                    raise BadRequest(
                        f"cannot go {k} tick(s) back: session {session!r} holds steps "
                        f"{held[0]}..{cur}, so steps_back must be in [1, {len(held) - 1}] "
                        "(or give a stamp)"
                    )
                target = cur - k
            # everything that can refuse is checked first; then the rewind, then the capsule of
            # the state landed at (the current one now): a refused call changes nothing, the
            # capsule pool included (a checkpoint may evict an unpinned capsule)
            if target == cur and eng.poisoned(session):  # it would change nothing
                raise BadRequest(
                    f"session {session!r} is poisoned at step {cur} ({eng.poisoned(session)}), "
                    "the tick that stamp names: rewind to a tick before the fault"
                )
            if req.keep and target < cur:
                self._can_keep(eng, s, target)
            if target < cur:
                eng.rewind(cur - target, session)
                self.ctl.on_moved(eng, session)  # steps past the target will be ticked anew
            info = eng.checkpoint(session) if req.keep else None
            evicted = eng.last_evicted if req.keep else []
            step = eng.session_step(session)
        resp.success, resp.step = True, step
        resp.message = (
            f"{session!r} back from step {cur} to step {step}"
            if step < cur
            else f"{session!r} stays at step {cur}: it is the newest tick at or before the stamp"
        ) + (f"; kept as capsule {info.id}" if info is not None else "")
        resp.message += evictions(evicted)
        if info is not None:
            resp.capsule = capsule_msg(info)
        self.ctl.say(f"rewind: {resp.message}")
        return resp

    @staticmethod
    def _can_keep(eng, s, target: int) -> None:
        """What Engine.checkpoint would refuse once the session is at `target` (lock held)."""
        bad = nonfinite_regions(s.flight_state(target), s.table)
        if bad:
            raise BadRequest(
                f"step {target} of session {s.name!r} holds NaN or Inf in {', '.join(bad)}; "
                "refusing to keep it (rewind without keep, or ~/dump_flight writes it to files)"
            )
        eng.pool.require_room(" (nothing was rewound)")

    # -- ~/dump_flight ----------------------------------------------------------------------------
    async def dump_flight(self, req, resp):
        """The copy is taken at the commit boundary; the files are written on the flight thread
        while the service loop stays free for other requests."""
        t0 = time.perf_counter()
        try:
            with self.ctl.lock:  # what is asked for: checks and bookkeeping only
                eng = self._engine_or_refuse()
                session = self.ctl.user_session(eng, req.session)
                if not self.ctl.cfg.capsule_dir:
                    raise BadRequest("dump_flight needs capsule_dir to be set (where to write)")
                s = eng.session(session)
                held = list(s.flight_steps())
                newest = torch.empty(eng.state_nbytes, dtype=torch.uint8)
                newest.copy_(s.flight_state(held[-1]))  # one state: what the request found
                asked = Asked(
                    weakref.ref(eng),
                    weakref.ref(s),
                    s.name,
                    s.generation,
                    held,
                    [(self._stamp(eng, s, t) or 0) / 1e9 for t in held],
                    s.parent_id,
                    newest,
                    self.ctl.cfg.capsule_dir,
                    f"{session}-{utc_name(time.time())}",
                    Future(),
                )
            self._jobs.put(asked)  # copied on the flight thread, written on the writer's
            paths, _, snap = await asked.done
        except Exception as e:
            return self._answer("dump_flight", resp, e)
        finally:
            self.ctl.timed(t0, "dump_flight")
        resp.success, resp.files = True, [str(p) for p in paths]
        resp.message = (
            f"wrote {len(paths)} ticks of {session!r} (steps {snap.steps[0]}..{snap.steps[-1]}) "
            f"to {paths[0].parent}" + (f"; left out: {snap.left_out}" if snap.left_out else "")
        )
        return resp

    # -- automatic dumps --------------------------------------------------------------------------
    def on_step_error(self, eng, session: str) -> None:
        """A step of the live session failed (engine lock held, control thread): dump what led
        there. The copy is taken here: the poisoned session does not step, so the control thread
        has nothing else to do, and a recovery request (a reset or rewind, as the README
        advises) may come within milliseconds and move the ring (review: one 14-200 ms after
        the fault lost the dump, and used up flight_dump_interval_s, so the next fault's was
        skipped too). A step that faulted after moving the session on consumed the pending
        observation: its stamp is kept like a tick's. Whether it moved: its step count against
        where the last tick, or the last request that moved it, left it (a session not seen
        yet started from step 0)."""
        known = self._last if eng is self._engine else {}
        if eng.flight_ticks and eng.session(session).steps != known.get(session, 0):
            self.tick(eng, session)
        t0 = time.perf_counter()
        if self._dump_now(eng, session, "fault"):
            ms = (time.perf_counter() - t0) * 1e3
            self.ctl.fast_log.info(
                f"flight recorder: the fault's ring copied in {ms:.1f} ms, in the faulted tick "
                "(its periods are not counted as overruns)"
            )

    def on_stop(self, reason: str = "deactivate", wait_s: float | None = None) -> None:
        """The loop has stopped (a deactivate; a lifecycle shutdown or a signal while active,
        `reason` "stop": the ring lives on the device and goes with the process): dump the live
        session's ring, copied in this one hold of the engine lock (nothing steps now, so only
        requests wait for it), as a fault's is. `wait_s`: wait no longer for the lock (a
        signal's exit: a step stuck on the device must not keep the process from ending)."""
        with self.ctl.lock.within(-1 if wait_s is None else wait_s) as got:
            if not got:
                self.ctl.fast_log.warning(
                    f"flight recorder: {reason} dump skipped: a step or request held the engine "
                    f"for over {wait_s:g} s"
                )
                return
            eng = self.ctl.engine
            if eng is not None:
                self._dump_now(eng, self.ctl.live, reason)

    def _dump_now(self, eng, session: str, reason: str) -> bool:
        """Copy the session's newest ticks that fit in the disk bound to host memory now (engine
        lock held) and queue their files. A copy that fails (a device error, say) is logged and
        skipped, and does not use up flight_dump_interval_s: it never fails the caller."""
        before = self._last_auto
        want = self._wanted_dump(eng, session, reason)
        if want is None:
            return False
        try:
            s = eng.session(session)
            held = list(s.flight_steps())[-want.fit :]
            stamps = [(self._stamp(eng, s, t) or 0) / 1e9 for t in held]
            states = torch.empty((len(held), eng.state_nbytes), dtype=torch.uint8)
            for i, t in enumerate(held):
                states[i].copy_(s.flight_state(t))
            snap = Snapshot(session, s.parent_id, held, stamps, states, eng.store)
        except Exception as e:  # noqa: BLE001 - a failed dump never fails a step or deactivate
            self._last_auto = before
            self.ctl.fast_log.warning(
                f"flight recorder: {reason} dump of {session!r} skipped: {type(e).__name__}: {e}"
            )
            return False
        name = f"{session}-{utc_name(want.wall)}"
        self._writes.put((snap, want.capsule_dir, name, f"-{reason}", want.budget, reason, None))
        return True

    def _wanted_dump(self, eng, session: str, reason: str) -> Wanted | None:
        """An automatic dump of the session, or None (said why, when it is worth saying): the
        recorder off, no capsule_dir, the interval, a disk bound that holds no tick."""
        cfg, log = self.ctl.cfg, self.ctl.fast_log
        if cfg is None or not eng.flight_ticks or cfg.flight_dump_max_mb <= 0:
            return None
        if not cfg.capsule_dir:
            if not self._warned_no_dir:
                self._warned_no_dir = True
                log.warning("flight recorder: no capsule_dir, so automatic dumps are skipped")
            return None
        now = time.monotonic()
        if self._last_auto is not None and now - self._last_auto < cfg.flight_dump_interval_s:
            log.info(
                f"flight recorder: {reason} dump skipped, the last automatic one was "
                f"{now - self._last_auto:.1f} s ago (flight_dump_interval_s)"
            )
            return None
        budget = int(cfg.flight_dump_max_mb * 1e6)
        fit = budget // (eng.state_nbytes + FILE_SLACK)
        if fit < 1:
            log.warning(
                f"flight recorder: flight_dump_max_mb={cfg.flight_dump_max_mb} holds no tick "
                f"of {eng.state_nbytes} B; {reason} dump skipped"
            )
            return None
        self._last_auto = now
        return Wanted(time.time(), fit, budget, cfg.capsule_dir)

    # -- the flight thread ------------------------------------------------------------------------
    def _work_forever(self) -> None:
        name_os_thread()
        while (job := self._jobs.get()) is not None:
            self._asked(job)

    def _write_forever(self) -> None:
        name_os_thread()
        while (job := self._writes.get()) is not None:
            if isinstance(job, threading.Event):  # flush(): everything before it is written
                job.set()
                continue
            self._run(*job)

    def _wake_up(self) -> None:
        """Resume the awaiting service handler; at exit the guard condition may be gone, and
        nobody awaits the reply then."""
        with contextlib.suppress(Exception):
            self._wake.trigger()

    def _asked(self, a: Asked) -> None:
        try:
            snap = self._copy_asked(a)
        except Exception as e:  # noqa: BLE001 (the reply says why; the node goes on)
            a.done.set_exception(e)
            self._wake_up()
            return
        self._writes.put((snap, a.capsule_dir, a.name, "", None, "request", a.done))

    def _run(self, snap, base: str, name: str, tail: str, budget, reason: str, done) -> None:
        try:
            paths, folder = self._write(snap, Path(base).expanduser(), name, tail, budget)
        except Exception as e:  # noqa: BLE001
            if isinstance(e, DiskError):  # not a refused name or folder: the disk's trouble
                self.ctl.wrote(f"{reason} flight dump to {base}: {e}")
            if done is not None:
                done.set_exception(e)
                self._wake_up()
            else:
                self.ctl.fast_log.error(
                    f"flight recorder: {reason} dump of {snap.session!r} to {base} failed: {e}"
                )
            return
        self.ctl.wrote()
        self.last_dump, self.dumps = str(folder), self.dumps + 1
        if done is not None:
            done.set_result((paths, folder, snap))
            self._wake_up()
        self.ctl.fast_log.info(
            f"flight recorder: dumped {len(paths)} ticks of {snap.session!r} (steps "
            f"{snap.steps[0]}..{snap.steps[-1]}, {reason}) to {folder}"
        )

    def _write(self, snap: Snapshot, base: Path, name: str, tail: str, budget: int | None):
        """Write into a hidden folder of our own, bound it (automatic dumps), then rename it into
        place under a name reserved for it: nobody ever sees half a dump, and no dump replaces
        another. Returns the files and the folder. A disk that refuses (read-only, full, no
        permission) is the operator's to fix, as for a persisted checkpoint: BadRequest saying
        so, not a fault of the node."""
        try:
            return self._write_in(snap, base, name, tail, budget)
        except OSError as e:
            where = e.filename or base / FLIGHT_DIR
            raise DiskError(f"cannot write the flight dump at {where}: {e.strerror}") from None

    def _write_in(self, snap: Snapshot, base: Path, name: str, tail: str, budget: int | None):
        root = self._root(base)
        tmp = self._fresh(root, f".{name}{tail}", ".partial")
        try:
            require_real_dir(tmp)
            snap.write(tmp)
            if budget is not None:
                self._bound(root, tmp, budget)
            require_real_dir(root)
            files = sorted(tmp.iterdir(), key=by_step)
            folder = self._place(root, tmp, name, tail)
        except BaseException:
            if real_dir(root) and real_dir(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        return [folder / p.name for p in files], folder

    @staticmethod
    def _reserved(root: Path, name: str, tail: str):
        """New empty folders `root/name[-n]tail`, each made here with an exclusive mkdir (never
        an existing one), in suffix order; BadRequest once MAX_SUFFIX names are taken."""
        for n in range(1, MAX_SUFFIX + 1):
            path = root / (f"{name}{tail}" if n == 1 else f"{name}-{n}{tail}")
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            yield path
        raise BadRequest(f"no free folder name like {root / name}{tail} (tried {MAX_SUFFIX})")

    @staticmethod
    def _fresh(root: Path, name: str, tail: str) -> Path:
        """A new empty folder `root/name[-n]tail`, made here."""
        return next(FlightServices._reserved(root, name, tail))

    @staticmethod
    def _place(root: Path, tmp: Path, name: str, tail: str) -> Path:
        """Rename `tmp` to `root/name[-n]tail`: each name is reserved first with an exclusive
        mkdir, so the rename only ever replaces that empty folder of ours; a name taken (or
        filled meanwhile) moves on to the next suffix."""
        for folder in FlightServices._reserved(root, name, tail):
            try:
                os.rename(tmp, folder)
            except OSError as e:
                if e.errno not in TAKEN:
                    raise
                with contextlib.suppress(OSError):  # ours, if still empty; else not ours: kept
                    os.rmdir(folder)
                continue
            return folder
        raise AssertionError("unreachable: _reserved raises when no name is left")

    def _bound(self, root: Path, tmp: Path, budget: int) -> None:
        """Oldest ticks of the new dump, then the oldest automatic dumps, go until the automatic
        dumps fit in `budget` bytes. Only real folders under a real `root` are ever removed."""
        files = sorted(tmp.iterdir(), key=by_step)
        size = {p: p.stat(follow_symlinks=False).st_size for p in files}
        while len(files) > 1 and sum(size[p] for p in files) > budget:
            files.pop(0).unlink()
        mine = sum(size[p] for p in files)
        require_real_dir(root)
        older = auto_dumps(root)
        total = mine + sum(folder_bytes(d) for d in older)
        while older and total > budget:
            d = older.pop(0)
            total -= folder_bytes(d)
            if not (real_dir(root) and real_dir(d)):
                self.ctl.fast_log.warning(f"flight recorder: not removing {d}: not a real folder")
                continue
            shutil.rmtree(d, ignore_errors=True)
            self.ctl.fast_log.info(f"flight recorder: removed {d} (flight_dump_max_mb)")

    def diagnostics(self, eng, live: str) -> dict[str, str]:
        """Ring depth of the live session and the device bytes of all rings (lock held)."""
        depth = len(eng.session(live).flight_steps()) if eng.flight_ticks else 0
        return {
            "flight_depth": str(depth),
            "flight_bytes": str(eng.flight_bytes()),
            "flight_dumps": str(self.dumps),
            "flight_last_dump": self.last_dump,
        }

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until the dumps queued so far are written: a cleanup calls it before capsule_dir's
        lock goes (a deactivate's dump is written after the deactivate returns)."""
        if not self._disk.is_alive():
            return True
        done = threading.Event()
        self._writes.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued dumps, then end the flight thread and, once the copies it took
        are written, the writer's. Called at exit (main.py), or else by atexit."""
        atexit.unregister(self.close)  # done: the registry must not keep the node alive
        if self._writer.is_alive():
            self._jobs.put(None)
            self._writer.join(timeout=timeout)
        if self._disk.is_alive():
            self._writes.put(None)
            self._disk.join(timeout=timeout)
