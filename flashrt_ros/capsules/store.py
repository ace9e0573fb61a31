"""The disk tier: capsule files in `capsule_dir` (persist, reload at start, remove on drop).

The store knows which files it owns (the ones it wrote or loaded from capsule_dir) and the
capsule each one holds, how they are named and what a header holds for this engine. The pool
knows nothing of files; the Engine checks everything that can refuse a call, then calls the
store, then the pool, so a refused call leaves pool and disk as they were. A persisted file is
never overwritten by another capsule; only a pin change rewrites it (atomically).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from flashrt_ros.capsules import diskfmt
from flashrt_ros.capsules.checksum import device_checksum, to_hex
from flashrt_ros.capsules.info import CapsuleInfo
from flashrt_ros.errors import (
    BadName,
    BadRequest,
    CorruptCapsule,
    DiskError,
    FingerprintMismatch,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Owned:
    """A file of capsule_dir and the capsule it holds (an id alone can be reused after an
    eviction: stamp and checksum tell the capsule apart)."""

    path: Path
    stamp: float
    checksum: str

    def holds(self, info: CapsuleInfo) -> bool:
        return self.stamp == info.stamp and self.checksum == info.checksum

    def still_holds(self, info: CapsuleInfo) -> bool:
        """holds(), checked on the disk too: the file may hold another capsule by now (another
        node sharing capsule_dir dropped it and persisted a new one under the name, or a file
        was copied in by hand); a missing or unreadable file is not this capsule's either."""
        if not self.holds(info):
            return False
        try:
            header = diskfmt.read_capsule_header(self.path)
        except (OSError, ValueError):
            return False
        return header["stamp"] == info.stamp and header["checksum"] == info.checksum


class NotLoaded(NamedTuple):
    """A file of capsule_dir the start did not load, and why."""

    path: Path
    reason: str


def make_folder(d: Path) -> Path:
    """capsule_dir, made when missing (a fresh robot, as the flight dumps make theirs), or
    BadRequest when it cannot be made or is no folder. Another process making it first is
    fine."""
    if not os.path.lexists(d):
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BadRequest(f"cannot create capsule_dir {d}: {e.strerror}") from None
        log.info("capsule_dir %s did not exist: created it", d)
    if not d.is_dir():
        raise BadRequest(f"capsule_dir {d} is not a folder")
    return d


class CapsuleStore:
    """Capsule files for one engine: its fingerprint and layout go into every header, and a file
    of another fingerprint or layout is refused on load."""

    def __init__(
        self,
        folder: str | Path | None,
        *,
        fingerprint: str,
        layout: list[dict],
        fingerprint_v1: Callable[[], str | None] = lambda: None,
        nbytes: int,
        policy_id: str,
    ):
        self.folder = Path(folder).expanduser() if folder else None  # "~/capsules" too
        self.fingerprint = fingerprint
        # returns the fingerprint earlier versions gave this engine (before derived_buffers
        # were digested; computed when first asked): a file of theirs, which carries no folder
        # token, is still this engine's
        self.fingerprint_v1 = fingerprint_v1
        self.layout = layout
        self.nbytes = int(nbytes)
        self.policy_id = policy_id
        self._files: dict[str, _Owned] = {}  # capsule id -> its file in `folder`
        self._listed: set[str] = set()  # names of the .fcap files seen in `folder` at reload
        # files of capsule_dir the last reload did not load, and why (unreadable, foreign,
        # symlink, no free slot)
        self.not_loaded: list[NotLoaded] = []
        # this folder's token (folder_token(), read or made at reload): the files it writes
        # carry it, so a file copied in from another robot's folder, under whatever name, is
        # told apart from this folder's own at the next start (Engine._file_id)
        self.token: str | None = None

    # -- headers and files -------------------------------------------------------------------------
    def header(self, info: CapsuleInfo) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "layout": self.layout,
            "nbytes": self.nbytes,
            "checksum": info.checksum,
            "id": info.id,
            "name": info.name,
            "session": info.session,
            "parent_id": info.parent_id,
            "step": int(info.step),
            "stamp": float(info.stamp),
            "pinned": bool(info.pinned),
            "policy": self.policy_id,
            **({"folder": self.token} if self.token else {}),
        }

    def written_here(self, header: dict) -> bool:
        """Whether a file's header says this folder wrote it: its token is ours, or it has none
        (a file of a version before the tokens: as before, it is taken for this folder's)."""
        theirs = header.get("folder")
        return theirs is None or (self.token is not None and theirs == self.token)

    def written_before_v2(self, header: dict) -> bool:
        """A file of the versions before folder tokens and derived_buffers' digest, written by
        this engine's policy, weights and layout as those versions fingerprinted them."""
        if "folder" in header:  # only versions with the new fingerprint write tokens
            return False
        v1 = self.fingerprint_v1()
        return v1 is not None and header["fingerprint"] == v1

    def write(self, path: str | Path, info: CapsuleInfo, state: torch.Tensor) -> Path:
        """Write a capsule file (atomic) holding `state`, the arena bytes of `info`; an
        existing file is never replaced."""
        path = check_path(path)
        if not path.parent.is_dir():
            raise BadRequest(f"folder {path.parent} does not exist")
        if os.path.lexists(path):
            raise BadRequest(f"{path} exists; remove it first or pick another path")
        payload = state.cpu().numpy().tobytes()
        try:
            return diskfmt.write_capsule_file(path, self.header(info), payload, overwrite=False)
        except FileExistsError:
            raise BadRequest(f"{path} exists; remove it first or pick another path") from None
        except OSError as e:  # disk full, read-only, permissions: the caller's input problem
            raise DiskError(f"cannot write {path}: {e.strerror}") from None

    def check_header(self, path: str | Path, header: dict) -> None:
        """Refuse a file of another engine before its payload is read."""
        if header["fingerprint"] != self.fingerprint and not self.written_before_v2(header):
            theirs = header.get("policy")
            which = (
                f"it was written by {theirs}, this engine runs {self.policy_id}"
                if isinstance(theirs, str) and theirs != self.policy_id
                else "other weights, layout, device or noise version"
            )
            raise FingerprintMismatch(
                f"{path}: capsule fingerprint {header['fingerprint']} does not match this "
                f"engine's {self.fingerprint} ({which})"
            )
        if header["nbytes"] != self.nbytes or header["layout"] != self.layout:
            raise FingerprintMismatch(f"{path}: state layout differs from this engine's")

    def read(self, path: str | Path) -> tuple[dict, torch.Tensor]:
        """A checked file's header and its state bytes as a host uint8 tensor."""
        path = check_path(path)
        header, payload = diskfmt.read_capsule_file(path, lambda h: self.check_header(path, h))
        host = torch.frombuffer(payload, dtype=torch.uint8)
        if to_hex(device_checksum(host)) != header["checksum"]:
            raise CorruptCapsule(f"{path}: state bytes do not match the recorded checksum")
        counter = self._step_counter(payload)
        if counter is not None and counter != header["step"]:
            raise CorruptCapsule(
                f"{path}: the header says step {header['step']}, the state's step counter "
                f"{counter}: the flight ring and the tick kinds follow the counter, so the two "
                "must agree"
            )
        return header, host

    def _step_counter(self, payload) -> int | None:
        """The state's own step counter (the int64 "step" row every session has)."""
        row = next((r for r in self.layout if r["name"] == "step" and r["nbytes"] == 8), None)
        if row is None:
            return None
        return int.from_bytes(payload[row["offset"] : row["offset"] + 8], "little", signed=True)

    # -- capsule_dir -------------------------------------------------------------------------------
    def require_folder(self) -> Path:
        if self.folder is None:
            raise BadRequest("persist needs capsule_dir to be set")
        return self.folder

    def path_for(self, info: CapsuleInfo) -> Path:
        return self.require_folder() / f"{info.name or info.id}{diskfmt.SUFFIX}"

    def id_known(self, cid: str) -> bool:
        """id_taken() without the disk: the files this store owns or saw at reload. For a plain
        checkpoint's fresh id, on the services' path (a file that appeared since is met by a
        persist's or a load's own check, which reads the disk)."""
        return cid in self._files or cid in self._listed

    def id_taken(self, cid: str) -> bool:
        """Whether a fresh id would meet a file of capsule_dir (or one this store remembers)."""
        if self.id_known(cid):
            return True
        return self.folder is not None and os.path.lexists(self.folder / f"{cid}{diskfmt.SUFFIX}")

    def may_keep_id(self, cid: str, path: str | Path) -> bool:
        """Whether a capsule loaded from `path` may keep the id `cid`: not when another file is
        named for that id or held by it (dropping the capsule would remove that file)."""
        owned = self._files.get(cid)
        if owned is not None and not same_file(owned.path, Path(path)):
            return False
        if self.folder is None:
            return True
        own = self.folder / f"{cid}{diskfmt.SUFFIX}"
        return not os.path.lexists(own) or same_file(own, Path(path))

    def named_file(self, name: str) -> Path | None:
        """capsule_dir's file for the capsule name `name` (`<name>.fcap`), when this store knows
        of one (seen at reload, or written or loaded since) and it is still there: while it
        exists the name stays held, even with its capsule out of the pool. Known names only, so
        a checkpoint under a new name touches no disk (a file put there by hand since is met by
        a persist's or a load's own check, as in id_known)."""
        if self.folder is None:
            return None
        file = f"{name}{diskfmt.SUFFIX}"
        if name not in self._listed and not any(o.path.name == file for o in self._files.values()):
            return None
        path = self.folder / file
        return path if os.path.lexists(path) else None

    def in_folder(self, path: Path) -> bool:
        """Whether `path` is a file of capsule_dir itself."""
        return self._in_folder(Path(path))

    def _in_folder(self, path: Path) -> bool:
        if self.folder is None:
            return False
        try:
            return os.path.samefile(path.parent, self.folder)
        except OSError:
            return False

    def free_path(self, info: CapsuleInfo) -> Path:
        """Where the capsule's file goes in capsule_dir; BadName when that file exists (a
        persisted capsule is never overwritten, not even one evicted from the pool)."""
        path = self.path_for(info)
        if os.path.lexists(path):
            raise BadName(
                f"capsule file {path.name} exists in capsule_dir (a capsule not in the pool: "
                "evicted, or not loaded at start); pick another name, or remove the file "
                "(Engine.load_capsule and drop_capsule, or by hand while the node is stopped)"
            )
        return path

    def own(self, info: CapsuleInfo, path: Path) -> None:
        """The capsule lives in the file just written for it (drop removes it, discard too)."""
        self._files[info.id] = _Owned(Path(path), info.stamp, info.checksum)

    def discard(self, info: CapsuleInfo) -> None:
        """Remove the file a persist just wrote for a capsule that did not make it into the
        pool (only that file: the entry says which)."""
        owned = self._files.pop(info.id, None)
        if owned is not None and owned.still_holds(info):
            owned.path.unlink(missing_ok=True)

    def still_not_loaded(self) -> list[NotLoaded]:
        """The files the start did not load that are still there (one moved out of capsule_dir
        by the operator is dealt with; one loaded since left the list in adopt)."""
        return [n for n in self.not_loaded if os.path.lexists(n.path)]

    def adopt(
        self, path: str | Path, info: CapsuleInfo, live: Callable[[str], bool] = lambda c: True
    ) -> None:
        """A capsule just loaded from a file of capsule_dir lives in that file from now on
        (drop removes it), unless another capsule that `live(id)` says is in the pool already
        does: the file of an evicted capsule, loaded again, is the loaded capsule's."""
        path = Path(path)
        # loaded now: no longer one the start did not load (/diagnostics named it until then)
        self.not_loaded = [n for n in self.not_loaded if not same_file(n.path, path)]
        if not self._in_folder(path) or path.name.startswith("."):
            return
        for cid, owned in list(self._files.items()):
            if same_file(owned.path, path):
                if live(cid):
                    return
                del self._files[cid]
        self._files[info.id] = _Owned(path, info.stamp, info.checksum)

    def remove(self, info: CapsuleInfo) -> None:
        """Delete the file of a dropped capsule (only the file holding this very capsule);
        DiskError when it cannot be removed, so the caller keeps the capsule."""
        owned = self._files.get(info.id)
        if owned is None:
            return
        if owned.still_holds(info):
            try:
                owned.path.unlink(missing_ok=True)
            except OSError as e:
                raise DiskError(f"cannot remove {owned.path}: {e.strerror}") from None
        elif owned.holds(info) and os.path.lexists(owned.path):
            log.warning(
                "capsule file %s left in place: it no longer holds capsule %s (replaced since "
                "it was written or loaded)",
                owned.path,
                info.label(),
            )
        del self._files[info.id]

    def owner(self, path: Path) -> str | None:
        """The id of the capsule whose file `path` is (persisted or loaded from it), if any."""
        return next((c for c, o in self._files.items() if same_file(o.path, path)), None)

    def forget(self, stem: str) -> None:
        """The file `<stem>.fcap` was removed (a drop by its name): its id and name are free."""
        self._listed.discard(stem)
        for cid in [c for c, o in self._files.items() if o.path.name == f"{stem}{diskfmt.SUFFIX}"]:
            del self._files[cid]

    def repin(self, info: CapsuleInfo) -> None:
        """Rewrite the pin in the file of a persisted capsule (atomic replace of our own file,
        the payload read back and checked first); nothing to do for other capsules."""
        owned = self._files.get(info.id)
        if owned is None or not owned.holds(info):
            return
        header, payload = self.read_file(owned.path)
        if header["stamp"] != info.stamp or header["checksum"] != info.checksum:
            raise BadRequest(f"{owned.path} no longer holds capsule {info.id}; pin not saved")
        header["pinned"] = bool(info.pinned)
        try:
            diskfmt.write_capsule_file(owned.path, header, payload)
        except OSError as e:
            raise DiskError(f"cannot rewrite {owned.path}: {e.strerror}") from None

    def read_file(self, path: Path) -> tuple[dict, bytearray]:
        return diskfmt.read_capsule_file(path, lambda h: self.check_header(path, h))

    # -- start -------------------------------------------------------------------------------------
    def reload(self, load: Callable[[Path], CapsuleInfo], room: Callable[[], int]) -> None:
        """Load the capsule files of the folder through `load`, pinned ones first, then newest
        first, while `room()` says a slot is free: a reload never evicts. Every file not loaded
        is logged and listed in `not_loaded` with the reason; none of them stops the start."""
        self.not_loaded = []
        d = self.folder
        if d is None:
            return
        make_folder(d)
        self.token = folder_token(d)
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as e:
            raise BadRequest(f"cannot list capsule_dir {d}: {e.strerror}") from None
        found = []
        for e in entries:
            if diskfmt.TEMP.fullmatch(e.name):
                self._clean_temp(Path(e.path))
            elif e.name.endswith(diskfmt.SUFFIX):
                self._listed.add(e.name[: -len(diskfmt.SUFFIX)])
                path = Path(e.path)
                try:
                    if e.is_symlink():
                        raise CorruptCapsule(f"{path}: is a symlink; capsule_dir holds files only")
                    header = diskfmt.read_capsule_header(path)
                    self.check_header(path, header)
                except Exception as err:  # noqa: BLE001 (a bad file never stops the start)
                    self._skip(path, err)
                    continue
                found.append((path, header))
        found.sort(key=lambda ph: (not ph[1]["pinned"], -ph[1]["stamp"], ph[0].name))
        for path, _header in found:
            if room() <= 0:
                self._skip(path, "the pool is full: every slot is taken (raise capsule_slots)")
                continue
            try:
                info = load(path)
            except Exception as err:  # noqa: BLE001
                self._skip(path, err)
                continue
            log.info("reloaded capsule %s (%s) from %s", info.id, info.name, path)

    def _skip(self, path: Path, why: object) -> None:
        reason = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
        self.not_loaded.append(NotLoaded(path, reason))
        log.warning("capsule file %s not loaded: %s", path, reason)

    def _clean_temp(self, path: Path) -> None:
        """Remove a temp file a killed write left behind: a regular file only (lstat, so a
        symlink of that name is left alone and never followed)."""
        try:
            if stat.S_ISREG(path.lstat().st_mode):
                path.unlink()
                log.warning("removed stale temp file %s (a write that did not finish)", path)
        except OSError as e:
            log.warning("cannot remove stale temp file %s: %s", path, e.strerror)


def check_path(path: object) -> Path:
    """A file path from str or os.PathLike (bytes, None or a number is a bad request)."""
    if isinstance(path, Path):
        p = path
    elif isinstance(path, str) and path:
        p = Path(path)
    elif isinstance(path, os.PathLike) and isinstance(os.fspath(path), str):
        p = Path(os.fspath(path))
    else:
        raise BadRequest(f"path must be a file path (str or Path), got {path!r}")
    if "\x00" in str(p):
        raise BadRequest(f"path {str(p)!r} holds a NUL byte")
    return p


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths are one file (False when either is missing)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


TOKEN_FILE = ".flashrt.folder"


def folder_token(folder: Path) -> str | None:
    """The folder's random token from `<folder>/.flashrt.folder`, made on first use; None where
    it can be neither read nor made (a read-only folder: nothing is written there anyway). A
    token file that holds no token (empty after a power cut) is replaced by a new one."""
    path = folder / TOKEN_FILE
    for _ in range(3):  # another process may make or replace it meanwhile: read it again
        try:
            text = path.read_text(errors="replace")[:64].strip()
        except FileNotFoundError:
            text = None
        except OSError as e:
            log.warning(
                "capsule_dir token %s unreadable (%s): files written here carry none", path, e
            )
            return None
        if text and text.isascii() and text.isalnum():
            return text
        token = secrets.token_hex(8)
        tmp = path.with_name(f"{TOKEN_FILE}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w") as f:
                f.write(f"{token}\n")
                f.flush()
                os.fsync(f.fileno())
            if text is None:
                os.link(tmp, path)  # never replaces one another process made meanwhile
            else:
                log.warning("capsule_dir token %s held no token: a new one replaces it", path)
                os.replace(tmp, path)
            return token
        except FileExistsError:
            continue
        except OSError:
            return None
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
    return None
