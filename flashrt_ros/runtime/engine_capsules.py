"""The Engine's capsule verbs: checkpoint (in the pool, or persisted to capsule_dir in three
parts), restore, branch, session copies, pins, drops, and capsule files.

A mixin of Engine (engine.py), split out so that each file holds one subject: it works on the
Engine's sessions, pool and store, and like every Engine method each verb runs between two steps,
at a commit boundary. Arguments are checked before anything changes (BadRequest, a ValueError).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import stat
import time
from pathlib import Path

import torch

from flashrt_ros.capsules import diskfmt
from flashrt_ros.capsules.info import CapsuleInfo
from flashrt_ros.capsules.names import CAPSULE_NAME, check_capsule_name, is_issued_id
from flashrt_ros.capsules.pool import Capsule, CapsulePool
from flashrt_ros.capsules.store import CapsuleStore, check_path, same_file
from flashrt_ros.cuda.copy import copy_bytes
from flashrt_ros.errors import BadName, BadRequest, CorruptCapsule, DiskError, UnknownReference
from flashrt_ros.runtime.args import bool_arg, ref_arg
from flashrt_ros.runtime.inputs import numeric
from flashrt_ros.runtime.probe import CheckpointProbe
from flashrt_ros.runtime.session import Session

# the Engine's logger: the node shows these lines as "[runtime.engine] ..."
log = logging.getLogger("flashrt_ros.runtime.engine")


@dataclasses.dataclass(frozen=True)
class PendingPersist:
    """A persisted checkpoint begun (Engine.begin_persist): its info, file, state and digest."""

    info: CapsuleInfo
    path: Path
    state: torch.Tensor  # a host copy of the arena when it was begun
    digest: torch.Tensor  # that state's checksum lanes, on the device


def capsule_meta(s: Session, name: str, pin: bool, checksum: str) -> dict:
    """What a capsule of the session's current state records besides its id and stamp."""
    return dict(
        name=name,
        session=s.name,
        parent_id=s.parent_id,
        step=s.steps,
        pinned=pin,
        checksum=checksum,
    )


class CapsuleVerbs:
    """Engine's capsule verbs (the Engine sets up every attribute named here)."""

    pool: CapsulePool
    store: CapsuleStore
    device: torch.device
    state_nbytes: int
    use_graph: bool
    last_evicted: list[str]
    evicted_total: int
    _sessions: dict[str, Session]
    _poison: dict[str, str]
    _persisting: dict[str, str]
    _probes: dict[str, CheckpointProbe]
    _float_regions: list[str]
    _scratch: torch.Tensor | None
    _stream: torch.cuda.Stream | None

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
        persist = bool_arg(persist, "persist")
        if not persist and (probe := self._probe_of(s)).fused:
            slot = self.pool.free_slot()
            if slot is not None:  # one pass fills the slot: no copy after the wait
                self._check_new_name(name)
                return self._checkpoint_into(s, probe, slot, name, pin)
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
        cap = self.pool.put(
            s.arena.buf, digest=probe.digest, **capsule_meta(s, name, pin, checksum)
        )
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
            **capsule_meta(s, name, pin, checksum),
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
        pin = bool_arg(pin, "pin")
        why = self._poison.get(s.name)
        if why:
            raise BadRequest(
                f"session {s.name!r} is poisoned ({why}): its state is not "
                "worth keeping; restore, branch into or reset it first"
            )
        return s, name or "", pin

    def _check_new_name(self, name: str, loading: Path | None = None) -> None:
        """BadName unless `name` may name a new capsule: none in the pool, none being
        persisted, and no file of capsule_dir under it (an evicted persisted capsule's, or one
        not loaded at start: its name stays held until the file goes) other than `loading`."""
        self.pool.check_new(name)
        if not name:
            return
        if name in self._persisting.values():
            raise BadName(f"capsule name {name!r} is taken by a checkpoint being written")
        held = self.store.named_file(name)
        if held is not None and (loading is None or not same_file(held, loading)):
            raise BadName(
                f"capsule file {held.name} exists in capsule_dir and holds the name {name!r} "
                "(a persisted capsule evicted from the pool, or not loaded at start); pick "
                "another name, or load_capsule that file and drop it (a file this engine "
                "cannot load: move it out of capsule_dir)"
            )

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
        self._copy_in(cap, s, bool_arg(verify, "verify"))
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

    def _checkpoint_into(
        self, s: Session, probe: CheckpointProbe, slot: int, name: str, pin: bool
    ) -> CapsuleInfo:
        """The kernels' checkpoint of `s` into free `slot`: one pass copies the arena and its
        digest there while checking it. What needs nothing of the pass's result (the capsule's
        id, stamp and description) is made while the device runs it. A state holding NaN/Inf
        is refused as in _probe_finite: the slot stays free, no id is used up."""
        probe.issue(self.pool.slot_row(slot), self.pool.digest_row(slot))
        meta = capsule_meta(s, name, pin, "")
        cid, stamp = self.pool.peek_id(self.pool.id_taken), time.time()
        self._wait()
        meta["checksum"] = self._finite_checksum(s, probe)
        return self.pool.info(self.pool.adopt(slot, cid=cid, stamp=stamp, **meta))

    def _probe_finite(self, s: Session) -> tuple[CheckpointProbe, str]:
        """The probe (its `digest` is the arena's on the device) and the arena's hex checksum,
        after one pass and one wait. BadRequest naming the floating-point regions that hold
        NaN/Inf, having changed nothing."""
        probe = self._probe_of(s)
        probe.issue()
        if self._stream is not None:
            self._wait()
        return probe, self._finite_checksum(s, probe)

    def _finite_checksum(self, s: Session, probe: CheckpointProbe) -> str:
        """The finished pass's hex checksum; BadRequest naming the floating-point regions of
        `s` that hold NaN/Inf."""
        bad, checksum = probe.result()
        if bad:
            raise BadRequest(
                f"session {s.name!r} holds NaN or Inf in {', '.join(bad)}; refusing to "
                "checkpoint it (restore, branch into or reset the session)"
            )
        return checksum

    def _report_evictions(self) -> None:
        """Log the capsules the pool evicted to make room (LRU), once each, and keep them in
        `last_evicted` until the next call that adds a capsule: a planner's checkpoint reply
        names what it cost (a capsule it still counts on may be among them)."""
        self.last_evicted = list(self.pool.evicted)
        self.evicted_total += len(self.last_evicted)
        if self.pool.evicted:
            log.warning("capsule pool full: evicted %s", ", ".join(self.pool.evicted))
            self.pool.evicted.clear()

    def capsules(self) -> list[CapsuleInfo]:
        return self.pool.infos()

    def _file_hint(self, ref: str) -> str:
        """An unknown capsule reference that names a file of capsule_dir: a persisted capsule
        evicted from the pool (its file stays), or one not loaded at start. Said, so that a
        planner that persisted `grasp` is not just told it is unknown. One still being written
        (a persisted checkpoint whose reply has not come) is said to be so."""
        if isinstance(ref, str) and (ref in self._persisting or ref in self._persisting.values()):
            return (
                "; it is a persisted checkpoint still being written: it joins the pool with the "
                "checkpoint's reply"
            )
        folder = self.store.folder
        if folder is None or not isinstance(ref, str) or not CAPSULE_NAME.fullmatch(ref):
            return ""  # an id or a name only: never a path out of the folder
        path = folder / f"{ref}{diskfmt.SUFFIX}"
        if not os.path.isfile(path):
            return ""
        return (
            f"; capsule_dir holds {path.name}, a persisted capsule not in the pool (evicted, or "
            "not loaded at start): Engine.load_capsule brings it back, as does the node's next "
            "start when the pool has room; drop removes it"
        )

    def capsule(self, ref: str) -> CapsuleInfo:
        return self.pool.info(self.pool.get(ref))

    def drop(self, capsule: str) -> CapsuleInfo:
        """Drop a capsule; a persisted one loses its file in capsule_dir too (first, so a
        failing unlink leaves everything in place). A persisted capsule no longer in the pool
        (evicted, or not loaded at start: its file stays) is dropped by its file's name: the
        file goes, and its name is free again (tier "disk" in the reply)."""
        try:
            cap = self.pool.get(capsule)
        except UnknownReference:
            info = self._drop_file(capsule)
            if info is None:
                raise
            return info
        self.store.remove(self.pool.info(cap))
        return self.pool.drop(cap.info.id)

    def _drop_file(self, ref: str) -> CapsuleInfo | None:
        """Remove `capsule_dir/<ref>.fcap`, a capsule file of this policy not in the pool; None
        when there is no such file (the reference is unknown). Never a path out of the folder,
        never through a symlink, never a file still being written or another policy's."""
        folder = self.store.folder
        if folder is None or not isinstance(ref, str) or not CAPSULE_NAME.fullmatch(ref):
            return None
        if ref in self._persisting or ref in self._persisting.values():
            return None  # the unknown reference's hint says it is being written
        path = folder / f"{ref}{diskfmt.SUFFIX}"
        try:
            if not stat.S_ISREG(path.lstat().st_mode):
                return None
        except OSError:
            return None
        owner = self.store.owner(path)
        if owner is not None and owner in self.pool.caps:  # a live capsule loaded from it
            live = self.pool.info(self.pool.caps[owner]).label()
            raise BadRequest(f"{path.name} is the file of capsule {live}: drop that capsule")
        header = diskfmt.read_capsule_header(path)  # CorruptCapsule: not a capsule file
        self.store.check_header(path, header)  # another policy's: refused, left in place
        info = CapsuleInfo(
            id=header["id"],
            name=header["name"],
            session=header["session"],
            parent_id=header["parent_id"],
            step=header["step"],
            nbytes=self.state_nbytes,
            tier="disk",
            checksum=header["checksum"],
            pinned=header["pinned"],
            stamp=header["stamp"],
        )
        try:
            path.unlink()
        except OSError as e:
            raise DiskError(f"cannot remove {path}: {e.strerror}") from None
        self.store.forget(ref)
        log.info("dropped capsule file %s (%s, not in the pool)", path, info.label())
        return info

    def pin(self, capsule: str, pinned: bool = True) -> CapsuleInfo:
        """Pin or unpin; a persisted capsule's file gets the new pin too (atomic rewrite), so
        a restart keeps it. A failed rewrite leaves the pin as it was (a host-tier capsule
        brought back into a slot for the pin stays there: only the tiers changed)."""
        pinned = bool_arg(pinned, "pinned")
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

    # -- the disk tier ---------------------------------------------------------------------------
    def save_capsule(self, capsule: str, path: str | Path | None = None) -> Path:
        """Write a capsule to a new file (atomic; an existing file is never replaced); returns
        the path."""
        if path is None:
            raise BadRequest("save_capsule needs the path of the file to write")
        path = check_path(path)
        cap = self.pool.get(ref_arg(capsule, "capsule"))
        return self.store.write(path, self.pool.info(cap), self.pool.readable(cap))

    def _fresh_id(self) -> str:
        """The next id free in the pool, in capsule_dir and among the persists being written.
        Not used up here: the caller claims it once the pool took the capsule."""
        return self.pool.peek_id(lambda cid: self.store.id_taken(cid) or cid in self._persisting)

    def _file_id(self, header: dict, path: Path) -> str:
        """The id a loaded file keeps: its own when it is one we could have issued, no live
        capsule has it and no other file of capsule_dir is named for it (drop would remove
        that file); else a fresh one. It must also be an id this engine has not issued yet
        (one issued and dropped may still be in a planner's hands), except for the start's
        reload of this folder's own file (its token, store.written_here) under the name a
        persist gives it (`<name>.fcap`, `<id>.fcap`): an earlier run's persisted capsule keeps
        the id its planner kept, while a file copied in from another robot's folder, or under
        another name, never takes an id an earlier run issued for something else."""
        cid, name = header["id"], header["name"]
        if is_issued_id(cid) and cid not in self.pool.caps and self.store.may_keep_id(cid, path):
            own = (
                Path(path).stem in (cid, name)
                and self.store.in_folder(Path(path))
                and self.store.written_here(header)
            )
            if (self._reloading and own) or int(cid[1:]) >= self.pool.next_number():
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
            self._check_new_name(name, path)
        header, host = self.store.read(path)
        label = header["name"] if name is None else name
        if label:
            check_capsule_name(label)
            try:
                self._check_new_name(label, path)
            except BadName as e:
                raise BadName(f"{path}: {e} (or load it under another name: name=...)") from None
        if header["pinned"]:
            self.pool.require_room(f" ({path}: a pinned capsule needs a slot)")
        cid = self._file_id(header, path)
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
        self.store.adopt(path, info, live=self.pool.caps.__contains__)
        return info
