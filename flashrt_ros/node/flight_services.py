"""The flight recorder in the node: ~/rewind, ~/dump_flight, automatic dumps, tick stamps.

The Engine keeps, per session, the states the last `flight_ticks` steps started from
(runtime/flight.py). The node adds what only it knows: the time of each tick. For every step it
records, in a preallocated host ring, the stamp of the observation that step consumed (the
joint_states header stamp; its receive time when the header is zero). That stamp is what
~/rewind by time looks up, and what each dumped capsule carries in its header `stamp`: the
capsule of step t holds the state after the observation stamped `stamp` was consumed, so
`flashrt-replay --from-capsule` continues with the bag's messages after that stamp.

Dumps copy the ring to host memory under the engine lock (the ring moves at every step, so the
copy must be atomic), then write the files on a thread of their own: neither the control loop
nor the executor (joint_states in observation mode) waits for the disk. A dump goes to a hidden
folder that is renamed into place when complete, `capsule_dir/flight/<session>-<UTC time>/`,
one `<session>-<step>.fcap` per tick; subfolders are never reloaded into the pool. Automatic
dumps (a step error, a deactivate) end in `-fault` / `-deactivate`, are throttled
(`flight_dump_interval_s`) and kept within `flight_dump_max_mb` by removing the oldest
automatic dumps first; dumps asked for with ~/dump_flight are never removed by the node.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rclpy.task import Future

from flashrt_ros.capsules import diskfmt
from flashrt_ros.capsules.checksum import device_checksum, to_hex
from flashrt_ros.capsules.info import CapsuleInfo
from flashrt_ros.capsules.names import check_capsule_name
from flashrt_ros.errors import BadName, BadRequest, CapacityError
from flashrt_ros.node.convert import capsule_msg
from flashrt_ros.srv import DumpFlight, Rewind

FLIGHT_DIR = "flight"  # subfolder of capsule_dir holding the dumps
AUTO_REASONS = ("fault", "deactivate")
FILE_SLACK = 8 * 1024  # per file, besides the state: magic, JSON header, digest (estimate)


def stamp_ns(stamp) -> int:
    """builtin_interfaces/Time as integer nanoseconds."""
    return int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)


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

    def write(self, folder: Path) -> list[Path]:
        """One capsule file per step into `folder` (created here), oldest first."""
        folder.mkdir(parents=False, exist_ok=False)
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
            out.append(self.store.write(folder / f"{cid}{diskfmt.SUFFIX}", info, state))
        return out


def utc_name(t: float) -> str:
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


def folder_bytes(folder: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for e in os.scandir(folder):
            with contextlib.suppress(OSError):
                total += e.stat(follow_symlinks=False).st_size
    return total


def auto_dumps(root: Path) -> list[Path]:
    """The automatic dump folders under `root`, oldest first."""
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
        self._last_auto: float | None = None
        self._warned_no_dir = False
        self.last_dump = ""
        self.dumps = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._work_forever, name="flashrt-flight", daemon=True
        )
        self._writer.start()
        atexit.register(self.close)  # a dump queued at deactivate is written before exit
        self._wake = node.create_guard_condition(lambda: None, callback_group=group)
        node.create_service(Rewind, "~/rewind", self.rewind, callback_group=group)
        node.create_service(DumpFlight, "~/dump_flight", self.dump_flight, callback_group=group)

    # -- per tick (control path: no allocation, no lock of its own) -------------------------------
    def seen(self, stamp) -> None:
        """A valid joint_states was taken: its header stamp (or, unstamped, its receive time)
        is the time of the step that consumes it."""
        ns = int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)
        self._pending_ns = ns if ns > 0 else time.time_ns()

    def tick(self, eng, session: str) -> None:
        """After a step of `session` (engine lock held): remember its observation's stamp."""
        if not eng.flight_ticks:
            return
        if eng is not self._engine:  # a new configure: stamps of the old engine mean nothing
            self._engine, self._rings = eng, {}
        ring = self._rings.get(session)
        if ring is None:  # once per session, not per tick
            ring = self._rings[session] = StampRing(eng.flight_ticks)
        s = eng.session(session)
        ring.put(s.steps, s.parent_id, self._pending_ns)

    def _stamp(self, eng, s, step: int) -> int | None:
        ring = self._rings.get(s.name) if eng is self._engine else None
        return None if ring is None else ring.get(step, s.parent_id)

    # -- shared -----------------------------------------------------------------------------------
    def _engine_or_refuse(self):
        eng = self.ctl.engine
        if eng is None:
            raise BadRequest("node is not configured: configure it (lifecycle) first")
        if not eng.flight_ticks:
            raise BadRequest(
                "the flight recorder is off: start the node with flight_ticks > 0 "
                "(the number of ticks to keep per session)"
            )
        return eng

    def _session(self, eng, name: str) -> str:
        s = name or self.ctl.live
        if s.startswith("_"):
            raise BadName(f"session {s!r} is reserved (internal)")
        eng.session(s)  # UnknownReference naming the sessions there are
        return s

    def _answer(self, what: str, resp, e: Exception):
        if isinstance(e, ValueError | CapacityError):  # BadRequest is a ValueError
            resp.message = f"{what} failed: {e}"
            self.ctl.log.warning(resp.message)
        else:
            resp.message = f"{what} failed: fault ({self.ctl.fault(f'{what} request', e)})"
        resp.success = False
        return resp

    def _timed(self, t0: float) -> None:
        st = self.ctl.stats
        with st.lock:
            st.service_us.add((time.perf_counter() - t0) * 1e6)

    def _snapshot(self, eng, session: str, newest: int | None = None) -> Snapshot:
        """Copy the held steps (the newest `newest` of them) to host memory (lock held)."""
        s = eng.session(session)
        held = list(s.flight_steps())
        if newest is not None:
            held = held[-newest:]
        states = torch.empty((len(held), eng.state_nbytes), dtype=torch.uint8)
        for i, t in enumerate(held):
            states[i].copy_(s.flight_state(t))
        stamps = [(self._stamp(eng, s, t) or 0) / 1e9 for t in held]
        return Snapshot(s.name, s.parent_id, held, stamps, states, eng.store)

    def _root(self) -> Path:
        return Path(self.ctl.cfg.capsule_dir) / FLIGHT_DIR

    def _new_folder(self, name: str) -> Path:
        root = self._root()
        root.mkdir(parents=True, exist_ok=True)
        folder, n = root / name, 1
        while folder.exists():
            n += 1
            folder = root / f"{name}-{n}"
        return folder

    # -- ~/rewind ---------------------------------------------------------------------------------
    def rewind(self, req, resp):
        t0 = time.perf_counter()
        try:
            return self._rewind(req, resp)
        except Exception as e:
            return self._answer("rewind", resp, e)
        finally:
            self._timed(t0)

    def _rewind(self, req, resp):
        by_stamp = stamp_ns(req.stamp)
        with self.ctl.lock:
            eng = self._engine_or_refuse()
            session = self._session(eng, req.session)
            s = eng.session(session)
            held = eng.flight(session)
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
                if not 1 <= k <= len(held) - 1:
                    raise BadRequest(
                        f"cannot go {k} tick(s) back: session {session!r} holds steps "
                        f"{held[0]}..{cur}, so steps_back must be in [1, {len(held) - 1}] "
                        "(or give a stamp)"
                    )
                target = cur - k
            info = eng.checkpoint_at(target, session) if req.keep else None
            if target < cur:
                try:
                    eng.rewind(cur - target, session)
                except BaseException:
                    if info is not None:  # a refused rewind keeps no capsule either
                        eng.drop(info.id)
                    raise
            step = eng.session_step(session)
        resp.success, resp.step = True, step
        resp.message = f"{session!r} back from step {cur} to step {step}" + (
            f"; kept as capsule {info.id}" if info is not None else ""
        )
        if info is not None:
            resp.capsule = capsule_msg(info)
        self.ctl.log.info(f"rewind: {resp.message}")
        return resp

    # -- ~/dump_flight ----------------------------------------------------------------------------
    async def dump_flight(self, req, resp):
        """The copy is taken at the commit boundary; the files are written on the flight thread
        while the executor stays free (joint_states keep flowing in observation mode)."""
        t0 = time.perf_counter()
        try:
            with self.ctl.lock:
                eng = self._engine_or_refuse()
                session = self._session(eng, req.session)
                if not self.ctl.cfg.capsule_dir:
                    raise BadRequest("dump_flight needs capsule_dir to be set (where to write)")
                snap = self._snapshot(eng, session)
            folder = self._new_folder(f"{session}-{utc_name(time.time())}")
            done: Future = Future()
            self._jobs.put((snap, folder, None, "request", done))
            paths = await done
        except Exception as e:
            return self._answer("dump_flight", resp, e)
        finally:
            self._timed(t0)
        resp.success, resp.files = True, [str(p) for p in paths]
        resp.message = (
            f"wrote {len(paths)} ticks of {session!r} (steps {snap.steps[0]}..{snap.steps[-1]}) "
            f"to {paths[0].parent}"
        )
        return resp

    # -- automatic dumps --------------------------------------------------------------------------
    def on_step_error(self, eng, session: str) -> None:
        """A step of the live session failed (engine lock held): keep what led there."""
        self._auto(eng, session, "fault")

    def on_deactivate(self) -> None:
        with self.ctl.lock:
            eng = self.ctl.engine
            if eng is not None:
                self._auto(eng, self.ctl.live, "deactivate")

    def _auto(self, eng, session: str, reason: str) -> None:
        cfg, log = self.ctl.cfg, self.ctl.log
        if cfg is None or not eng.flight_ticks or cfg.flight_dump_max_mb <= 0:
            return
        if not cfg.capsule_dir:
            if not self._warned_no_dir:
                self._warned_no_dir = True
                log.warning("flight recorder: no capsule_dir, so automatic dumps are skipped")
            return
        now = time.monotonic()
        if self._last_auto is not None and now - self._last_auto < cfg.flight_dump_interval_s:
            log.info(
                f"flight recorder: {reason} dump skipped, the last automatic one was "
                f"{now - self._last_auto:.1f} s ago (flight_dump_interval_s)"
            )
            return
        budget = int(cfg.flight_dump_max_mb * 1e6)
        fit = budget // (eng.state_nbytes + FILE_SLACK)
        if fit < 1:
            log.warning(
                f"flight recorder: flight_dump_max_mb={cfg.flight_dump_max_mb} holds no tick "
                f"of {eng.state_nbytes} B; {reason} dump skipped"
            )
            return
        try:
            snap = self._snapshot(eng, session, newest=fit)
            folder = self._new_folder(f"{session}-{utc_name(time.time())}-{reason}")
        except Exception as e:  # noqa: BLE001 (a failed dump never stops the node)
            log.error(f"flight recorder: {reason} dump failed: {type(e).__name__}: {e}")
            return
        self._last_auto = now
        self._jobs.put((snap, folder, budget, reason, None))

    # -- the flight thread ------------------------------------------------------------------------
    def _work_forever(self) -> None:
        while (job := self._jobs.get()) is not None:
            snap, folder, budget, reason, done = job
            try:
                paths = self._write(snap, folder, budget)
            except Exception as e:  # noqa: BLE001
                if done is not None:
                    done.set_exception(e)
                    self._wake.trigger()
                else:
                    self.ctl.log.error(f"flight recorder: {reason} dump to {folder} failed: {e}")
                continue
            self.last_dump, self.dumps = str(folder), self.dumps + 1
            if done is not None:
                done.set_result(paths)
                self._wake.trigger()
            self.ctl.log.info(
                f"flight recorder: dumped {len(paths)} ticks of {snap.session!r} (steps "
                f"{snap.steps[0]}..{snap.steps[-1]}, {reason}) to {folder}"
            )

    def _write(self, snap: Snapshot, folder: Path, budget: int | None) -> list[Path]:
        """Write into a hidden folder, bound it (automatic dumps), then rename it into place:
        nobody ever sees half a dump."""
        tmp = folder.parent / f".{folder.name}.partial"
        try:
            snap.write(tmp)
            if budget is not None:
                self._bound(tmp, budget)
            os.rename(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return sorted(folder.iterdir(), key=lambda p: int(p.stem.rsplit("-", 1)[1]))

    def _bound(self, tmp: Path, budget: int) -> None:
        """Oldest ticks of the new dump, then the oldest automatic dumps, go until the automatic
        dumps fit in `budget` bytes."""
        files = sorted(tmp.iterdir(), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
        size = {p: p.stat().st_size for p in files}
        while len(files) > 1 and sum(size[p] for p in files) > budget:
            files.pop(0).unlink()
        mine = sum(size[p] for p in files)
        older = auto_dumps(tmp.parent)
        total = mine + sum(folder_bytes(d) for d in older)
        while older and total > budget:
            d = older.pop(0)
            total -= folder_bytes(d)
            shutil.rmtree(d, ignore_errors=True)
            self.ctl.log.info(f"flight recorder: removed {d} (flight_dump_max_mb)")

    def diagnostics(self, eng, live: str) -> dict[str, str]:
        """Ring depth of the live session and the device bytes of all rings (lock held)."""
        depth = len(eng.flight(live)) if eng.flight_ticks else 0
        return {
            "flight_depth": str(depth),
            "flight_bytes": str(eng.flight_bytes()),
            "flight_dumps": str(self.dumps),
            "flight_last_dump": self.last_dump,
        }

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued dumps, then end the flight thread."""
        if self._writer.is_alive():
            self._jobs.put(None)
            self._writer.join(timeout=timeout)
