"""The disk tier: capsule files in `capsule_dir` (persist, reload at start, remove on drop).

The store knows which files it owns (the ones it wrote or reloaded), how they are named and
what a header holds for this engine. The pool knows nothing of files; the Engine calls the
store before it touches the pool, so a failed write leaves the pool as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from flashrt_ros.capsules import diskfmt
from flashrt_ros.capsules.checksum import device_checksum, to_hex
from flashrt_ros.capsules.info import CapsuleInfo

log = logging.getLogger(__name__)


class CapsuleStore:
    """Capsule files for one engine: its fingerprint and layout go into every header, and a file
    of another fingerprint or layout is refused on load."""

    def __init__(
        self,
        folder: str | Path | None,
        *,
        fingerprint: str,
        layout: list[dict],
        nbytes: int,
        policy_id: str,
    ):
        self.folder = Path(folder) if folder else None
        self.fingerprint = fingerprint
        self.layout = layout
        self.nbytes = int(nbytes)
        self.policy_id = policy_id
        self._files: dict[str, Path] = {}  # capsule id -> its file in `folder`, owned by us

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
            "policy": self.policy_id,
        }

    def write(self, path: str | Path, info: CapsuleInfo, state: torch.Tensor) -> Path:
        """Write a capsule file (atomic) holding `state`, the arena bytes of `info`."""
        path = Path(path)
        if not path.parent.is_dir():
            raise ValueError(f"folder {path.parent} does not exist")
        try:
            return diskfmt.write_capsule_file(
                path, self.header(info), state.cpu().numpy().tobytes()
            )
        except OSError as e:  # disk full, read-only, permissions: the caller's input problem
            raise ValueError(f"cannot write {path}: {e.strerror}") from None

    def read(self, path: str | Path) -> tuple[dict, torch.Tensor]:
        """A checked file's header and its state bytes as a host uint8 tensor."""
        header, payload = diskfmt.read_capsule_file(path)
        if header["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"{path}: capsule fingerprint {header['fingerprint']} does not match this "
                f"engine's {self.fingerprint} (other policy, weights, layout or device)"
            )
        if header["nbytes"] != self.nbytes or header["layout"] != self.layout:
            raise ValueError(f"{path}: state layout differs from this engine's")
        host = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if to_hex(device_checksum(host)) != header["checksum"]:
            raise ValueError(f"{path}: state bytes do not match the recorded checksum")
        return header, host

    # -- capsule_dir -------------------------------------------------------------------------------
    def require_folder(self) -> Path:
        if self.folder is None:
            raise ValueError("persist needs capsule_dir to be set")
        return self.folder

    def path_for(self, info: CapsuleInfo) -> Path:
        return self.require_folder() / f"{info.name or info.id}{diskfmt.SUFFIX}"

    def id_taken(self, cid: str) -> bool:
        """Whether a fresh id would meet a file already in capsule_dir."""
        return self.folder is not None and (self.folder / f"{cid}{diskfmt.SUFFIX}").exists()

    def persist(self, info: CapsuleInfo, state: torch.Tensor) -> Path:
        path = self.write(self.path_for(info), info, state)
        self._files[info.id] = path
        return path

    def discard(self, path: Path) -> None:
        """Remove a file this store just wrote for a capsule that did not make it into the pool."""
        path.unlink(missing_ok=True)

    def owns(self, cid: str) -> bool:
        return cid in self._files

    def remove(self, cid: str) -> None:
        """Delete the file of a dropped capsule (only a file this store owns); ValueError when the
        file cannot be removed, so the caller keeps the capsule."""
        f = self._files.get(cid)
        if f is None:
            return
        try:
            f.unlink(missing_ok=True)
        except OSError as e:
            raise ValueError(f"cannot remove {f}: {e.strerror}") from None
        del self._files[cid]

    def reload(self, load: Callable[[Path], CapsuleInfo]) -> None:
        """Load every capsule file of the folder through `load`; a bad file is skipped and said."""
        d = self.folder
        if d is None:
            return
        if not d.is_dir():
            raise ValueError(f"capsule_dir {d} is not a folder")
        for f in sorted(d.glob(f"*{diskfmt.SUFFIX}")):
            try:
                info = load(f)
                self._files[info.id] = f
                log.info("reloaded capsule %s (%s) from %s", info.id, info.name, f)
            except (ValueError, RuntimeError) as e:
                log.warning("skipping capsule file %s: %s", f, e)
